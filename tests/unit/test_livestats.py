"""The dashboard's rolling window: percentiles per class, rates, causes, expiry, series, backends,
and a memory that does not grow with the request rate."""

from __future__ import annotations

import math
import random
import statistics
import tracemalloc

import pytest

from passerelle.config import BackendConfig, TimeoutConfig
from passerelle.errors import Cause
from passerelle.observe.livestats import LiveStats
from passerelle.observe.loghist import REL_ERROR
from passerelle.observe.record import RequestRecord
from passerelle.runtimes.kinds import Backend


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


def near(got: float | None, exact_ms: float) -> bool:
    """Within the histograms' error of the exact figure, give or take the rounding to 0.1 ms."""
    return got is not None and abs(got - exact_ms) <= exact_ms * REL_ERROR + 0.05 + 1e-9


def exact_ms(values: list[float], q: int) -> float:
    """The exact percentile in ms, linearly interpolated between closest ranks (numpy's default)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


def test_percentiles_are_within_a_fifth_of_a_percent_of_the_exact_ones():
    assert REL_ERROR < 0.0021  # (the dashboard's medians agree with the access log's to 0.1 ms)
    rng = random.Random(42)
    clock = Clock()
    live = LiveStats(window_s=300, clock=clock)
    ttfts, gaps, waits = [], [], []
    for i in range(3000):  # log-uniform from 1 ms to 30 s, spread over most of the window
        clock.t = 1000.0 + i * 0.09
        ttft = 10 ** rng.uniform(-3, math.log10(30))
        request_gaps = [10 ** rng.uniform(-3, math.log10(30)) for _ in range(rng.randint(0, 5))]
        rec = record(ttft=ttft, gaps=request_gaps)
        rec.t_queued, rec.t_dispatch = 50.0, 50.0 + rng.choice([0.0, 10 ** rng.uniform(-3, 1)])
        live.observe(rec)
        ttfts.append(ttft)
        gaps += request_gaps
        waits.append(rec.queue_wait)
    snap = live.snapshot()
    for key, values in (("ttft_ms", ttfts), ("itl_ms", gaps), ("queue_wait_ms", waits)):
        got = snap["classes"]["standard"][key]
        assert got["count"] == len(values), key
        for q in (50, 95):
            exact = exact_ms(values, q)
            assert near(got[f"p{q}"], exact), (key, q, got, exact)
            assert abs(got[f"p{q}"] - exact) <= 0.01 * exact + 0.05
        assert snap["totals"][key] == got
    # each chart bucket's TTFT percentiles too (10 s buckets; the last one, still open, included)
    by_bucket: dict[int, list[float]] = {}
    for i, ttft in enumerate(ttfts):
        by_bucket.setdefault(math.floor(1000.0 + i * 0.09) // 10, []).append(ttft)
    series = snap["series"]["classes"]["standard"]
    first = math.floor(clock.t) // 10 - 29
    for i in range(30):
        values = by_bucket.get(first + i, [])
        assert series["requests"][i] == len(values)
        if values:
            assert near(series["ttft_p50_ms"][i], exact_ms(values, 50))
            assert near(series["ttft_p95_ms"][i], exact_ms(values, 95))
        else:
            assert series["ttft_p50_ms"][i] is None
    # the interpolation between ranks is numpy's
    live = LiveStats(window_s=300, clock=Clock())
    for ttft in (1.0, 2.0, 3.0, 4.0):
        live.observe(record(ttft=ttft))
    ttft_ms = live.snapshot()["totals"]["ttft_ms"]
    assert near(ttft_ms["p50"], 2500.0) and near(ttft_ms["p95"], 3850.0) and ttft_ms["count"] == 4


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
    assert list(std["ttft_ms"]) == ["p50", "p95", "count"] and std["ttft_ms"]["count"] == 20
    assert near(std["ttft_ms"]["p50"], 105.0) and near(std["ttft_ms"]["p95"], 190.5)
    assert near(std["itl_ms"]["p50"], 5.0) and std["itl_ms"]["count"] == 80
    # a failed request's latency does not count (as in the Prometheus histograms)
    assert near(batch["ttft_ms"]["p50"], 2000.0) and near(batch["ttft_ms"]["p95"], 2000.0)
    assert batch["ttft_ms"]["count"] == 1
    assert near(batch["itl_ms"]["p95"], 69.0) and batch["itl_ms"]["count"] == 2
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
    assert snap["totals"]["requests"] == 1 and near(snap["totals"]["ttft_ms"]["p95"], 100.0)
    clock.t += 60
    snap = live.snapshot()
    assert snap["totals"]["requests"] == 0 and snap["causes"] == {}
    assert snap["totals"]["ttft_ms"] == {"p50": None, "p95": None, "count": 0}
    assert snap["series"]["classes"]["standard"]["requests"] == [0] * 30


def test_all_gaps_are_counted():
    live = LiveStats(window_s=300, clock=Clock())
    per = 1000
    for _ in range(100):  # gaps 1..1000 ms in every request: 100,000 in all, none dropped
        live.observe(record(gaps=[(i + 1) / 1000 for i in range(per)]))
    itl = live.snapshot()["totals"]["itl_ms"]
    assert itl["count"] == 100 * per
    assert near(itl["p50"], 500.5) and near(itl["p95"], 950.05)


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
    assert near(std["ttft_p50_ms"][-2], 200.0) and near(std["ttft_p95_ms"][-2], 290.0)
    assert std["ttft_p50_ms"][-1] is None and std["ttft_p50_ms"][-3] is None
    assert near(series["classes"]["batch"]["ttft_p50_ms"][-1], 1000.0)  # the open bucket's
    assert std["tokens_per_s"][-2] == 4.0
    assert series["classes"]["batch"]["tokens_per_s"][-1] == 1.0  # 5 tokens over the 5 s elapsed
    # buckets from before the start have no value at all (not zero)
    assert std["tokens_per_s"][0] is None and std["tokens_per_s"][-4] == 0.0


def test_backends_and_waiting():
    b = Backend(BackendConfig(name="b1", url="http://127.0.0.1:9", models=("m",), max_concurrency=4), TimeoutConfig())
    b.in_flight = 3
    b.stats.up, b.stats.slots_busy, b.stats.slots_total = True, 2, 4
    b.stats.kv_cache_usage_ratio, b.stats.queue_depth = 0.25, 1
    snap = LiveStats(clock=Clock()).snapshot(backends=[b.describe()], waiting={"batch": 5, "interactive": 2})
    assert snap["running"] == 3
    (row,) = snap["backends"]
    assert row | {"checked_ago_s": None} == {
        "name": "b1", "kind": "openai", "url": "http://127.0.0.1:9", "models": ["m"], "up": True,
        "slots_busy": 2, "slots_total": 4, "kv_cache_usage_ratio": 0.25, "queue_depth": 1, "in_flight": 3,
        "capacity": 4, "capacity_source": "declared", "capacity_detail": "4 (declared: max_concurrency)",
        "capacity_reported": None, "breaker": "closed", "checked_ago_s": None, "error": ""}
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


def test_a_slow_snapshot_is_reused_for_ten_times_its_cost():
    ticks = iter(x * 0.1 for x in range(100))  # every timer() call: 100 ms later
    clock = Clock()
    live = LiveStats(window_s=300, clock=clock, timer=lambda: next(ticks))
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




def test_slots_leave_the_window_one_by_one():
    """One request a second for 15 minutes through a 5-minute window: slow ones (1 s TTFT, an
    error every 25th) for the first 7.5 minutes, then fast ones (100 ms)."""
    clock = Clock(1000.0)
    live = LiveStats(window_s=300, clock=clock)

    def run(until: int) -> dict:
        for i in range(run.done, until):  # type: ignore[attr-defined]
            clock.t = 1000.5 + i
            slow = i < 450
            if i % 25 == 0 and slow:
                live.observe(record(cause=Cause.UPSTREAM_ERROR, ttft=None, status=502, error=f"boom {i}", tokens=0))
            else:
                live.observe(record(ttft=1.0 if slow else 0.1, tokens=10))
        run.done = until  # type: ignore[attr-defined]
        return live.snapshot()

    run.done = 0  # type: ignore[attr-defined]
    snap = run(600)  # the window: the slots of 1299..1599 (the one it began in too), requests 299..599
    std = snap["classes"]["standard"]
    assert std["requests"] == 301 and std["errors"] == 6 and snap["causes"] == {"ok": 295, "upstream_error": 6}
    assert std["ttft_ms"]["count"] == 295  # 151 slow ones, then 144 fast
    assert near(std["ttft_ms"]["p50"], 100.0) and near(std["ttft_ms"]["p95"], 1000.0)
    # the last minute: 60 requests a minute, 10 tokens each, all fast
    assert std["requests_per_s"] == pytest.approx(1.0, abs=1 / 60) and std["tokens_per_s"] == pytest.approx(10, abs=0.2)
    # the newest error first, only those still in the window
    assert [e["error"] for e in snap["recent_errors"]] == [f"boom {i}" for i in (425, 400, 375, 350, 325, 300)]
    assert snap["recent_errors"][0]["ago_s"] == 174.0
    series = snap["series"]["classes"]["standard"]
    errors = [sum(1 for i in range(300 + 10 * b, 310 + 10 * b) if i % 25 == 0 and i < 450) for b in range(29)]
    assert series["requests"] == [10] * 30 and series["tokens_per_s"][:-1] == [10.0 - e for e in errors]
    assert errors[:3] == [1, 0, 1]
    assert series["tokens_per_s"][-1] == round(100 / 9.5, 2)  # the open bucket: 9.5 s of 1590–1600
    assert near(series["ttft_p50_ms"][0], 1000.0) and near(series["ttft_p95_ms"][-2], 100.0)

    snap = run(760)  # requests 459..759: all fast; the slow ones and their errors are gone
    std = snap["classes"]["standard"]
    assert std["requests"] == 301 and std["errors"] == 0 and snap["causes"] == {"ok": 301}
    assert near(std["ttft_ms"]["p50"], 100.0) and near(std["ttft_ms"]["p95"], 100.0) and std["ttft_ms"]["count"] == 301
    assert snap["recent_errors"] == []
    clock.t += 200  # nothing new: the window empties slot by slot
    snap = live.snapshot()
    assert snap["totals"]["requests"] == 101 and snap["totals"]["ttft_ms"]["count"] == 101
    assert snap["totals"]["tokens_per_s"] == 0.0 and snap["totals"]["requests_per_s"] == 0.0


def test_recent_errors_are_bounded_newest_first():
    clock = Clock()
    live = LiveStats(window_s=300, clock=clock)
    for i in range(50):
        clock.t += 1
        live.observe(record(priority="batch", cause=Cause.QUEUE_TIMEOUT, ttft=None, status=504, error=f"late {i}"))
    errors = live.snapshot()["recent_errors"]
    assert [e["error"] for e in errors] == [f"late {i}" for i in range(49, 29, -1)]
    assert errors[0] == {"ago_s": 0.0, "cause": "queue_timeout", "status": 504, "model": "m", "backend": "b1",
                         "priority": "batch", "tenant": "anonymous", "error": "late 49"}
    assert errors[-1]["ago_s"] == 19.0


def test_tokens_of_a_generation_longer_than_the_window():
    clock = Clock(3000.0)
    live = LiveStats(window_s=60, clock=clock)  # 2 s chart buckets
    clock.t = 3100.0
    rec = record(ttft=0.1, tokens=1000)
    rec.t_last = rec.t_first + 100.0  # 10 tokens/s from 3000 to 3100, begun before the window
    live.observe(rec)
    snap = live.snapshot()
    tps = snap["series"]["classes"]["standard"]["tokens_per_s"]
    assert tps[:-1] == [10.0] * 29 and tps[-1] == 0.0
    assert snap["totals"]["tokens_per_s"] == 10.0  # 600 of them in the last minute
    clock.t = 3130.0
    assert live.snapshot()["totals"]["tokens_per_s"] == 5.0
    clock.t = 3161.0
    snap = live.snapshot()
    assert snap["totals"]["tokens_per_s"] == 0.0 and snap["totals"]["requests"] == 0


def test_a_window_shorter_than_thirty_seconds_has_shorter_slots():
    clock = Clock(3000.0)
    live = LiveStats(window_s=6, clock=clock)  # chart buckets and slots of 0.2 s
    for i in range(30):
        clock.t = 3000.05 + i * 0.2
        live.observe(record(ttft=0.01 * (i + 1), tokens=2))
    snap = live.snapshot()
    series = snap["series"]["classes"]["standard"]
    assert snap["totals"]["requests"] == 30 and series["requests"] == [1] * 30
    assert near(series["ttft_p50_ms"][0], 10.0) and near(series["ttft_p50_ms"][-1], 300.0)
    clock.t += 3
    snap = live.snapshot()
    assert snap["totals"]["requests"] == 16 and near(snap["totals"]["ttft_ms"]["p50"], 225.0)


def streams(n: int, seed: int = 5) -> list[RequestRecord]:
    """Completed 16-token streams in three classes, TTFTs and gaps as jittery as real ones."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rec = record(priority=("interactive", "standard", "batch")[i % 3], ttft=rng.lognormvariate(-1.6, 0.5),
                     gaps=[0.02 * rng.lognormvariate(0, 0.1) for _ in range(15)], tokens=16)
        rec.t_last = rec.t_first + sum(rec.gaps)
        out.append(rec)
    return out


def window_memory(n: int, pool: list[RequestRecord]) -> int:
    """Bytes the window holds after ``n`` requests spread evenly over its 300 s."""
    clock = Clock(3000.0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        live = LiveStats(window_s=300, clock=clock)
        for i in range(n):
            clock.t = 3000.0 + 299.0 * i / n
            live.observe(pool[i % len(pool)])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert live.snapshot()["totals"]["requests"] == n
    return held


def test_memory_does_not_grow_with_the_request_rate():
    """Fifty times the requests in the window, about the same memory: what a slot holds is bounded
    by the histogram's buckets, not by the requests (a window of requests took 440 bytes each)."""
    pool = streams(600)
    small, large = window_memory(2_000, pool), window_memory(100_000, pool)
    assert large < 3 * small
    assert large < 1_500_000


def test_a_reload_of_the_classes_changes_the_dashboards_rows():
    # [[classes]] apply at a reload; the dashboard kept the start-up classes (a renamed one stayed,
    # the new one appeared only with its first finished request).
    live = LiveStats(window_s=60, classes=["interactive", "standard", "batch"])
    live.configure(["interactive", "standard", "bulk"])
    assert list(live.snapshot()["classes"]) == ["interactive", "standard", "bulk"]
