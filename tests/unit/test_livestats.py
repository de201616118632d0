"""The dashboard's rolling window: percentiles per class, rates, causes, expiry, series, backends."""

from __future__ import annotations

import statistics

import pytest

from passerelle.backends import Backend
from passerelle.config import BackendConfig, TimeoutConfig
from passerelle.errors import Cause
from passerelle.livestats import MAX_GAPS, LiveStats, percentile, waiting_from_gauge
from passerelle.metrics import Metrics
from passerelle.request import RequestRecord


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def record(*, priority: str = "standard", cause: Cause = Cause.OK, ttft: float | None = 0.2,
           gaps: list[float] | None = None, tokens: int = 10, status: int = 200, error: str = "") -> RequestRecord:
    rec = RequestRecord(id="req_x", endpoint="chat", t_arrival=100.0, model="m", backend="b1", priority=priority)
    if ttft is not None:
        rec.t_first = 100.0 + ttft
    rec.gaps = list(gaps or [])
    rec.completion_tokens = tokens
    rec.finish(cause, status, error)
    return rec


def test_percentile_interpolates_like_numpy():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 95) == pytest.approx(3.85)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None
    data = sorted(float(i * i % 97) for i in range(200))
    assert percentile(data, 50) == pytest.approx(statistics.quantiles(data, n=100, method="inclusive")[49])


def test_per_class_latencies_counts_and_causes():
    clock = Clock()
    live = LiveStats(window_s=300, clock=clock)
    for i in range(1, 21):  # standard: TTFT 10..200 ms, gaps 5 ms
        live.observe(record(ttft=i / 100, gaps=[0.005] * 4))
    live.observe(record(priority="batch", ttft=2.0, gaps=[0.05, 0.07]))
    live.observe(record(cause=Cause.UPSTREAM_ERROR, ttft=None, status=502, error="boom", tokens=0))
    live.observe(record(priority="batch", cause=Cause.CLIENT_DISCONNECT, ttft=9.0, gaps=[5.0], status=499))
    snap = live.snapshot(waiting={"batch": 3, "standard": 1})
    std, batch = snap["classes"]["standard"], snap["classes"]["batch"]
    assert (std["requests"], std["ok"], std["errors"], std["waiting"]) == (21, 20, 1, 1)
    assert std["ttft_ms"] == {"p50": 105.0, "p95": 190.5, "count": 20}
    assert std["itl_ms"]["p50"] == 5.0 and std["itl_ms"]["count"] == 80
    # a failed request's latency does not count (as in the Prometheus histograms)
    assert batch["ttft_ms"] == {"p50": 2000.0, "p95": 2000.0, "count": 1}
    assert batch["itl_ms"]["p95"] == pytest.approx(69.0)
    assert (batch["requests"], batch["errors"], batch["waiting"]) == (2, 1, 3)
    assert snap["classes"]["interactive"]["requests"] == 0
    assert snap["classes"]["interactive"]["ttft_ms"]["p50"] is None
    assert snap["totals"]["requests"] == 23 and snap["totals"]["waiting"] == 4
    assert snap["causes"] == {"ok": 21, "upstream_error": 1, "client_disconnect": 1}
    assert [e["cause"] for e in snap["recent_errors"]] == ["client_disconnect", "upstream_error"]
    assert snap["recent_errors"][1]["error"] == "boom" and snap["recent_errors"][1]["status"] == 502


def test_rates_use_the_last_minute_and_the_time_since_start():
    clock = Clock()
    live = LiveStats(window_s=300, clock=clock)
    clock.t += 10
    for _ in range(5):
        live.observe(record(tokens=20))
    snap = live.snapshot()
    assert snap["rate_window_s"] == 10.0  # started 10 s ago: not diluted over a whole minute
    assert snap["totals"]["tokens_per_s"] == 10.0 and snap["totals"]["requests_per_s"] == 0.5
    clock.t += 100  # out of the last minute, still in the window
    snap = live.snapshot()
    assert snap["totals"]["tokens_per_s"] == 0.0 and snap["totals"]["requests"] == 5


def test_old_requests_leave_the_window():
    clock = Clock()
    live = LiveStats(window_s=60, clock=clock)
    live.observe(record(ttft=5.0))
    clock.t += 30
    live.observe(record(ttft=0.1))
    assert live.snapshot()["totals"]["requests"] == 2
    clock.t += 31
    snap = live.snapshot()
    assert snap["totals"]["requests"] == 1 and snap["totals"]["ttft_ms"]["p95"] == 100.0
    clock.t += 60
    snap = live.snapshot()
    assert snap["totals"]["requests"] == 0 and snap["causes"] == {}
    assert len(live._entries) == 0


def test_memory_is_bounded_whatever_the_rate():
    live = LiveStats(window_s=300, clock=Clock(), max_entries=100)
    for _ in range(1000):
        live.observe(record())
    assert live.snapshot()["totals"]["requests"] == 100


def test_many_gaps_are_subsampled_evenly():
    live = LiveStats(window_s=300, clock=Clock())
    per = 1000
    n = 2 * MAX_GAPS // per
    for _ in range(n):  # gaps 1..1000 ms in every request
        live.observe(record(gaps=[(i + 1) / 1000 for i in range(per)]))
    itl = live.snapshot()["totals"]["itl_ms"]
    assert itl["count"] <= MAX_GAPS
    assert itl["p50"] == pytest.approx(500, abs=5) and itl["p95"] == pytest.approx(950, abs=5)


def test_unknown_classes_get_a_line():
    live = LiveStats(window_s=300, clock=Clock(), classes=("interactive", "standard"))
    live.observe(record(priority="gold"))
    snap = live.snapshot(waiting={"bronze": 2})
    assert list(snap["classes"]) == ["interactive", "standard", "gold", "bronze"]
    assert snap["classes"]["bronze"]["waiting"] == 2


def test_series_buckets_per_class():
    clock = Clock(3000.0)  # a multiple of the 10 s step: bucket edges are easy to reason about
    live = LiveStats(window_s=300, clock=clock)
    clock.t += 25  # 3025: passerelle started at 3000
    live.observe(record(ttft=0.1, tokens=30))
    live.observe(record(ttft=0.3, tokens=10))
    clock.t += 10  # 3035: the first two are in the previous (full) bucket
    live.observe(record(priority="batch", ttft=1.0, tokens=5))
    series = live.snapshot()["series"]
    assert series["step_s"] == 10.0 and len(series["t_ago_s"]) == 30
    assert series["t_ago_s"][-1] == 0.0 and series["t_ago_s"][-2] == 5.0
    std = series["classes"]["standard"]
    assert std["requests"][-2:] == [2, 0]
    assert std["ttft_p50_ms"][-2] == 200.0 and std["ttft_p95_ms"][-2] == 290.0 and std["ttft_p50_ms"][-1] is None
    assert std["tokens_per_s"][-2] == 4.0
    assert series["classes"]["batch"]["tokens_per_s"][-1] == 1.0  # 5 tokens over the 5 s elapsed
    # buckets from before the start have no value at all (not zero)
    assert std["tokens_per_s"][0] is None and std["tokens_per_s"][-4] == 0.0


def test_backends_and_waiting_gauge():
    b = Backend(BackendConfig(name="b1", url="http://127.0.0.1:9", models=("m",), max_concurrency=4), TimeoutConfig())
    b.in_flight = 3
    b.stats.up, b.stats.slots_busy, b.stats.slots_total = True, 2, 4
    b.stats.kv_cache_usage_ratio, b.stats.queue_depth = 0.25, 1
    metrics = Metrics()
    metrics.waiting.labels("m", "batch").set(4)
    metrics.waiting.labels("m2", "batch").set(1)
    metrics.waiting.labels("m", "interactive").set(2)
    waiting = waiting_from_gauge(metrics)
    assert waiting == {"batch": 5, "interactive": 2}
    snap = LiveStats(clock=Clock()).snapshot(backends=[b], waiting=waiting)
    assert snap["running"] == 3
    (row,) = snap["backends"]
    assert row | {"checked_ago_s": None} == {
        "name": "b1", "kind": "openai", "url": "http://127.0.0.1:9", "models": ["m"], "up": True,
        "slots_busy": 2, "slots_total": 4, "kv_cache_usage_ratio": 0.25, "queue_depth": 1, "in_flight": 3,
        "capacity": 4, "checked_ago_s": None, "error": ""}
    assert snap["classes"]["batch"]["waiting"] == 5 and snap["totals"]["waiting"] == 7


def test_tokens_are_spread_over_the_time_they_were_generated():
    clock = Clock(3000.0)
    live = LiveStats(window_s=300, clock=clock)
    clock.t = 3040.0
    rec = record(ttft=0.5, tokens=200)
    rec.t_last = rec.t_first + 20.0  # 200 tokens from 3020 to 3040: 10 tokens/s
    live.observe(rec)
    snap = live.snapshot()
    tps = snap["series"]["classes"]["standard"]["tokens_per_s"]
    assert tps[-3:] == [10.0, 10.0, 0.0]  # buckets 3020–3030, 3030–3040, and the one that just began
    assert snap["totals"]["tokens_per_s"] == 5.0  # 200 tokens over the 40 s since start
    clock.t = 3090.0  # the last minute (3030–3090) saw the second half of them
    assert live.snapshot()["totals"]["tokens_per_s"] == round(100 / 60, 2)


def test_a_slow_snapshot_is_reused_for_ten_times_its_cost(monkeypatch):
    import passerelle.livestats as livestats

    ticks = iter(x * 0.1 for x in range(100))  # every perf_counter() call: 100 ms later
    monkeypatch.setattr(livestats.time, "perf_counter", lambda: next(ticks))
    clock = Clock()
    live = LiveStats(window_s=300, clock=clock)
    live.observe(record())
    assert live.snapshot()["totals"]["requests"] == 1  # took "100 ms": reused for up to 1 s
    live.observe(record())
    waiting = live.snapshot(waiting={"batch": 2})
    assert waiting["totals"]["requests"] == 1  # the cached figures...
    assert waiting["classes"]["batch"]["waiting"] == 2  # ...with the queue read fresh
    for _ in range(8):
        next(ticks)
    assert live.snapshot()["totals"]["requests"] == 2  # more than a second later: recomputed


def test_a_fast_snapshot_is_never_reused():
    live = LiveStats(window_s=300, clock=Clock())
    for n in range(1, 4):
        live.observe(record())
        assert live.snapshot()["totals"]["requests"] == n


def test_a_window_entry_is_small():
    """The window holds every request of the last minutes: a stream's gaps are kept as C floats
    and a model name is one shared string, not one per request (1.3 KB an entry before)."""
    import tracemalloc

    import orjson

    live = LiveStats(window_s=300, clock=Clock())

    def streamed(i: int) -> RequestRecord:
        rec = record(gaps=[0.01 + k * 1e-5 for k in range(31)], tokens=32)
        rec.model = orjson.loads(b'{"model": "fake-model"}')["model"]  # a new string, as from a request body
        return rec

    live.observe(streamed(0))  # (first-use allocations out of the measurement)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(1, 2000):
            live.observe(streamed(i))  # what stays allocated is what the window holds
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / 1999
    finally:
        tracemalloc.stop()
    assert per_entry < 500
    snap = live.snapshot()
    assert snap["classes"]["standard"]["itl_ms"]["p50"] == pytest.approx(10.15, abs=0.06)
    assert snap["totals"]["requests"] == 2000
