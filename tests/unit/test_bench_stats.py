"""Percentiles, run records, steady-state throughput, SLO parsing and checks, goodput, the verdict."""

from __future__ import annotations

import pytest

from passerelle.bench.client import RequestResult
from passerelle.bench.runner import Level, LevelResult
from passerelle.bench.stats import parse_slos, percentile, run_record, steady_window, summarize_ms
from passerelle.bench.verdict import memory_phrase, verdict
from passerelle.bench.workload import TrafficClass, Workload


def test_percentile_interpolates_like_numpy_linear():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_in_ms_and_empty():
    s = summarize_ms([0.1, 0.2, 0.3])
    assert s == {"mean": 200.0, "p50": 200.0, "p90": 280.0, "p95": 290.0, "p99": 298.0}
    assert summarize_ms([]) == {"mean": None, "p50": None, "p90": None, "p95": None, "p99": None}


def test_parse_slos():
    slos = parse_slos("ttft_p95=2s,tpot_p50=100ms, e2e_p99=1.5m,itl_mean=40,error_rate=1%")
    assert [(s.key, s.threshold) for s in slos] == [
        ("ttft_p95", 2000.0), ("tpot_p50", 100.0), ("e2e_p99", 90000.0), ("itl_mean", 40.0),
        ("error_rate", 0.01)]
    assert parse_slos(None) == [] and parse_slos("") == []
    for bad in ("ttft=2s", "latency_p95=1s", "ttft_p95", "ttft_p42=1s", "ttft_p95=soon"):
        with pytest.raises(ValueError):
            parse_slos(bad)


def ok(ttft: float, e2e: float, tokens: int = 11, t_send: float = 0.0, itl: list[float] | None = None):
    return RequestResult(ok=True, ttft=ttft, e2e=e2e, output_tokens=tokens, chunks=tokens, usage=True,
                         t_send=t_send, t_done=t_send + e2e, itl=itl or [], prompt_tokens=100)


def level_result(results: list[RequestResult], concurrency: int = 2) -> LevelResult:
    cls = TrafficClass(None, Workload(), concurrency=concurrency, requests=len(results))
    return LevelResult(Level((cls,), concurrency=concurrency), results)


def test_run_record_counts_throughput_and_errors():
    results = [ok(0.1, 1.1, t_send=0.0), ok(0.3, 1.3, t_send=0.7),
               RequestResult(ok=False, error="http_500", detail="boom", t_send=0.2, t_done=0.25),
               RequestResult(ok=False, error="stream_aborted", t_send=0.3, t_done=0.9, output_tokens=3)]
    lvl = level_result(results)
    run = run_record("t", lvl, results, parse_slos("ttft_p95=200ms"), concurrency=2)
    assert run["requests_ok"] == 2 and run["errors"] == 2
    assert run["errors_by_kind"] == {"http_500": 1, "stream_aborted": 1}
    assert run["error_samples"]["http_500"] == "boom"
    assert run["duration_s"] == pytest.approx(2.0)  # first send 0.0 → last answer 2.0
    assert run["output_tokens"] == 22  # the aborted request's 3 tokens are not output
    assert run["output_tokens_per_s"] == pytest.approx(11.0)
    assert run["requests_per_s"] == pytest.approx(1.0)
    assert run["goodput_rps"] == pytest.approx(0.5)  # only the 100 ms TTFT request meets 200 ms
    assert run["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert run["tpot_ms"]["mean"] == pytest.approx(100.0)  # (1.1 - 0.1) / 10
    assert run["token_count_source"] == "usage"
    assert run["slo_failures"] == ["ttft_p95"] and run["meets_slo"] is False


def test_token_count_source_flags_fallback():
    a, b = ok(0.1, 1.0), ok(0.1, 1.0)
    b.usage = False
    run = run_record("t", level_result([a, b]), [a, b], [])
    assert run["token_count_source"] == "mixed"
    a.usage = False
    assert run_record("t", level_result([a, b]), [a, b], [])["token_count_source"] == "chunks"


def test_error_rate_slo_and_a_run_without_success_fails():
    bad = RequestResult(ok=False, error="connect", t_send=0.0, t_done=0.1)
    results = [ok(0.1, 1.0), bad]
    run = run_record("t", level_result(results), results, parse_slos("error_rate=10%"))
    assert run["slo_failures"] == ["error_rate"]
    none = run_record("t", level_result([bad]), [bad], [])
    assert none["meets_slo"] is False and none["ttft_ms"]["p50"] is None


def test_steady_state_excludes_ramp_up_and_drain():
    # closed loop, 2 workers, 7 requests of 1 s with 10 tokens (0.1 s TTFT, then one every 0.09 s),
    # except that the first pair's tokens come late and in a burst (a cold start) and the last
    # request runs alone (the drain)
    results = []
    for k in range(3):
        for _ in range(2):
            results.append(ok(0.1 if k else 0.6, 1.0, tokens=10, t_send=float(k), itl=[0.09 if k else 0.04] * 9))
    results.append(ok(0.1, 1.0, tokens=10, t_send=3.0, itl=[0.09] * 9))
    level = level_result(results)
    assert steady_window(level) == (1.0, 3.0)  # first answer's end → last send
    run = run_record("t", level, results, [], concurrency=2)
    assert run["throughput_over"] == "steady state"
    # in [1, 3]: the 40 tokens of the four requests sent at 1 and 2, over 2 s
    assert run["output_tokens_per_s"] == pytest.approx(20.0)
    assert run["requests_per_s"] == pytest.approx(2.0)  # 4 requests ended in (1, 3]
    assert run["steady_state"] == {"start_s": 1.0, "end_s": 3.0, "duration_s": 2.0, "requests_ended": 4,
                                   "output_tokens": 40.0}
    # the whole run, ramp-up and a lone last request included, reads lower
    assert run["whole_run"]["output_tokens_per_s"] == pytest.approx(70 / 4.0)


def test_too_short_for_a_steady_state_uses_the_whole_run():
    results = [ok(0.1, 1.0, t_send=0.0), ok(0.1, 1.0, t_send=0.01)]
    run = run_record("t", level_result(results), results, [], concurrency=2)
    assert run["throughput_over"] == "whole run" and run["steady_state"] is None
    assert run["output_tokens_per_s"] == pytest.approx(22 / 1.01, rel=1e-3)


def run(target: str, conc: int, ttft_p95: float, tok_s: float, meets: bool, model_cls=None,
        memory: dict | None = None) -> dict:
    return {"target": target, "class": model_cls, "concurrency": conc, "rate": None, "meets_slo": meets,
            "slo_failures": [] if meets else ["ttft_p95"], "ttft_ms": {"p95": ttft_p95},
            "output_tokens_per_s": tok_s, "requests_per_s": tok_s / 10, "goodput_rps": tok_s / 20, "memory": memory}


def test_verdict_says_where_the_limit_is_and_whether_it_was_found():
    runs = [run("vulkan", 1, 100, 30, True), run("vulkan", 5, 900, 120, True), run("vulkan", 10, 3000, 150, False),
            run("rocm", 1, 90, 35, True), run("rocm", 5, 2500, 140, False), run("rocm", 10, 5000, 160, False),
            run("cuda", 1, 50, 40, True), run("cuda", 5, 300, 100, True)]
    v = verdict(runs, parse_slos("ttft_p95=2s"), {"vulkan": "m", "rocm": "m", "cuda": "m"})
    # cuda held every load it was given: "≥ 5", ranked above vulkan's 5 with a limit at 10
    assert v["winner"] == "cuda"
    assert v["targets"]["cuda"]["summary"] == "holds ≥ 5 concurrent requests (the highest load tried)"
    assert v["targets"]["cuda"]["limit_found"] is False
    vk = v["targets"]["vulkan"]
    assert vk["max_concurrency"] == 5 and vk["output_tokens_per_s"] == 120 and vk["limit_found"] is True
    assert vk["summary"] == "holds 5 concurrent requests, fails at 10 (TTFT p95)"
    assert vk["fails_at"] == "concurrency 10" and vk["fails_on"] == ["ttft_p95"]
    assert v["targets"]["rocm"]["summary"] == "holds 1 concurrent request, fails at 5 (TTFT p95)"
    assert v["reason"].startswith("cuda holds ≥ 5 concurrent requests (the highest load tried) within the SLOs")
    assert "vulkan: holds 5 concurrent requests, fails at 10 (TTFT p95)" in v["reason"]
    assert v["model_ids_differ"] is False


def test_verdict_holds_only_up_to_the_first_failure():
    runs = [run("a", 1, 100, 30, True), run("a", 2, 3000, 50, False), run("a", 4, 1900, 60, True)]
    t = verdict(runs, parse_slos("ttft_p95=2s"), {"a": "m"})["targets"]["a"]
    assert t["max_concurrency"] == 1 and t["passes_again_at"] == ["concurrency 4"]
    assert t["summary"] == "holds 1 concurrent request, fails at 2 (TTFT p95); passed again at 4 (noisy?)"
    assert t["loads_meeting_slo"] == ["concurrency 1", "concurrency 4"]


def test_verdict_throughput_decides_beyond_the_tie_margin_and_flags_models():
    runs = [run("a", 4, 10, 100, True), run("b", 4, 10, 130, True)]
    v = verdict(runs, [], {"a": "llama-q4", "b": "llama-q8"})
    assert v["winner"] == "b" and v["tie"] == []
    assert v["model_ids_differ"] is True


def test_verdict_within_the_tie_margin_names_no_winner():
    runs = [run("gateway", 1, 10, 60.1, True), run("direct", 1, 10, 61.0, True)]
    v = verdict(runs, [], {"gateway": "m", "direct": "m"})
    assert v["winner"] is None and v["tie"] == ["direct", "gateway"]
    assert v["reason"].startswith("no clear winner: direct and gateway each holds ≥ 1 concurrent request")
    assert "within the noise of each other (61.0 vs 60.1; differences under 5% are noise here)" in v["reason"]
    assert verdict(runs, [], {"gateway": "m", "direct": "m"}, tie_margin=0.01)["winner"] == "direct"
    # noisy runs widen the margin: 2 × √(0.08² + 0.06²) = 20 %
    noisy = [{**runs[0], "output_tokens_per_s": 50.0, "throughput_rse": 0.08}, {**runs[1], "throughput_rse": 0.06}]
    v = verdict(noisy, [], {"gateway": "m", "direct": "m"})
    assert v["winner"] is None and v["tie_within"] == pytest.approx(0.2) and "under 20% are noise" in v["reason"]
    noisy[0]["output_tokens_per_s"] = 45.0  # 26 % below: a difference
    assert verdict(noisy, [], {"gateway": "m", "direct": "m"})["winner"] == "direct"


def test_verdict_names_the_winners_memory():
    mem = {"rss_peak_bytes": 900 * 2**20, "pss_peak_bytes": 850 * 2**20, "gpu_process_peak_bytes": 5 * 2**30}
    v = verdict([run("a", 4, 10, 100, True, memory=mem)], [], {"a": "m"})
    assert v["targets"]["a"]["memory"] == mem
    assert "at 100.0 output tokens/s and 850 MiB resident (PSS, peak) + 5.00 GiB GPU" in v["reason"]
    assert memory_phrase({"rss_peak_bytes": 3 * 2**30}) == "3.00 GiB resident (RSS, peak)"
    assert memory_phrase(None) is None


def test_verdict_without_any_passing_level():
    v = verdict([run("a", 1, 5000, 10, False)], parse_slos("ttft_p95=1s"), {"a": "m"})
    assert v["winner"] is None and v["targets"]["a"]["max_concurrency"] is None
    assert v["targets"]["a"]["summary"] == "fails at the lowest load tried, 1 concurrent request (TTFT p95)"
    assert "it does not meet the SLOs" in v["reason"]  # one target: no "target" to compare


def test_verdict_ignores_per_class_runs():
    runs = [run("a", 4, 10, 100, True, "interactive"), run("a", 6, 10, 50, False, "all")]
    assert verdict(runs, [], {"a": "m"})["winner"] is None
