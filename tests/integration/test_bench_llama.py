"""passerelle bench against the real llama-server: a short sweep whose report agrees with results.json."""

from __future__ import annotations

import pytest

from passerelle.cli import main
from tests.unit.test_bench_report import assert_report_consistent

pytestmark = pytest.mark.llama


def test_short_sweep_against_llama_server(llama_server, tmp_path):
    rc = main(["bench", "--url", llama_server.url, "--concurrency", "1,2", "--requests", "4", "--max-tokens", "16",
               "--prompt-tokens", "64", "--slo", "ttft_p95=10s", "--name", "llama-server", "--out", str(tmp_path)])
    assert rc == 0
    results = assert_report_consistent(tmp_path)
    assert [r["concurrency"] for r in results["runs"]] == [1, 2]
    for run in results["runs"]:
        assert run["requests_ok"] == 4 and run["errors"] == 0
        # ignore_eos makes every answer exactly max_tokens long; llama-server reports it in usage
        assert run["token_count_source"] == "usage" and run["output_tokens"] == 4 * 16
        assert run["tokens_per_chunk"] >= 1.0
        assert 0 < run["ttft_ms"]["p50"] < run["e2e_ms"]["p50"]
        assert run["tpot_ms"]["p50"] > 0 and run["output_tokens_per_s"] > 0
        # prompts were sized with the server's own tokenizer (calibration probes)
        assert abs(run["prompt_tokens_mean"] - 64) <= 8
    target = results["targets"][0]
    assert target["model"] == llama_server.model
    assert target["version"].get("build_info")  # llama-server's /props
    assert target["prompt_calibration"]["tokens_per_word"] != 1.3  # measured, not the default
    # one target is measured, never a "winner"
    assert results["verdict"]["winner"] is None and results["verdict"]["reason"].startswith("llama-server holds")


def compare(url: str, out, *extra: str) -> dict:
    # a newcomer's options, kept short: two targets behind the same runtime (as a gateway and the
    # runtime direct would be), one level
    rc = main(["bench", "compare", "--target", f"first={url}", "--target", f"second={url}/v1", "--requests", "4",
               "--max-tokens", "8", "--prompt-tokens", "96", "--out", str(out), *extra])
    assert rc == 0
    return assert_report_consistent(out)


def test_compare_twice_the_second_run_is_not_served_from_cache(llama_server, tmp_path):
    runs = [compare(llama_server.url, tmp_path / f"run{k}") for k in (1, 2)]
    for results in runs:
        for run in results["runs"]:
            cache = run["cache"]
            # llama-server says, per request, how much of the prompt it reused
            assert cache["source"] == "usage.prompt_tokens_details.cached_tokens" and cache["requests_reporting"] == 4
            assert cache["served_from_cache"] == 0 and run["cache_warning"] is None
            assert cache["first_turn_cached_fraction"] < 0.2  # the chat template's first tokens, no more
            # and it computed the rest: timings.prompt_n, the prompt tokens it evaluated
            assert cache["prompt_tokens_evaluated_mean"] >= 0.8 * run["prompt_tokens_mean"]
        mem = results["targets"][0]["memory"]
        assert mem["process"]["pid"] == llama_server.proc.pid and mem["process"]["name"].startswith("llama-server")
        assert mem["runtime"] == {"slots": 4, "n_ctx_per_slot": 2048}
        assert results["runs"][0]["memory"]["rss_peak_bytes"] > 100 * 2**20
    assert runs[0]["workload"]["nonce"] != runs[1]["workload"]["nonce"]


def test_an_explicit_seed_repeats_prompts_and_the_cache_check_sees_it(llama_server, tmp_path):
    compare(llama_server.url, tmp_path / "seeded1", "--seed", "11")
    again = compare(llama_server.url, tmp_path / "seeded2", "--seed", "11")
    served = sum(r["cache"]["served_from_cache"] for r in again["runs"])
    assert served >= 4, [r["cache"] for r in again["runs"]]
    warned = [r for r in again["runs"] if r["cache_warning"]]
    assert warned and "served from the runtime's prompt cache" in warned[0]["cache_warning"]
    assert "served from cache**" in (tmp_path / "seeded2" / "report.md").read_text()
