"""The last minutes of requests, summarised for people: what ``GET /admin/stats`` and ``/ui`` show.

Prometheus keeps history and estimates quantiles from histogram buckets; this keeps the raw
figures of recent requests in memory, so the dashboard shows exact p50 / p95 without any
Prometheus. The gateway calls :meth:`LiveStats.observe` once per finished request, which only
appends to a deque (old entries fall off the left end); all sorting happens in
:meth:`LiveStats.snapshot`, when someone looks. A snapshot costs about a microsecond per request
in the window; one that took T seconds is reused for 10·T (at most a second), so watching the
dashboard under heavy traffic takes at most about a tenth of the event loop.

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
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from passerelle.backends import Backend
from passerelle.errors import Cause
from passerelle.metrics import Metrics
from passerelle.request import RequestRecord

DEFAULT_CLASSES = ("interactive", "standard", "batch")
MAX_ENTRIES = 100_000  # a hard bound on memory and snapshot time whatever the request rate
MAX_GAPS = 50_000  # inter-token gaps sorted per percentile; beyond this, an even subsample
RATE_WINDOW_S = 60.0  # tokens/s and requests/s: over the last minute
SERIES_POINTS = 30  # the charts' resolution: the window cut into this many buckets
RECENT_ERRORS = 20
_OK = Cause.OK.value
_NO_GAPS: array[float] = array("f")
MAX_NAMES = 1_000  # distinct model and tenant names shared between entries


@dataclass(slots=True)
class _Entry:
    t: float  # the clock when the request ended
    priority: str
    model: str
    backend: str
    tenant: str
    cause: str
    ok: bool
    status: int
    ttft: float | None  # seconds; completed requests only
    gaps: array[float]  # C floats: 4 bytes a gap (a list held 32, most of a window's memory)
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


def _gaps(lists: Sequence[Sequence[float]], total: int) -> list[float]:
    """The gaps of ``lists`` (``total`` in all), evenly subsampled to at most MAX_GAPS."""
    step = max(1, math.ceil(total / MAX_GAPS))
    out: list[float] = []
    for gaps in lists:
        out.extend(gaps[::step] if step > 1 else gaps)
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


class _Class:
    """One class's figures gathered in the snapshot's single pass over the window."""

    __slots__ = ("errors", "gap_lists", "n", "ngaps", "qwait", "recent", "recent_tokens", "series_n",
                 "series_tokens", "series_ttft", "ttft")

    def __init__(self) -> None:
        self.n = self.errors = self.recent = self.ngaps = 0
        self.recent_tokens = 0.0
        self.ttft: list[float] = []
        self.qwait: list[float] = []
        self.gap_lists: list[Sequence[float]] = []
        self.series_n = [0] * SERIES_POINTS
        self.series_tokens = [0.0] * SERIES_POINTS
        self.series_ttft: list[list[float]] = [[] for _ in range(SERIES_POINTS)]


class LiveStats:
    """A rolling window of finished requests; see the module docstring."""

    def __init__(self, *, window_s: float = 300.0, classes: Sequence[str] = DEFAULT_CLASSES,
                 clock: Callable[[], float] = time.monotonic, max_entries: int = MAX_ENTRIES) -> None:
        self.window_s = float(window_s)
        self.classes = list(classes)
        self.clock = clock
        self.started = clock()
        self._entries: deque[_Entry] = deque(maxlen=max_entries)
        self._cached: tuple[float, float, dict[str, Any]] | None = None  # (perf_counter, reuse for s, part)
        # One string object per model or tenant name for the whole window: a record's come from
        # its request's JSON, a new object each time.
        self._names: dict[str, str] = {}

    def observe(self, rec: RequestRecord) -> None:
        """Add one finished request (a ``Gateway.listeners`` callable): O(1)."""
        now = self.clock()
        ok = rec.cause is Cause.OK
        cause = rec.cause.value if rec.cause is not None else "upstream_error"
        gen = rec.t_last - rec.t_first if rec.t_first and rec.t_last > rec.t_first else 0.0
        gaps = array("f", rec.gaps) if ok and rec.gaps else _NO_GAPS
        self._entries.append(_Entry(now, rec.priority, self._name(rec.model), rec.backend, self._name(rec.tenant),
                                    cause, ok, rec.status, rec.ttft if ok else None, gaps, rec.output_tokens, gen,
                                    rec.queue_wait, rec.error))
        self._prune(now)

    def _name(self, name: str) -> str:
        shared = self._names.get(name)
        if shared is not None:
            return shared
        if len(self._names) < MAX_NAMES:
            self._names[name] = name
        return name

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        entries = self._entries
        while entries and entries[0].t < horizon:
            entries.popleft()

    # -- the snapshot ----------------------------------------------------------------------
    def snapshot(self, *, backends: Sequence[Backend] = (), waiting: Mapping[str, int] | None = None
                 ) -> dict[str, Any]:
        """Everything the dashboard shows, as plain JSON-ready data (times in ms, rates per s)."""
        waiting = dict(waiting or {})
        t0 = time.perf_counter()
        if self._cached is not None and t0 - self._cached[0] < self._cached[1]:
            part = self._cached[2]
        else:
            part = self._requests_part()
            cost = time.perf_counter() - t0
            self._cached = (t0, min(1.0, 10 * cost) if cost > 0.005 else 0.0, part)
        classes = {cls: dict(v, waiting=waiting.get(cls, 0)) for cls, v in part["classes"].items()}
        for cls in waiting:
            if cls not in classes:  # a class seen only in the queue so far
                classes[cls] = dict(_summary(_Class(), part["rate_window_s"]), waiting=waiting[cls])
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
            "running": sum(b.in_flight for b in backends),
            "backends": [self._backend(b) for b in backends],
            "series": part["series"],
        }

    def _requests_part(self) -> dict[str, Any]:
        """The snapshot's figures derived from the requests in the window (one pass over them)."""
        now = self.clock()
        self._prune(now)
        entries = self._entries
        age = max(now - self.started, 1e-9)
        rate_span = min(RATE_WINDOW_S, self.window_s, age)
        since = now - rate_span
        step = self.window_s / SERIES_POINTS
        last = math.floor(now / step)
        first = last - SERIES_POINTS + 1
        groups: dict[str, _Class] = {cls: _Class() for cls in self.classes}
        causes: dict[str, int] = {}
        for e in entries:
            g = groups.get(e.priority)
            if g is None:
                self.classes.append(e.priority)
                g = groups[e.priority] = _Class()
            g.n += 1
            causes[e.cause] = causes.get(e.cause, 0) + 1
            i = math.floor(e.t / step) - first
            if e.ok:
                if e.ttft is not None:
                    g.ttft.append(e.ttft)
                    if i >= 0:
                        g.series_ttft[i].append(e.ttft)
                g.gap_lists.append(e.gaps)
                g.ngaps += len(e.gaps)
                g.qwait.append(e.queue_wait)
            else:
                g.errors += 1
            if i >= 0:
                g.series_n[i] += 1
            if e.t >= since:
                g.recent += 1
                g.recent_tokens += _tokens_between(e, since, math.inf)
            if e.tokens:  # spread over the buckets its generation covered
                k0 = max(math.floor((e.t - e.gen) / step), first) if e.gen > 0 else last + 1
                if e.gen <= 0 or k0 == first + i:
                    if i >= 0:
                        g.series_tokens[i] += e.tokens
                else:
                    for k in range(k0, first + i + 1):
                        g.series_tokens[k - first] += _tokens_between(e, k * step, (k + 1) * step)
        total = _Class()
        for g in groups.values():
            total.n += g.n
            total.errors += g.errors
            total.recent += g.recent
            total.recent_tokens += g.recent_tokens
            total.ttft += g.ttft
            total.qwait += g.qwait
            total.gap_lists += g.gap_lists
            total.ngaps += g.ngaps
        return {
            "rate_window_s": round(rate_span, 3),
            "uptime_s": round(age, 1),
            "totals": _summary(total, rate_span),
            "classes": {cls: _summary(g, rate_span) for cls, g in groups.items()},
            "causes": dict(sorted(causes.items(), key=lambda kv: (kv[0] != _OK, -kv[1]))),
            "recent_errors": self._recent_errors(now),
            "series": self._series(groups, now, step, first),
        }

    def _recent_errors(self, now: float) -> list[dict[str, Any]]:
        out = []
        for e in reversed(self._entries):
            if not e.ok:
                out.append({"ago_s": round(now - e.t, 1), "cause": e.cause, "status": e.status, "model": e.model,
                            "backend": e.backend, "priority": e.priority, "tenant": e.tenant, "error": e.error})
                if len(out) == RECENT_ERRORS:
                    break
        return out

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

    def _series(self, groups: Mapping[str, _Class], now: float, step: float, first: int) -> dict[str, Any]:
        """Per class, per bucket of ``window_s / SERIES_POINTS`` seconds (buckets aligned to the
        clock, so a point keeps its value between two snapshots): TTFT p50 / p95 of the requests
        that ended in the bucket, and tokens/s (each request's tokens spread evenly from its
        first to its last token)."""
        last = first + SERIES_POINTS - 1
        # the current bucket is still filling: its rate is over the part that has elapsed
        spans = [step] * (SERIES_POINTS - 1) + [max(now - last * step, 1.0)]
        # each point stands at its bucket's end; the current bucket's end is "now"
        ends_ago = [max(0.0, round(now - (first + i + 1) * step, 1)) for i in range(SERIES_POINTS)]
        # buckets that ended before passerelle started have no value (not zero)
        before_start = [(first + i + 1) * step <= self.started for i in range(SERIES_POINTS)]
        out: dict[str, Any] = {"step_s": step, "t_ago_s": ends_ago, "classes": {}}
        for cls, g in groups.items():
            p50, p95, tps = [], [], []
            for i in range(SERIES_POINTS):
                ttfts = sorted(g.series_ttft[i])
                p50.append(_ms(percentile(ttfts, 50)))
                p95.append(_ms(percentile(ttfts, 95)))
                tps.append(None if before_start[i] else round(g.series_tokens[i] / spans[i], 2))
            out["classes"][cls] = {"ttft_p50_ms": p50, "ttft_p95_ms": p95, "tokens_per_s": tps,
                                   "requests": list(g.series_n)}
        return out


def _summary(g: _Class, rate_span: float) -> dict[str, Any]:
    rate_span = max(rate_span, 1e-9)
    return {
        "requests": g.n,
        "ok": g.n - g.errors,
        "errors": g.errors,
        "waiting": 0,
        "ttft_ms": _ms_summary(g.ttft),
        "itl_ms": _ms_summary(_gaps(g.gap_lists, g.ngaps)),
        "queue_wait_ms": _ms_summary(g.qwait),
        "tokens_per_s": round(g.recent_tokens / rate_span, 2),
        "requests_per_s": round(g.recent / rate_span, 3),
    }
