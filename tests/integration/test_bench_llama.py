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
    assert results["verdict"]["winner"] == "llama-server"
