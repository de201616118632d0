"""Write a small random-weight Llama as a GGUF that ``llama-server`` loads and serves: a second
chat model, genuinely different from the embedded Gemma (another architecture, vocabulary, size
and served name), for the tests and benchmarks that need two models on one box.

No small second chat GGUF is published on the package registries, so it is made here, with the
standard library alone (``runtimes/gguf_file``), deterministic (seed 0), once, cached under
``~/.cache/passerelle/models/``. Shape: 20 layers, hidden 512, 8 heads, feed-forward 1,536, F16
weights: 137 MB. Loaded by llama-server with ``-np 2 -c 4096`` it holds about 0.30 GiB measured
(the weights, a 160 MB KV cache, buffers) where Gemma 3 270M holds 0.35, and the file-size estimate
says 0.40 where Gemma's says 0.53: two models of different sizes, as on a real box, each fitting a
0.55 GiB budget alone and not beside the other. Writing it takes about a second.

The tokenizer is SentencePiece-style (``tokenizer.ggml.model = "llama"``): the 256 byte tokens
(any text tokenizes), every printable ASCII character alone and as a word start (``▁c``), and
``<s>``/``</s>``. The output rows of the byte tokens and of ``</s>`` are zero, so generation writes
readable ASCII noise rather than broken UTF-8, and runs to ``max_tokens`` (always pass one: it does
not stop by itself). No chat template is written: llama-server applies ChatML.

Example::

    path = ensure_tiny_llama()   # ~/.cache/passerelle/models/passerelle-tiny-llama-v1.gguf
    # llama-server -m PATH --alias tiny-llama -np 2 -c 4096  ->  POST /v1/chat/completions
"""

from __future__ import annotations

import random
from pathlib import Path

from passerelle.paths import cache_dir
from passerelle.runtimes.gguf_file import (
    ARR,
    BOOL,
    F16,
    F32,
    F32V,
    I32,
    STR,
    U32,
    Tensor,
    f32,
    kv,
    random_f16,
    write_gguf,
)

VERSION = 1  # bump when what is written changes: the cached file's name carries it
MODEL_NAME = f"passerelle-tiny-llama-v{VERSION}.gguf"
MODEL_ID = "tiny-llama"

HIDDEN, LAYERS, HEADS, KV_HEADS, FF, CTX = 512, 20, 8, 8, 1536, 8192
OUTPUT_GAIN = 4.0  # output_norm's weight: sharper logits, so the zeroed byte rows are not sampled

# llama.cpp's token types
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types): ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``<0x00>``…``<0xFF>`` 3–258,
    then ``▁`` and each printable ASCII character as a word start and alone."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256
    words = ["\u2581"] + ["\u2581" + chr(c) for c in range(33, 127)] + [chr(c) for c in range(33, 127)]
    tokens += words
    types += [_NORMAL] * len(words)
    # SentencePiece merges the pair whose result scores highest: word starts before lone characters
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))]
    return tokens, scores, types


def write_tiny_llama(path: Path, *, seed: int = 0) -> Path:
    """Write the GGUF to ``path`` (replaced atomically); returns ``path``."""
    tokens, scores, types = vocabulary()
    n_vocab, h, kv_dim = len(tokens), HIDDEN, HIDDEN // HEADS * KV_HEADS
    rng = random.Random(seed)
    meta = [
        kv("general.architecture", STR, "llama"),
        kv("general.name", STR, "passerelle tiny llama (random weights)"),
        kv("general.file_type", U32, 1),  # mostly F16
        kv("llama.context_length", U32, CTX),
        kv("llama.embedding_length", U32, h),
        kv("llama.block_count", U32, LAYERS),
        kv("llama.feed_forward_length", U32, FF),
        kv("llama.attention.head_count", U32, HEADS),
        kv("llama.attention.head_count_kv", U32, KV_HEADS),
        kv("llama.attention.layer_norm_rms_epsilon", F32V, 1e-5),
        kv("llama.rope.dimension_count", U32, h // HEADS),
        kv("llama.rope.freq_base", F32V, 10000.0),
        kv("llama.vocab_size", U32, n_vocab),
        kv("tokenizer.ggml.model", STR, "llama"),
        kv("tokenizer.ggml.pre", STR, "default"),
        kv("tokenizer.ggml.tokens", ARR, (STR, tokens)),
        kv("tokenizer.ggml.scores", ARR, (F32V, scores)),
        kv("tokenizer.ggml.token_type", ARR, (I32, types)),
        kv("tokenizer.ggml.unknown_token_id", U32, 0),
        kv("tokenizer.ggml.bos_token_id", U32, 1),
        kv("tokenizer.ggml.eos_token_id", U32, 2),
        kv("tokenizer.ggml.add_bos_token", BOOL, True),
        kv("tokenizer.ggml.add_eos_token", BOOL, False),
    ]

    def matrix(name: str, cols: int, rows: int) -> Tensor:
        return Tensor(name, (cols, rows), F16, random_f16(rng, cols * rows))

    def ones(name: str, value: float = 1.0) -> Tensor:
        return Tensor(name, (h,), F32, f32([value] * h))

    # the output head: random rows for the words; zero for <unk>, <s>, </s> and the bytes, whose
    # logits then sit far below the words' (OUTPUT_GAIN): never sampled in practice
    output = bytes(2 * h * 259) + random_f16(rng, h * (n_vocab - 259))
    tensors = [matrix("token_embd.weight", h, n_vocab), ones("output_norm.weight", OUTPUT_GAIN),
               Tensor("output.weight", (h, n_vocab), F16, output)]
    for i in range(LAYERS):
        b = f"blk.{i}."
        tensors += [ones(b + "attn_norm.weight"),
                    matrix(b + "attn_q.weight", h, h), matrix(b + "attn_k.weight", h, kv_dim),
                    matrix(b + "attn_v.weight", h, kv_dim), matrix(b + "attn_output.weight", h, h),
                    ones(b + "ffn_norm.weight"),
                    matrix(b + "ffn_gate.weight", h, FF), matrix(b + "ffn_up.weight", h, FF),
                    matrix(b + "ffn_down.weight", FF, h)]
    return write_gguf(path, meta, tensors)


def ensure_tiny_llama() -> Path:
    """The cached tiny Llama, written on first use (several processes may race: each writes its
    own staged file and renames it over the same name, so a reader never sees half a file)."""
    path = cache_dir() / "models" / MODEL_NAME
    return path if path.is_file() else write_tiny_llama(path)
