"""The last minutes of requests, summarised for people: what ``GET /admin/stats`` and ``/ui`` show.

Prometheus keeps history; this keeps the last ``window_s`` seconds in memory so that the dashboard
needs no Prometheus. Finished requests are not kept one by one: each adds to the *slot* (a second;
less for windows under 30 s) it ended in, per priority class — requests, errors, causes, tokens, and
a sparse log-scale histogram of TTFT, queue wait and inter-token gaps — and a slot leaves the window
as a whole (a request counts for ``window_s`` to ``window_s`` + a slot after it ended). So the
window's memory is bounded by slots × classes × occupied buckets (about a MB for three busy
classes), whatever the request rate, and so is the cost of :meth:`LiveStats.snapshot` (a few
milliseconds; one that took T seconds is reused for 10·T, at most a second).
:meth:`LiveStats.observe` is O(1) but for bucketing the request's inter-token gaps.

Percentiles are read from the histograms: each rank's value is the geometric middle of its bucket
(interpolated between closest ranks, as numpy does), within ``REL_ERROR`` (0.2 %) of the exact
figure. The buckets are finer than a dashboard needs so that its medians agree with the access
log's to a tenth of a millisecond; a closed slot keeps 3 bytes per occupied bucket.

Latencies (TTFT, inter-token gaps, queue wait) count completed requests only (cause ``ok``), as
the Prometheus histograms do; counts and causes count every request. A slot's tokens are those
generated during it: each request's tokens are spread evenly from its first to its last token.

Example::

    live = LiveStats(window_s=300)
    gateway.listeners.append(live.observe)
    snap = live.snapshot(backends=[b.describe() for b in registry.backends], waiting={"standard": 2})
    snap["classes"]["standard"]["ttft_ms"]
    # {"p50": 182.4, "p95": 640.0, "count": 1204}
"""

from __future__ import annotations

import math
import operator
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from passerelle import config
from passerelle.errors import Cause
from passerelle.observe.loghist import (
    BUCKETS,
    GAP,
    INV_LN,
    LARGEST,
    QWAIT,
    SHIFT,
    SMALLEST,
    TTFT,
    bucket,
    occupied,
    quantiles,
)
from passerelle.observe.record import RequestRecord, clip

DEFAULT_CLASSES = tuple(c.name for c in config.DEFAULT_CLASSES)
RATE_WINDOW_S = 60.0  # tokens/s and requests/s: over the last minute
SERIES_POINTS = 30  # the charts' resolution: the window cut into this many buckets
RECENT_ERRORS = 20
SLOT_S = 1.0  # the longest slot; a chart bucket is a whole number of slots
_OK = Cause.OK.value
_CAUSES = list(Cause)
_CAUSE_INDEX = {cause: i for i, cause in enumerate(_CAUSES)}

class _Ring:
    """One class's slots: slot k at position k % size. The open (current) slot's histogram is a
    Counter; a closed slot's is packed into bytes (3 per occupied bucket) and added to ``totals``,
    from which it is taken away again when the slot leaves the window."""

    __slots__ = ("base", "chart", "charted", "errors", "hist", "live", "n", "ramp", "tokens", "totals")

    def __init__(self, size: int) -> None:
        self.n = array("I", [0]) * size
        self.errors = array("I", [0]) * size
        self.tokens = array("d", [0.0]) * size  # generated in the slot, but for the whole-slot shares:
        self.ramp = array("d", [0.0]) * size  # those as a difference array (+ where they start, − after)
        self.base = 0.0  # the sum of ``ramp`` over the slots already gone (shares still running)
        self.hist: list[bytes | None] = [None] * size
        self.live: Counter[int] = Counter()
        # Dense, allocated once (77 KB): a dict of the window's buckets would grow with the traffic.
        self.totals = array("I", [0]) * (3 * BUCKETS)  # the closed slots' histograms in the window
        self.chart = array("I", [0]) * BUCKETS  # the TTFTs of the current chart bucket...
        self.charted: dict[int, tuple[float | None, float | None]] = {}  # ...and p50/p95 of the past ones

    def close(self, pos: int) -> None:
        live = self.live
        if not live:
            return
        totals = self.totals
        for key, count in live.items():
            totals[key] += count
        # a count in one byte: a larger one is written as several of the same bucket
        split = [(key, min(count - done, 255)) for key, count in live.items() for done in range(0, count, 255)]
        self.hist[pos] = array("H", [key for key, _ in split]).tobytes() + bytes(count for _, count in split)
        live.clear()

    def expire(self, pos: int) -> None:
        packed = self.hist[pos]
        if packed is not None:
            n = len(packed) // 3
            keys = array("H")
            keys.frombytes(packed[:2 * n])
            totals = self.totals
            for key, count in zip(keys, packed[2 * n:], strict=True):
                totals[key] -= count
            self.hist[pos] = None
        self.base += self.ramp[pos]
        self.n[pos] = self.errors[pos] = 0
        self.tokens[pos] = self.ramp[pos] = 0.0

    def freeze_chart(self, bucket: int) -> None:
        """The chart's bucket is over: keep its TTFT p50 / p95 (they will not change), start anew."""
        summary = quantiles(self.chart)
        if summary["count"]:
            self.charted[bucket] = (summary["p50"], summary["p95"])
            self.chart = array("I", [0]) * BUCKETS


class _Figures:
    """Counts and histogram (dense, as ``_Ring.totals``) of one class or all over the window."""

    __slots__ = ("errors", "hist", "n", "recent", "recent_tokens")

    def __init__(self, hist: array[int] | None = None) -> None:
        self.n = self.errors = 0
        self.recent = self.recent_tokens = 0.0
        self.hist = hist if hist is not None else array("I", [0]) * (3 * BUCKETS)

    def add(self, other: _Figures) -> None:
        self.n += other.n
        self.errors += other.errors
        self.recent += other.recent
        self.recent_tokens += other.recent_tokens
        for offset in TTFT, QWAIT, GAP:
            lo, hi = occupied(other.hist, offset, offset + BUCKETS)
            self.hist[lo:hi] = array("I", map(operator.add, self.hist[lo:hi], other.hist[lo:hi]))


class LiveStats:
    """A rolling window of finished requests; see the module docstring."""

    def __init__(self, *, window_s: float = 300.0, classes: Sequence[str] = DEFAULT_CLASSES,
                 clock: Callable[[], float] = time.monotonic, timer: Callable[[], float] | None = None) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, not {window_s}")
        self.window_s = float(window_s)
        self.classes = list(classes)
        self.clock = clock
        # What a snapshot's cost is measured with (a costly one is reused for a while): real time,
        # unless the window runs on an injected clock, whose time then stands still while it works.
        self.timer = timer or (time.perf_counter if clock is time.monotonic else clock)
        self.started = clock()
        self._step = self.window_s / SERIES_POINTS  # a chart bucket
        self._per_step = max(1, math.ceil(self._step / SLOT_S - 1e-9))
        self._slot_s = self._step / self._per_step
        # slots kept: the window's, and the one it began in (so that a rate over the whole window
        # has all of it); a request stays window_s to window_s + one slot after it ended
        self._size = SERIES_POINTS * self._per_step + 1
        self._k = math.floor(self.started / self._slot_s)  # the open slot
        self._rings = {cls: _Ring(self._size) for cls in self.classes}
        self._causes = array("I", [0]) * (self._size * len(_CAUSES))  # slot k's at (k % size)·len(Cause)
        self._errors: deque[tuple[float, dict[str, Any]]] = deque(maxlen=RECENT_ERRORS)  # (clock, record)
        self._cached: tuple[float, float, dict[str, Any]] | None = None  # (timer, reuse for s, part)

    def configure(self, classes: Sequence[str]) -> None:
        """``[[classes]]`` (a reload's too): the classes shown, in this order; a new one starts
        empty, a removed one leaves the dashboard (a request still finishing in it brings it back)."""
        self.classes = list(classes)
        for cls in self.classes:
            self._ring(cls)
        self._cached = None

    def observe(self, rec: RequestRecord) -> None:
        """Add one finished request (a ``Gateway.listeners`` callable): O(1) but for its gaps."""
        now = self.clock()
        k = self._advance(now)
        pos = k % self._size
        ring = self._ring(rec.priority)
        ring.n[pos] += 1
        cause = rec.cause if rec.cause is not None else Cause.UPSTREAM_ERROR
        self._causes[pos * len(_CAUSES) + _CAUSE_INDEX[cause]] += 1
        if rec.cause is Cause.OK:
            live = ring.live
            ttft = rec.ttft
            if ttft is not None:
                key = bucket(ttft)
                live[TTFT + key] += 1
                ring.chart[key] += 1
            live[QWAIT + bucket(rec.queue_wait)] += 1
            if rec.gaps:  # inline _bucket: this runs for every token streamed
                log, inv, shift, top = math.log, INV_LN, SHIFT + GAP, GAP + BUCKETS - 1
                live.update([int(log(g) * inv + shift) if SMALLEST <= g < LARGEST
                             else (top if g >= LARGEST else GAP) for g in rec.gaps])
        else:
            ring.errors[pos] += 1
            self._errors.append((now, {"cause": cause.value, "status": rec.status, "model": clip(rec.model),
                                       "backend": rec.backend, "priority": rec.priority, "tenant": rec.tenant,
                                       "error": clip(rec.error, 512)}))
        tokens = rec.output_tokens
        if tokens:
            gen = rec.t_last - rec.t_first if rec.t_first and rec.t_last > rec.t_first else 0.0
            self._spread(ring, tokens, now - gen, now, k)

    def _ring(self, cls: str) -> _Ring:
        ring = self._rings.get(cls)
        if ring is None:  # a class not in the configuration (classes are the configured ones in the app)
            ring = self._rings[cls] = _Ring(self._size)
            if cls not in self.classes:
                self.classes.append(cls)
        return ring

    def _spread(self, ring: _Ring, tokens: int, start: float, end: float, k: int) -> None:
        """Spread ``tokens`` evenly over [start, end] (end in slot k), in O(1): the slots partly
        covered at either end get their share directly, the whole slots between get theirs
        through ``ramp``, summed up in the snapshot."""
        size, slot = self._size, self._slot_s
        pos = k % size
        ks = math.floor(start / slot)
        if ks >= k:
            ring.tokens[pos] += tokens
            return
        rate = tokens / (end - start)
        oldest = k - size + 1
        ring.tokens[pos] += rate * max(end - k * slot, 0.0)
        if ks >= oldest:
            ring.tokens[ks % size] += rate * ((ks + 1) * slot - start)
        if ks + 1 < k:
            whole = rate * slot
            if ks + 1 >= oldest:
                ring.ramp[(ks + 1) % size] += whole
            else:  # began before the window: running through its oldest slot
                ring.base += whole
            ring.ramp[pos] -= whole

    def _advance(self, now: float) -> int:
        """Open the slot of ``now`` (closing the open one, dropping those that leave the window)
        and return its index; a clock that went back keeps the open slot."""
        k = math.floor(now / self._slot_s)
        last = self._k
        if k <= last:
            return last
        size, rings = self._size, self._rings.values()
        for ring in rings:
            ring.close(last % size)
        bucket, new_bucket = last // self._per_step, k // self._per_step
        if new_bucket != bucket:
            for ring in rings:
                ring.freeze_chart(bucket)
                for old in [b for b in ring.charted if b <= new_bucket - SERIES_POINTS]:
                    del ring.charted[old]
        for kk in range(max(last + 1, k - size + 1), k + 1):  # the slots whose positions these take
            pos = kk % size
            for ring in rings:
                ring.expire(pos)
            self._causes[pos * len(_CAUSES):(pos + 1) * len(_CAUSES)] = array("I", [0]) * len(_CAUSES)
        self._k = k
        return k

    # -- the snapshot ----------------------------------------------------------------------
    def snapshot(self, *, backends: Sequence[Mapping[str, Any]] = (), waiting: Mapping[str, int] | None = None
                 ) -> dict[str, Any]:
        """Everything the dashboard shows, as plain JSON-ready data (times in ms, rates per s)."""
        waiting = dict(waiting or {})
        t0 = self.timer()
        if self._cached is not None and t0 - self._cached[0] < self._cached[1]:
            part = self._cached[2]
        else:
            part = self._requests_part()
            cost = self.timer() - t0
            self._cached = (t0, min(1.0, 10 * cost) if cost > 0.005 else 0.0, part)
        classes = {cls: dict(v, waiting=waiting.get(cls, 0)) for cls, v in part["classes"].items()}
        for cls in waiting:
            if cls not in classes:  # a class seen only in the queue so far
                classes[cls] = dict(_summary(_Figures(), part["rate_window_s"]), waiting=waiting[cls])
                self.classes.append(cls)
        return {
            "ts": time.time(),
            "window_s": self.window_s,
            "rate_window_s": part["rate_window_s"],
            "uptime_s": part["uptime_s"],
            "totals": dict(part["totals"], waiting=sum(waiting.values())),
            "classes": classes,
            "causes": part["causes"],
            "recent_errors": part["recent_errors"],
            "running": sum(b["in_flight"] for b in backends),
            "backends": list(backends),
            "series": part["series"],
        }

    def _requests_part(self) -> dict[str, Any]:
        """The snapshot's figures derived from the window's slots."""
        now = self.clock()
        k = self._advance(now)
        size, slot = self._size, self._slot_s
        oldest = k - size + 1
        age = max(now - self.started, 1e-9)
        rate_span = min(RATE_WINDOW_S, self.window_s, age)
        since = now - rate_span
        # the rates take the part of since's slot after since (all of it at first: nothing came before)
        ks = math.floor(since / slot)
        if ks < oldest:
            ks, share = oldest, 1.0
        else:
            begin, end = max(ks * slot, self.started), (ks + 1) * slot
            share = min(1.0, max(0.0, (end - since) / (end - begin))) if end > begin else 1.0
        step = self._step
        last = k // self._per_step
        first = last - SERIES_POINTS + 1
        figures: dict[str, _Figures] = {}
        series: dict[str, Any] = {}
        for cls in list(self.classes):
            figures[cls], series[cls] = self._class_part(self._ring(cls), k, ks, share, first, now)
        total = _Figures()
        for f in figures.values():
            total.add(f)
        counts = ((cause.value, sum(self._causes[i::len(_CAUSES)])) for i, cause in enumerate(_CAUSES))
        causes = {cause: count for cause, count in counts if count}
        # each point stands at its bucket's end; the current bucket's end is "now"
        ends_ago = [max(0.0, round(now - (first + i + 1) * step, 1)) for i in range(SERIES_POINTS)]
        return {
            "rate_window_s": round(rate_span, 3),
            "uptime_s": round(age, 1),
            "totals": _summary(total, rate_span),
            "classes": {cls: _summary(f, rate_span) for cls, f in figures.items()},
            "causes": dict(sorted(causes.items(), key=lambda kv: (kv[0] != _OK, -kv[1]))),
            "recent_errors": [{"ago_s": round(now - t, 1), **error} for t, error in reversed(self._errors)
                              if math.floor(t / slot) >= oldest],
            "series": {"step_s": step, "t_ago_s": ends_ago, "classes": series},
        }

    def _class_part(self, ring: _Ring, k: int, ks: int, share: float, first: int, now: float
                    ) -> tuple[_Figures, dict[str, Any]]:
        """One class's window figures and chart series: per bucket of ``window_s / SERIES_POINTS``
        seconds (aligned to the clock, so a point keeps its value between two snapshots), TTFT
        p50 / p95 of the requests that ended in it, tokens/s generated in it, requests ended in it."""
        size, per_step = self._size, self._per_step
        f = _Figures(array("I", ring.totals))
        f.n, f.errors = sum(ring.n), sum(ring.errors)
        for key, count in ring.live.items():
            f.hist[key] += count
        oldest = k - size + 1
        n_per_bucket = [0] * SERIES_POINTS
        tokens_per_bucket = [0.0] * SERIES_POINTS
        running = ring.base
        for kk in range(oldest, k + 1):
            pos = kk % size
            running += ring.ramp[pos]
            tokens = max(ring.tokens[pos] + running, 0.0)  # (no -0.0 from rounding)
            n = ring.n[pos]
            if kk >= ks:
                weight = share if kk == ks else 1.0
                f.recent += n * weight
                f.recent_tokens += tokens * weight
            i = kk // per_step - first
            if i >= 0:
                n_per_bucket[i] += n
                tokens_per_bucket[i] += tokens
        step, last = self._step, first + SERIES_POINTS - 1
        # the current bucket is still filling: its rate is over the part that has elapsed
        spans = [step] * (SERIES_POINTS - 1) + [max(now - last * step, 1.0)]
        # buckets that ended before passerelle started have no value (not zero)
        tps = [None if (first + i + 1) * step <= self.started else round(tokens_per_bucket[i] / spans[i], 2)
               for i in range(SERIES_POINTS)]
        current = quantiles(ring.chart)
        ttft = [ring.charted.get(first + i, (None, None)) for i in range(SERIES_POINTS - 1)]
        ttft.append((current["p50"], current["p95"]))
        return f, {"ttft_p50_ms": [p50 for p50, _ in ttft], "ttft_p95_ms": [p95 for _, p95 in ttft],
                   "tokens_per_s": tps, "requests": n_per_bucket}



def _summary(f: _Figures, rate_span: float) -> dict[str, Any]:
    rate_span = max(rate_span, 1e-9)
    return {
        "requests": f.n,
        "ok": f.n - f.errors,
        "errors": f.errors,
        "waiting": 0,
        "ttft_ms": quantiles(f.hist, TTFT),
        "itl_ms": quantiles(f.hist, GAP),
        "queue_wait_ms": quantiles(f.hist, QWAIT),
        "tokens_per_s": round(f.recent_tokens / rate_span, 2),
        "requests_per_s": round(f.recent / rate_span, 3),
    }
