"""``--find-max``: doubling then bisecting, on a model and against the fake with a known capacity."""

from __future__ import annotations

import json

import pytest

from passerelle.bench.search import find_max
from passerelle.cli import main
from passerelle.testing.fake_runtime import start_fake_backend


def capacity(limit: float):
    return lambda load: load <= limit


def test_doubling_then_bisecting_finds_an_integer_capacity():
    s = find_max(capacity(6), start=1, limit=256)
    assert (s.held, s.failed) == (6, 7)
    assert [load for load, _ in s.tried] == [1, 2, 4, 8, 6, 7]
    s = find_max(capacity(37), start=2, limit=256)
    assert (s.held, s.failed) == (37, 38) and len(s.tried) <= 12


def test_no_limit_below_the_cap_and_a_first_level_that_fails():
    s = find_max(capacity(1000), start=1, limit=16)
    assert s.held == 16 and s.failed is None and [load for load, _ in s.tried] == [1, 2, 4, 8, 16]
    s = find_max(capacity(2), start=8, limit=256)
    assert (s.held, s.failed) == (2, 3)  # bisected down from a failing first level
    s = find_max(capacity(0), start=1, limit=256)
    assert s.held is None and s.failed == 1 and len(s.tried) == 1


def test_rates_bisect_to_ten_percent():
    s = find_max(capacity(3.3), start=1.0, limit=100, integer=False)
    assert s.held is not None and s.failed is not None
    assert s.held <= 3.3 < s.failed and s.failed <= s.held * 1.1


def test_find_max_against_the_fake_with_six_slots(tmp_path):
    # 6 slots, 40 ms to the first token, 8 tokens 10 ms apart: up to 6 concurrent requests get
    # their first token after 40 ms; at 7, one in 7 waits a whole request (110 ms) for a slot, so
    # TTFT p95 is about 150 ms. The SLO at 90 ms sits between the two.
    with start_fake_backend(ttft_ms=40, itl_ms=10, slots=6) as fake:
        rc = main(["bench", "--url", fake.url, "--name", "fake", "--find-max", "--slo", "ttft_p95=90ms",
                   "--max-tokens", "8", "--prompt-tokens", "16", "--no-calibrate", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "results.json").read_text())
    t = results["verdict"]["targets"]["fake"]
    # found within one step of the capacity, and the failure right above what it holds
    assert t["max_concurrency"] in (5, 6) and t["limit_found"]
    assert t["fails_at"] == f"concurrency {t['max_concurrency'] + 1}" and t["fails_on"] == ["ttft_p95"]
    tried = [r["concurrency"] for r in results["runs"]]
    assert tried == sorted(tried) and {1, 2, 4, 8} <= set(tried)  # the doubling, then the bisection
    assert results["load"]["find_max"] == {"limit": 256}
    assert f"fake holds {t['max_concurrency']} concurrent requests, fails at" in results["verdict"]["reason"]
    assert "`--find-max`" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize(("argv", "message"), [
    (["--find-max"], "give --slo"),
    (["--find-max", "--slo", "ttft_p95=1s", "--concurrency", "1,2"], "starts from one --concurrency"),
])
def test_find_max_usage_errors(capsys, tmp_path, argv, message):
    assert main(["bench", "--url", "http://127.0.0.1:1", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
