"""The bench/ scripts' shared harness (bench/harness.py, bench/loadgen.py) and bench/overhead.py's
figures: services that start, answer and stop, the load client's counts against the real fake
runtime and passerelle (real sockets), and what a gateway adds, taken round by round."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import each other by name, as `python bench/X.py` does

import harness  # noqa: E402
import loadgen  # noqa: E402
import overhead  # noqa: E402
import overhead_report  # noqa: E402

from passerelle.bench.stats import percentile  # noqa: E402


def test_percentiles_interpolate_and_say_nan_for_nothing():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert harness.pct(xs, 50) == 2.5 == percentile(sorted(xs), 50)
    assert harness.pct(xs, 0) == 1.0 and harness.pct(xs, 100) == 4.0
    assert math.isnan(harness.pct([], 99)) and harness.fmt(harness.pct([], 99)) == "–"
    assert harness.fmt(1234.5) == "1,234.5" and harness.fmt(None) == "–"


def test_report_head_says_what_ran_where_and_under_what_load(tmp_path):
    head = harness.report_head("x")
    assert list(head) == ["benchmark", "started", "machine", "loadavg_start", "cpu_pressure_start"]
    assert head["benchmark"] == "x" and head["machine"]["cores"] and len(head["loadavg_start"]) == 3
    harness.write_json(tmp_path / "r.json", head)
    assert (tmp_path / "r.json").read_text().endswith("}\n")


def test_a_service_that_exits_is_not_ready_at_once(tmp_path):
    svc = harness.spawn("quitter", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path,
                        url=f"http://127.0.0.1:{harness.free_port()}")
    with pytest.raises(harness.NotReady, match="quitter exited with 3"):
        svc.wait_ready("/health", 30)
    assert svc.log == tmp_path / "quitter.log"


def test_load_through_passerelle_counts_every_token_once(tmp_path):
    # The fake's role chunk ("content":"") is no token: a request of 8 tokens counts 8, else the
    # round would record "9 of 8 tokens" errors.
    with harness.fake_and_passerelle(tmp_path, 0, 1, 8, src=harness.ROOT) as (fake, gw):
        for url in (fake.url, gw.url):
            r = loadgen.run_async(loadgen.run_load(url, 2, 6, 8, stagger_s=0.01, timeout=30))
            assert not r.errors
            assert len(r.ttft_ms) == len(r.e2e_ms) == 6
            assert r.requests >= 6 + 2  # and each user's warm-up
            assert r.tokens_per_s > 0 and all(e >= t for t, e in zip(r.ttft_ms, r.e2e_ms, strict=True))
        pids = gw.pids
        assert gw.proc.pid in pids and harness.rss_bytes(pids) > 0 and harness.cpu_s(pids) > 0
    assert gw.proc.returncode is not None and fake.proc.returncode is not None


def test_a_failed_request_is_an_error_not_a_measurement(tmp_path):
    fake = harness.start_fake(tmp_path, 0, 1, 4, src=harness.ROOT, extra=["--fail-rate", "1"])
    try:
        r = loadgen.run_async(loadgen.run_load(fake.url, 1, 2, 4, stagger_s=0, timeout=10, cap_s=1))
    finally:
        fake.stop()
    assert r.errors["HTTP 500"] >= 2 and not r.ttft_ms


def rnd(ttfts: list[float], tps: float) -> loadgen.Round:
    return loadgen.Round(ttft_ms=ttfts, e2e_ms=[t + 100 for t in ttfts], tokens_per_s=tps, requests=len(ttfts),
                         wall_s=1.0, gen_cpu_s=0.1)


def test_what_a_gateway_adds_is_taken_round_by_round():
    direct, gw = overhead_report.Cell(), overhead_report.Cell()
    # the machine slows down in round 2 for both: paired, the gateway adds 1 ms in each round
    for d, g in (([50.0, 50.0], [51.0, 51.0]), ([60.0, 60.0], [61.0, 61.0])):
        direct.add(rnd(d, 1000.0), 0.0, 0)
        gw.add(rnd(g, 900.0), 0.5, 40 << 20)
    s = gw.summary(direct, True)
    assert s["added_ttft_ms"] == {"p50": 1.0, "p95": 1.0, "p99": 1.0}
    assert s["tokens_per_s_vs_direct"] == 0.9 and s["rss_mib"] == 40.0
    assert s["cpu_s_per_1k_requests"] == 250.0  # 1 s over 4 requests
    assert direct.summary(direct, False)["added_ttft_ms"] is None


def test_requests_per_level():
    assert overhead.per_level("auto", [1, 64]) == {1: 60, 64: 1024}
    assert overhead.per_level("10", [1, 64]) == {1: 10, 64: 10}
    assert overhead.per_level("10,20", [1, 64]) == {1: 10, 64: 20}
    with pytest.raises(SystemExit):
        overhead.per_level("1,2,3", [1, 64])
