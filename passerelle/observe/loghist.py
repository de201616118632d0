"""Log-scale histograms of durations, for the dashboard's window (``livestats.py``).

A value of ``v`` seconds falls in bucket ``int(log(v) / log(GROWTH) + shift)``; a percentile is
read as its bucket's geometric middle, within ``REL_ERROR`` (0.2 %) of the exact figure. Buckets
are fine enough that the dashboard's medians agree with the access log's to a tenth of a
millisecond. Three histograms (TTFT, queue wait, inter-token gaps) share one key space.

Example::

    counts = array("I", [0]) * BUCKETS
    counts[bucket(0.0123)] += 1
    quantiles(counts)   # {"p50": 12.3, "p95": 12.3, "count": 1}
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from itertools import accumulate
from typing import Any

# Histogram buckets: 0 holds values under SMALLEST (read as 0); bucket i ≥ 1 holds
# [SMALLEST·GROWTH^(i-1), SMALLEST·GROWTH^i), the last one everything above.
GROWTH = 1.004
SMALLEST = 1e-6  # seconds
LARGEST = 1e5
REL_ERROR = math.sqrt(GROWTH) - 1  # a bucket's geometric middle against any value in it: ≈ 0.2 %
BUCKETS = int(math.log(LARGEST / SMALLEST) / math.log(GROWTH)) + 2
INV_LN = 1.0 / math.log(GROWTH)
SHIFT = 1.0 - math.log(SMALLEST) * INV_LN
# The three histograms share one key space (and one dict per slot): key = offset + bucket.
TTFT, QWAIT, GAP = 0, BUCKETS, 2 * BUCKETS
assert 3 * BUCKETS <= 1 << 16  # a closed slot's keys are C unsigned shorts


def bucket(v: float) -> int:
    """The histogram bucket of ``v`` seconds: ``bucket(0.0123)`` is 2360, read back as 12.32 ms."""
    if not v >= SMALLEST:  # (NaN included)
        return 0
    if v >= LARGEST:
        return BUCKETS - 1
    return int(math.log(v) * INV_LN + SHIFT)


def middle(bucket: int) -> float:
    """A bucket's value: its geometric middle (0 for the bucket of values under SMALLEST)."""
    return SMALLEST * GROWTH ** (bucket - 0.5) if bucket > 0 else 0.0


def occupied(counts: array[int], lo: int, hi: int) -> tuple[int, int]:
    """The narrowest [a, b) within [lo, hi) that holds every nonzero count, found on the raw bytes
    at C speed (a snapshot does not walk thousands of empty buckets in Python)."""
    raw = counts[lo:hi].tobytes()
    head = len(raw) - len(raw.lstrip(b"\0"))
    if head == len(raw):
        return lo, lo
    size = counts.itemsize
    return lo + head // size, lo + -(-len(raw.rstrip(b"\0")) // size)


def quantiles(hist: array[int], offset: int = 0) -> dict[str, Any]:
    """p50 / p95 in ms and the count of the histogram ``hist[offset:offset + BUCKETS]``."""
    lo, hi = occupied(hist, offset, offset + BUCKETS)
    first = lo - offset
    cum = list(accumulate(hist[lo:hi]))
    n = cum[-1] if cum else 0
    out: dict[str, Any] = {"p50": None, "p95": None, "count": n}
    for q in (50, 95) if n else ():
        pos = (n - 1) * q / 100.0
        lo = math.floor(pos)
        a, b = (middle(first + bisect_right(cum, rank)) for rank in (lo, min(lo + 1, n - 1)))
        out[f"p{q}"] = ms(a + (b - a) * (pos - lo))
    return out


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)
