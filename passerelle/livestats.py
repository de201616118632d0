"""The last minutes of requests, summarised for people: what ``GET /admin/stats`` and ``/ui`` show.

Prometheus keeps history and estimates quantiles from histogram buckets; this keeps the raw
figures of recent requests in memory, so the dashboard shows exact p50 / p95 without any
Prometheus. The gateway calls :meth:`LiveStats.observe` once per finished request, which only
appends to a deque (old entries fall off the left end); all sorting happens in
:meth:`LiveStats.snapshot`, when someone looks.

Latencies (TTFT, inter-token gaps, queue wait) count completed requests only (cause ``ok``), as
the Prometheus histograms do; counts and causes count every request.

Example::

    live = LiveStats(window_s=300)
    gateway.listeners.append(live.observe)
    live.snapshot(backends=router.backends, waiting={"standard": 2})["classes"]["standard"]["ttft_ms"]
    # {"p50": 182.4, "p95": 640.0}
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from passerelle.backends import Backend
from passerelle.errors import Cause
from passerelle.metrics import Metrics
from passerelle.request import RequestRecord

DEFAULT_CLASSES = ("interactive", "standard", "batch")
MAX_ENTRIES = 200_000  # a hard bound on memory whatever the request rate
MAX_GAPS = 50_000  # inter-token gaps sorted per percentile; beyond this, an even subsample
RATE_WINDOW_S = 60.0  # tokens/s and requests/s: over the last minute
SERIES_POINTS = 30  # the charts' resolution: the window cut into this many buckets
RECENT_ERRORS = 20


@dataclass(slots=True)
class _Entry:
    t: float  # the clock when the request ended
    priority: str
    model: str
    backend: str
    tenant: str
    cause: str
    status: int
    ttft: float | None  # seconds; completed requests only
    gaps: list[float]  # the record's own list, not a copy
    tokens: int  # output tokens
    gen: float  # seconds from the first to the last content chunk: tokens are spread over them
    queue_wait: float
    error: str


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0–100) of already sorted values, linearly interpolated
    between closest ranks (numpy's default); None for no values."""
    n = len(sorted_values)
    if n == 0:
        return None
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _ms_summary(values: Iterable[float]) -> dict[str, float | None]:
    xs = sorted(values)
    return {"p50": _ms(percentile(xs, 50)), "p95": _ms(percentile(xs, 95)), "count": len(xs)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


def _gaps(entries: Sequence[_Entry]) -> list[float]:
    """All inter-token gaps of ``entries``, evenly subsampled to at most MAX_GAPS."""
    total = sum(len(e.gaps) for e in entries)
    step = max(1, math.ceil(total / MAX_GAPS))
    out: list[float] = []
    for e in entries:
        out.extend(e.gaps[::step] if step > 1 else e.gaps)
    return out


def _tokens_between(e: _Entry, a: float, b: float) -> float:
    """The share of ``e``'s tokens generated in [a, b), assuming an even pace (so that a long
    request does not show as a burst when it ends)."""
    if e.gen <= 0:
        return e.tokens if a <= e.t < b else 0.0
    overlap = min(e.t, b) - max(e.t - e.gen, a)
    return e.tokens * overlap / e.gen if overlap > 0 else 0.0


def waiting_from_gauge(metrics: Metrics) -> dict[str, int]:
    """Requests waiting in passerelle's queue by class, read from ``passerelle_requests_waiting``."""
    out: dict[str, int] = {}
    for family in metrics.waiting.collect():
        for sample in family.samples:
            cls = sample.labels.get("priority", "")
            out[cls] = out.get(cls, 0) + int(sample.value)
    return out


class LiveStats:
    """A rolling window of finished requests; see the module docstring."""

    def __init__(self, *, window_s: float = 300.0, classes: Sequence[str] = DEFAULT_CLASSES,
                 clock: Callable[[], float] = time.monotonic, max_entries: int = MAX_ENTRIES) -> None:
        self.window_s = float(window_s)
        self.classes = list(classes)
        self.clock = clock
        self.started = clock()
        self._entries: deque[_Entry] = deque(maxlen=max_entries)

    def observe(self, rec: RequestRecord) -> None:
        """Add one finished request (a ``Gateway.listeners`` callable): O(1)."""
        now = self.clock()
        ok = rec.cause is Cause.OK
        cause = rec.cause.value if rec.cause is not None else "upstream_error"
        gen = rec.t_last - rec.t_first if rec.t_first and rec.t_last > rec.t_first else 0.0
        self._entries.append(_Entry(now, rec.priority, rec.model, rec.backend, rec.tenant, cause, rec.status,
                                    rec.ttft if ok else None, rec.gaps if ok else [], rec.output_tokens, gen,
                                    rec.queue_wait, rec.error))
        self._prune(now)

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        entries = self._entries
        while entries and entries[0].t < horizon:
            entries.popleft()

    # -- the snapshot ----------------------------------------------------------------------
    def snapshot(self, *, backends: Sequence[Backend] = (), waiting: Mapping[str, int] | None = None
                 ) -> dict[str, Any]:
        """Everything the dashboard shows, as plain JSON-ready data (times in ms, rates per s)."""
        now = self.clock()
        self._prune(now)
        entries = list(self._entries)
        waiting = dict(waiting or {})
        for cls in [*{e.priority for e in entries}, *waiting]:
            if cls not in self.classes:
                self.classes.append(cls)
        age = max(now - self.started, 1e-9)
        rate_span = min(RATE_WINDOW_S, self.window_s, age)
        recent = [e for e in entries if e.t >= now - rate_span]
        by_class = {cls: [e for e in entries if e.priority == cls] for cls in self.classes}
        recent_by_class = {cls: [e for e in recent if e.priority == cls] for cls in self.classes}
        causes: dict[str, int] = {}
        for e in entries:
            causes[e.cause] = causes.get(e.cause, 0) + 1
        return {
            "ts": time.time(),
            "window_s": self.window_s,
            "rate_window_s": round(rate_span, 3),
            "uptime_s": round(age, 1),
            "totals": self._summary(entries, recent, now, rate_span, sum(waiting.values())),
            "classes": {cls: self._summary(by_class[cls], recent_by_class[cls], now, rate_span, waiting.get(cls, 0))
                        for cls in self.classes},
            "causes": dict(sorted(causes.items(), key=lambda kv: (kv[0] != Cause.OK.value, -kv[1]))),
            "recent_errors": [{"ago_s": round(now - e.t, 1), "cause": e.cause, "status": e.status,
                               "model": e.model, "backend": e.backend, "priority": e.priority,
                               "tenant": e.tenant, "error": e.error}
                              for e in reversed(entries) if e.cause != Cause.OK.value][:RECENT_ERRORS],
            "running": sum(b.in_flight for b in backends),
            "backends": [self._backend(b) for b in backends],
            "series": self._series(entries, now),
        }

    @staticmethod
    def _summary(entries: Sequence[_Entry], recent: Sequence[_Entry], now: float, rate_span: float,
                 waiting: int) -> dict[str, Any]:
        ok = [e for e in entries if e.cause == Cause.OK.value]
        return {
            "requests": len(entries),
            "ok": len(ok),
            "errors": len(entries) - len(ok),
            "waiting": waiting,
            "ttft_ms": _ms_summary(e.ttft for e in ok if e.ttft is not None),
            "itl_ms": _ms_summary(_gaps(ok)),
            "queue_wait_ms": _ms_summary(e.queue_wait for e in ok),
            "tokens_per_s": round(sum(_tokens_between(e, now - rate_span, math.inf) for e in recent) / rate_span, 2),
            "requests_per_s": round(len(recent) / rate_span, 3),
        }

    @staticmethod
    def _backend(b: Backend) -> dict[str, Any]:
        s = b.stats
        return {
            "name": b.name, "kind": b.kind, "url": b.url, "models": list(b.models),
            "up": s.up, "slots_busy": s.slots_busy, "slots_total": s.slots_total,
            "kv_cache_usage_ratio": s.kv_cache_usage_ratio, "queue_depth": s.queue_depth,
            "in_flight": b.in_flight, "capacity": b.capacity,
            "checked_ago_s": round(time.time() - s.scraped_at, 1) if s.scraped_at else None,
            "error": s.error,
        }

    def _series(self, entries: Sequence[_Entry], now: float) -> dict[str, Any]:
        """Per class, per bucket of ``window_s / SERIES_POINTS`` seconds (buckets aligned to the
        clock, so a point keeps its value between two snapshots): TTFT p50 / p95 of the requests
        that ended in the bucket, and tokens/s (each request's tokens spread evenly from its
        first to its last token)."""
        step = self.window_s / SERIES_POINTS
        last = math.floor(now / step)
        first = last - SERIES_POINTS + 1
        buckets: dict[str, list[list[_Entry]]] = {cls: [[] for _ in range(SERIES_POINTS)] for cls in self.classes}
        tokens: dict[str, list[float]] = {cls: [0.0] * SERIES_POINTS for cls in self.classes}
        for e in entries:
            i = math.floor(e.t / step) - first
            if 0 <= i < SERIES_POINTS:
                buckets[e.priority][i].append(e)
            for k in range(max(math.floor((e.t - e.gen) / step), first), min(math.floor(e.t / step), last) + 1):
                tokens[e.priority][k - first] += _tokens_between(e, k * step, (k + 1) * step)
        # the current bucket is still filling: its rate is over the part that has elapsed
        spans = [step] * (SERIES_POINTS - 1) + [max(now - last * step, 1.0)]
        # each point stands at its bucket's end; the current bucket's end is "now"
        ends_ago = [max(0.0, round(now - (first + i + 1) * step, 1)) for i in range(SERIES_POINTS)]
        out: dict[str, Any] = {"step_s": step, "t_ago_s": ends_ago, "classes": {}}
        # buckets that ended before passerelle started have no value (not zero)
        before_start = [(first + i + 1) * step <= self.started for i in range(SERIES_POINTS)]
        for cls, rows in buckets.items():
            p50, p95, tps, n = [], [], [], []
            for span, row, empty, generated in zip(spans, rows, before_start, tokens[cls], strict=True):
                ttfts = sorted(e.ttft for e in row if e.ttft is not None)
                p50.append(_ms(percentile(ttfts, 50)))
                p95.append(_ms(percentile(ttfts, 95)))
                tps.append(None if empty else round(generated / span, 2))
                n.append(len(row))
            out["classes"][cls] = {"ttft_p50_ms": p50, "ttft_p95_ms": p95, "tokens_per_s": tps, "requests": n}
        return out
