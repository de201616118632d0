"""Write GGUF v3 files with the standard library: the tiny random-weight models passerelle makes
locally (nothing is downloaded), for llama.cpp's ``llama-server`` to load.

A file is its metadata (typed key/value pairs, built with :func:`kv`) and its tensors
(name, dimensions innermost first, ggml type, raw little-endian data), each aligned to 32 bytes.
:func:`random_f16` makes deterministic random F16 weights fast: random bytes with the top exponent
bits masked off, so that every value is finite and small.

Example::

    meta = [kv("general.architecture", STR, "llama"), kv("llama.block_count", U32, 2)]
    tensors = [Tensor("output_norm.weight", (64,), F32, f32([1.0] * 64))]
    write_gguf(Path("model.gguf"), meta, tensors)      # replaced atomically
"""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path
from typing import Any, NamedTuple, cast

# GGUF metadata value types (gguf.h)
U32, I32, F32V, BOOL, STR, ARR = 4, 5, 6, 7, 8, 9
# ggml tensor types
F32, F16 = 0, 1
ALIGN = 32

_SCALAR = {U32: "I", I32: "i", F32V: "f", BOOL: "?"}


class Tensor(NamedTuple):
    name: str
    dims: tuple[int, ...]  # innermost first: a (rows=out, cols=in) matrix is (in, out)
    ggml_type: int
    data: bytes


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, value: object) -> bytes:
    """One metadata pair; an array's value is ``(element type, items)``."""
    out = _s(key) + struct.pack("<I", vtype)
    if vtype == STR:
        return out + _s(cast(str, value))
    if vtype == ARR:
        etype, items = cast(tuple[int, list[Any]], value)
        out += struct.pack("<IQ", etype, len(items))
        if etype == STR:
            return out + b"".join(_s(i) for i in items)
        return out + struct.pack(f"<{len(items)}{_SCALAR[etype]}", *items)
    return out + struct.pack("<" + _SCALAR[vtype], value)


def f32(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def random_f16(rng: random.Random, n: int) -> bytes:
    """``n`` random F16 values, deterministic for a seeded ``rng``: random bits with exponent bits
    14 and 12 cleared (mask 0xAFFF), so each value is ±[0.008, 0.125) or below 0.0005, about half
    each (an RMS near 0.04), never infinite or NaN. About 200 MB/s: the masking is one big-integer
    AND, not a Python loop."""
    raw = rng.randbytes(2 * n)
    mask = int.from_bytes(b"\xff\xaf" * n, "little")
    return (int.from_bytes(raw, "little") & mask).to_bytes(2 * n, "little")


def write_gguf(path: Path, meta: list[bytes], tensors: list[Tensor]) -> Path:
    """Write the file to ``path`` (staged next to it under a name of this process's own, then
    renamed: two processes writing the same model never mix their bytes); returns ``path``."""
    infos, offset = [], 0
    for t in tensors:
        infos.append(_s(t.name) + struct.pack("<I", len(t.dims)) + struct.pack(f"<{len(t.dims)}Q", *t.dims)
                     + struct.pack("<IQ", t.ggml_type, offset))
        offset += len(t.data) + (-len(t.data) % ALIGN)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta)) + b"".join(meta) + b"".join(infos)
    head += b"\0" * (-len(head) % ALIGN)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f"{path.name}.{os.getpid()}.partial")
    with open(staged, "wb") as f:
        f.write(head)
        for t in tensors:
            f.write(t.data)
            f.write(b"\0" * (-len(t.data) % ALIGN))
    staged.replace(path)
    return path
