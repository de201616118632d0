"""Cache-proof runs: fresh prompts by default, and a warning when the runtime says it served prompts
from its cache (the fake's ``--prefix-cache`` reports ``cached_tokens`` as a runtime does)."""

from __future__ import annotations

import json
from pathlib import Path

from passerelle.bench.cache import served_from_cache, summarize, warning
from passerelle.bench.client import RequestResult
from passerelle.cli import main
from passerelle.testing.fake_runtime import start_fake_backend

ARGS = ["--concurrency", "2", "--requests", "8", "--max-tokens", "4", "--prompt-tokens", "64"]


def bench(out: Path, url: str, *extra: str) -> dict:
    assert main(["bench", "--url", url, "--name", "fake", "--out", str(out), *ARGS, *extra]) == 0
    return json.loads((out / "results.json").read_text())


def test_a_second_run_gets_fresh_prompts_and_no_warning(tmp_path, capsys):
    with start_fake_backend(ttft_ms=2, itl_ms=1, prefix_cache=512) as fake:
        first = bench(tmp_path / "1", fake.url)
        second = bench(tmp_path / "2", fake.url)
    for results in (first, second):
        (run,) = results["runs"]
        cache = run["cache"]
        assert cache["source"] == "usage.prompt_tokens_details.cached_tokens"
        assert cache["requests_reporting"] == 8 and cache["served_from_cache"] == 0
        assert cache["cached_fraction"] < 0.05  # "Story" and no more: the tag differs at once
        assert run["cache_warning"] is None
    assert first["workload"]["nonce"] != second["workload"]["nonce"] and first["workload"]["seed"] is None
    assert ": served from cache**" not in (tmp_path / "2" / "report.md").read_text()
    assert "served from the runtime's prompt cache" not in capsys.readouterr().err


def test_an_explicit_seed_repeats_prompts_and_the_report_warns(tmp_path, capsys):
    with start_fake_backend(ttft_ms=2, itl_ms=1, prefix_cache=512) as fake:
        first = bench(tmp_path / "1", fake.url, "--seed", "7")
        capsys.readouterr()
        second = bench(tmp_path / "2", fake.url, "--seed", "7")
    assert first["runs"][0]["cache"]["served_from_cache"] == 0 and first["runs"][0]["cache_warning"] is None
    (run,) = second["runs"]
    assert run["cache"]["served_from_cache"] == 8 and run["cache"]["first_turn_cached_fraction"] > 0.9
    assert run["cache_warning"].startswith("8 of 8 requests were served from the runtime's prompt cache")
    assert second["workload"]["nonce"] is None and second["workload"]["seed"] == 7
    md = (tmp_path / "2" / "report.md").read_text()
    assert "**fake c=2: served from cache**" in md and "1 run served from cache" in md
    assert "prompts: reproducible (`--seed 7`)" in md
    err = capsys.readouterr().err
    assert "warning: fake concurrency 2: 8 of 8 requests were served from the runtime's prompt cache" in err


def test_a_deliberate_shared_prefix_is_reported_as_such(tmp_path):
    with start_fake_backend(ttft_ms=2, itl_ms=1, prefix_cache=512) as fake:
        results = bench(tmp_path, fake.url, "--prefix-share", "0.5")
    (run,) = results["runs"]
    # about half of every prompt (after the first) comes from the cache, on purpose: no warning
    assert 0.3 < run["cache"]["cached_fraction"] < 0.6 and run["cache"]["prefix_share"] == 0.5
    assert run["cache"]["served_from_cache"] == 0 and run["cache_warning"] is None
    assert "deliberate shared prefix: 50% of each prompt" in (tmp_path / "report.md").read_text()


def test_a_runtime_that_says_nothing_is_reported_as_unknown(tmp_path):
    with start_fake_backend(ttft_ms=2, itl_ms=1) as fake:  # no prompt_tokens_details
        results = bench(tmp_path, fake.url)
    assert results["runs"][0]["cache"]["source"] is None and results["runs"][0]["cache_warning"] is None
    assert "the runtime reports nothing" in (tmp_path / "report.md").read_text()


def r(prompt: int, cached: int | None, turn: int = 0) -> RequestResult:
    return RequestResult(ok=True, prompt_tokens=prompt, cached_tokens=cached, cache_source="timings", turn=turn)


def test_the_threshold_leaves_room_for_a_chat_template_and_a_shared_prefix():
    assert not served_from_cache(r(128, 5), 0.0)  # the template's first tokens always match
    assert not served_from_cache(r(20, 15), 0.0)  # within 16 tokens
    assert served_from_cache(r(128, 123), 0.0)
    assert not served_from_cache(r(128, 70), 0.5)  # half shared on purpose, a little more by chance
    assert served_from_cache(r(128, 123), 0.5)
    summary = summarize([r(128, 123), r(128, 4), r(300, 290, turn=1)], 0.0)
    assert summary["served_from_cache"] == 1 and summary["first_turn_requests"] == 2  # later turns left out
    assert summary["source"] == "timings.cache_n" and summary["later_turns"] == 1
    assert warning(summary).startswith("1 of 2 requests were served from the runtime's prompt cache")


def test_without_per_request_figures_the_runtime_counters_decide():
    cache = {"prefix_share": 0.0, "source": None, "turns": 1,
             "runtime": {"source": "vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total",
                         "cached_tokens": 900, "prompt_tokens": 1000, "hit_fraction": 0.9}}
    assert "served 90% of this run's prompt tokens from its prefix cache" in warning(cache)
    cache["runtime"]["hit_fraction"] = 0.1
    assert warning(cache) is None
