"""Write a tiny random-weight BERT cross-encoder as a GGUF that ``llama-server --reranking`` serves.

No small reranking GGUF is published on the package registries, so the embedded default makes one
(once, cached) to serve ``/v1/rerank``: the route then runs llama.cpp's real reranking code (the
tokenizer, a BERT graph, rank pooling, the classification head), as it would with
bge-reranker or jina-reranker. The scores are those of random weights: right in shape, meaningless
in value. Serve a real reranker (``[embedded] rerank_model_path``) for meaningful scores.

The file is written with the standard library alone (GGUF v3, F32 tensors): a WordPiece vocabulary
of BERT's special tokens plus every printable ASCII character (word start and continuation), 2
layers, hidden size 32, 2 heads, 2,048 positions, a one-label classification head. About 400 KB;
deterministic.

Example::

    path = ensure_tiny_reranker()      # ~/.cache/passerelle/models/passerelle-tiny-reranker.gguf
    # llama-server -m PATH --reranking  ->  POST /v1/rerank {"query": ..., "documents": [...]}
"""

from __future__ import annotations

import random
import struct
from pathlib import Path
from typing import Any, cast

from passerelle.paths import cache_dir

MODEL_NAME = "passerelle-tiny-reranker.gguf"
MODEL_ID = "tiny-reranker"

# GGUF value types (gguf.h)
_U32, _I32, _F32, _BOOL, _STR, _ARR = 4, 5, 6, 7, 8, 9
_ALIGN = 32
# llama.cpp's token types and pooling
_NORMAL, _UNKNOWN, _CONTROL, _UNUSED = 1, 2, 3, 5
_POOLING_RANK = 4

HIDDEN, LAYERS, HEADS, FF, CTX = 32, 2, 2, 64, 2048


def vocabulary() -> tuple[list[str], list[int]]:
    """BERT's layout (``[PAD]`` 0, ``[unused*]``, ``[UNK]`` 100, ``[CLS]`` 101, ``[SEP]`` 102,
    ``[MASK]`` 103), then each printable character as a word start (``▁c``, llama.cpp's phantom
    space) and as a continuation (``c``): any ASCII text tokenizes, one character at a time."""
    tokens = ["[PAD]"] + [f"[unused{i}]" for i in range(1, 100)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    types = [_CONTROL] + [_UNUSED] * 99 + [_UNKNOWN, _CONTROL, _CONTROL, _CONTROL]
    chars = [chr(c) for c in range(33, 127)]
    for c in chars:
        tokens.append("\u2581" + c)
        types.append(_NORMAL)
    for c in chars:
        tokens.append(c)
        types.append(_NORMAL)
    return tokens, types


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, vtype: int, value: object) -> bytes:
    out = _s(key) + struct.pack("<I", vtype)
    if vtype == _STR:
        return out + _s(value)  # type: ignore[arg-type]
    if vtype == _ARR:
        etype, items = cast(tuple[int, list[Any]], value)
        out += struct.pack("<IQ", etype, len(items))
        if etype == _STR:
            return out + b"".join(_s(i) for i in items)
        return out + struct.pack(f"<{len(items)}{'i' if etype == _I32 else 'I'}", *items)
    fmt = {_U32: "<I", _I32: "<i", _F32: "<f", _BOOL: "<?"}[vtype]
    return out + struct.pack(fmt, value)


def _tensors(n_vocab: int, seed: int) -> list[tuple[str, tuple[int, ...], list[float]]]:
    """(name, dims innermost first, values) of every tensor the BERT graph loads."""
    rng = random.Random(seed)

    def rand(*dims: int) -> list[float]:
        n = 1
        for d in dims:
            n *= d
        return [rng.gauss(0.0, 0.2) for _ in range(n)]

    def const(value: float, n: int) -> list[float]:
        return [value] * n

    h = HIDDEN
    out = [("token_embd.weight", (h, n_vocab), rand(h, n_vocab)),
           ("token_types.weight", (h, 2), rand(h, 2)),
           ("position_embd.weight", (h, CTX), rand(h, CTX)),
           ("token_embd_norm.weight", (h,), const(1.0, h)),
           ("token_embd_norm.bias", (h,), const(0.0, h))]
    for i in range(LAYERS):
        b = f"blk.{i}."
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            out += [(b + name + ".weight", (h, h), rand(h, h)), (b + name + ".bias", (h,), rand(h))]
        out += [(b + "attn_output_norm.weight", (h,), const(1.0, h)),
                (b + "attn_output_norm.bias", (h,), const(0.0, h)),
                (b + "ffn_up.weight", (h, FF), rand(h, FF)), (b + "ffn_up.bias", (FF,), rand(FF)),
                (b + "ffn_down.weight", (FF, h), rand(FF, h)), (b + "ffn_down.bias", (h,), rand(h)),
                (b + "layer_output_norm.weight", (h,), const(1.0, h)),
                (b + "layer_output_norm.bias", (h,), const(0.0, h))]
    out += [("cls.weight", (h, h), rand(h, h)), ("cls.bias", (h,), rand(h)),
            ("cls.output.weight", (h, 1), rand(h, 1)), ("cls.output.bias", (1,), rand(1))]
    return out


def write_tiny_reranker(path: Path, *, seed: int = 0) -> Path:
    """Write the GGUF to ``path`` (replaced atomically); returns ``path``."""
    tokens, types = vocabulary()
    meta = [
        _kv("general.architecture", _STR, "bert"),
        _kv("general.name", _STR, "passerelle tiny reranker (random weights)"),
        _kv("general.alignment", _U32, _ALIGN),
        _kv("bert.context_length", _U32, CTX),
        _kv("bert.embedding_length", _U32, HIDDEN),
        _kv("bert.feed_forward_length", _U32, FF),
        _kv("bert.block_count", _U32, LAYERS),
        _kv("bert.attention.head_count", _U32, HEADS),
        _kv("bert.attention.layer_norm_epsilon", _F32, 1e-12),
        _kv("bert.attention.causal", _BOOL, False),
        _kv("bert.pooling_type", _U32, _POOLING_RANK),
        _kv("bert.classifier.output_labels", _ARR, (_STR, ["LABEL_0"])),
        _kv("tokenizer.ggml.model", _STR, "bert"),
        _kv("tokenizer.ggml.pre", _STR, "default"),
        _kv("tokenizer.ggml.tokens", _ARR, (_STR, tokens)),
        _kv("tokenizer.ggml.token_type", _ARR, (_I32, types)),
        _kv("tokenizer.ggml.token_type_count", _U32, 2),
        _kv("tokenizer.ggml.padding_token_id", _U32, 0),
        _kv("tokenizer.ggml.unknown_token_id", _U32, 100),
        _kv("tokenizer.ggml.cls_token_id", _U32, 101),
        _kv("tokenizer.ggml.bos_token_id", _U32, 101),
        _kv("tokenizer.ggml.seperator_token_id", _U32, 102),
        _kv("tokenizer.ggml.mask_token_id", _U32, 103),
        _kv("tokenizer.ggml.add_bos_token", _BOOL, True),
        _kv("tokenizer.ggml.add_eos_token", _BOOL, False),
    ]
    tensors = _tensors(len(tokens), seed)
    infos, blobs, offset = [], [], 0
    for name, dims, values in tensors:
        infos.append(_s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
                     + struct.pack("<IQ", 0, offset))  # type 0: F32
        blob = struct.pack(f"<{len(values)}f", *values)
        blob += b"\0" * (-len(blob) % _ALIGN)
        blobs.append(blob)
        offset += len(blob)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(meta) + b"".join(infos)
    head += b"\0" * (-len(head) % _ALIGN)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_suffix(".partial")
    staged.write_bytes(head + b"".join(blobs))
    staged.replace(path)
    return path


def ensure_tiny_reranker() -> Path:
    """The cached tiny reranker, written on first use."""
    path = cache_dir() / "models" / MODEL_NAME
    return path if path.is_file() else write_tiny_reranker(path)
