"""Write a tiny random-weight BERT cross-encoder as a GGUF that ``llama-server --reranking`` serves.

No small reranking GGUF is published on the package registries, so the embedded default makes one
(once, cached) to serve ``/v1/rerank``: the route then runs llama.cpp's real reranking code (the
tokenizer, a BERT graph, rank pooling, the classification head), as it would with
bge-reranker or jina-reranker. The scores are those of random weights: right in shape, meaningless
in value. Serve a real reranker (``[embedded] rerank_model_path``) for meaningful scores.

The file is written with the standard library alone (``gguf_file``: GGUF v3, F32 tensors): a WordPiece vocabulary
of BERT's special tokens plus every printable ASCII character (word start and continuation), 2
layers, hidden size 32, 2 heads, 2,048 positions, a one-label classification head. About 400 KB;
deterministic.

Example::

    path = ensure_tiny_reranker()      # ~/.cache/passerelle/models/passerelle-tiny-reranker.gguf
    # llama-server -m PATH --reranking  ->  POST /v1/rerank {"query": ..., "documents": [...]}
"""

from __future__ import annotations

import random
from pathlib import Path

from passerelle.paths import cache_dir
from passerelle.runtimes.gguf_file import ALIGN, ARR, BOOL, F32, F32V, I32, STR, U32, Tensor, f32, kv, write_gguf

MODEL_NAME = "passerelle-tiny-reranker.gguf"
MODEL_ID = "tiny-reranker"

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
        kv("general.architecture", STR, "bert"),
        kv("general.name", STR, "passerelle tiny reranker (random weights)"),
        kv("general.alignment", U32, ALIGN),
        kv("bert.context_length", U32, CTX),
        kv("bert.embedding_length", U32, HIDDEN),
        kv("bert.feed_forward_length", U32, FF),
        kv("bert.block_count", U32, LAYERS),
        kv("bert.attention.head_count", U32, HEADS),
        kv("bert.attention.layer_norm_epsilon", F32V, 1e-12),
        kv("bert.attention.causal", BOOL, False),
        kv("bert.pooling_type", U32, _POOLING_RANK),
        kv("bert.classifier.output_labels", ARR, (STR, ["LABEL_0"])),
        kv("tokenizer.ggml.model", STR, "bert"),
        kv("tokenizer.ggml.pre", STR, "default"),
        kv("tokenizer.ggml.tokens", ARR, (STR, tokens)),
        kv("tokenizer.ggml.token_type", ARR, (I32, types)),
        kv("tokenizer.ggml.token_type_count", U32, 2),
        kv("tokenizer.ggml.padding_token_id", U32, 0),
        kv("tokenizer.ggml.unknown_token_id", U32, 100),
        kv("tokenizer.ggml.cls_token_id", U32, 101),
        kv("tokenizer.ggml.bos_token_id", U32, 101),
        kv("tokenizer.ggml.seperator_token_id", U32, 102),
        kv("tokenizer.ggml.mask_token_id", U32, 103),
        kv("tokenizer.ggml.add_bos_token", BOOL, True),
        kv("tokenizer.ggml.add_eos_token", BOOL, False),
    ]
    tensors = [Tensor(name, dims, F32, f32(values)) for name, dims, values in _tensors(len(tokens), seed)]
    return write_gguf(path, meta, tensors)


def ensure_tiny_reranker() -> Path:
    """The cached tiny reranker, written on first use."""
    path = cache_dir() / "models" / MODEL_NAME
    return path if path.is_file() else write_tiny_reranker(path)
