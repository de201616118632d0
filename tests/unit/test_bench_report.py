"""The output directory and the command line: files agree with results.json, compare, scenarios."""

from __future__ import annotations

import csv
import json
import re
import socket
from pathlib import Path

import pytest

from passerelle.bench.tables import cell, run_table
from passerelle.cli import main
from passerelle.testing.fake_runtime import start_fake_backend

DESIGN_RUN_KEYS = {"target", "concurrency", "rate", "requests_ok", "errors", "ttft_ms", "tpot_ms", "itl_ms",
                   "e2e_ms", "output_tokens_per_s", "requests_per_s", "goodput_rps", "token_count_source"}
STAT_KEYS = {"mean", "p50", "p90", "p95", "p99"}


def assert_report_consistent(out: Path) -> dict:
    """Every output file exists, and the CSV, the markdown and the HTML say what results.json says."""
    results = json.loads((out / "results.json").read_text())
    assert set(results) >= {"runs", "verdict"} and results["runs"]
    for run in results["runs"]:
        assert set(run) >= DESIGN_RUN_KEYS
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(run[metric]) == STAT_KEYS
    # results.csv: one row per run, same numbers
    with (out / "results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(results["runs"])
    for row, run in zip(rows, results["runs"], strict=True):
        assert row["target"] == run["target"] and int(row["requests_ok"]) == run["requests_ok"]
        assert int(row["errors"]) == run["errors"]
        for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
            for stat in STAT_KEYS:
                value = run[metric][stat]
                assert (row[f"{metric}_{stat}"] == "") if value is None else float(row[f"{metric}_{stat}"]) == value
        assert float(row["output_tokens_per_s"]) == run["output_tokens_per_s"]
    # report.md: each target's table holds exactly the results.json rows, formatted
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    for target in dict.fromkeys(r["target"] for r in results["runs"]):
        runs = [r for r in results["runs"] if r["target"] == target]
        head, table = run_table(runs)
        section = md.split("## Results\n", 1)[1].split(f"### {target}\n", 1)[1]
        lines = [ln for ln in section.splitlines() if ln.startswith("|")]
        assert lines[0] == "| " + " | ".join(head) + " |"
        md_rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:2 + len(runs)]]
        assert md_rows == table
        for run in runs:  # spot-check against the raw numbers, not only the shared formatter
            assert f"{run['ttft_ms']['p50']:.1f}" in " ".join(c for row in md_rows for c in row)
            assert cell(run, "ttft_ms.p95") in html
    assert results["verdict"]["reason"] in md
    # plots: real PNGs, referenced by the markdown, inlined in the HTML (self-contained)
    pngs = sorted(out.glob("*.png"))
    assert {p.name for p in pngs} >= {"latency_cdf.png", "summary.png"} and len(pngs) == 5
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert f"]({png.name})" in md
    assert html.count("src='data:image/png;base64,") == 5
    # the summary figure opens the report, before the verdict
    assert md.index("](summary.png)") < md.index("## Verdict")
    assert html.index("alt='summary'") < html.index("<h2>Verdict</h2>")
    assert not re.search(r"""(src|href)=['"]?https?:""", html)
    return results


def bench(argv: list[str]) -> int:
    return main(["bench", *argv])


def test_single_target_sweep_writes_consistent_outputs(tmp_path):
    with start_fake_backend(ttft_ms=5, itl_ms=1, model="fake-a") as fake:
        assert bench(["--url", fake.url + "/v1/", "--concurrency", "1,3", "--requests", "6", "--max-tokens", "5",
                      "--slo", "ttft_p95=1s,tpot_p95=200ms", "--out", str(tmp_path)]) == 0
        name = fake.url.removeprefix("http://")  # the default name: HOST:PORT
        seen = fake.stats()
    # 4 calibration probes, 1 warm-up per level and 6 measured per level: no prompt ever repeats (a
    # runtime's prefix cache would serve the second level from the first)
    assert seen["requests"] == 4 + 2 * (1 + 6) and seen["distinct_prompts"] == seen["requests"]
    results = assert_report_consistent(tmp_path)
    assert [r["concurrency"] for r in results["runs"]] == [1, 3]
    assert all(r["requests_ok"] == 6 and r["meets_slo"] for r in results["runs"])
    # one target is measured, not a winner
    assert results["verdict"]["winner"] is None and results["verdict"]["targets"][name]["max_concurrency"] == 3
    assert results["targets"][0]["model"] == "fake-a"  # the first id of /v1/models
    assert "passerelle-fake-backend" in results["targets"][0]["version"]["build_info"]
    assert results["machine"]["cores"] >= 1 and results["machine"]["cpu"]
    assert results["command"].startswith("passerelle bench --url")
    with (tmp_path / "requests.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 12
    md = (tmp_path / "report.md").read_text()
    assert "## Machine" in md and "fake-a" in md and "ttft_p95 ≤ 1000 ms" in md


def test_compare_names_the_winner_and_flags_different_models(tmp_path):
    with (start_fake_backend(ttft_ms=5, itl_ms=1, model="model-q4") as fast,
          start_fake_backend(ttft_ms=150, itl_ms=1, model="model-q8") as slow):
        rc = main(["bench", "compare", "--target", f"fast={fast.url}", "--target", f"slow={slow.url}/v1",
                   "--concurrency", "1,2", "--requests", "4", "--max-tokens", "3", "--slo", "ttft_p95=100ms",
                   "--out", str(tmp_path)])
    assert rc == 0
    results = assert_report_consistent(tmp_path)
    v = results["verdict"]
    assert v["winner"] == "fast"
    assert v["targets"]["fast"]["max_concurrency"] == 2
    assert v["targets"]["slow"]["max_concurrency"] is None and v["targets"]["slow"]["loads_meeting_slo"] == []
    assert v["model_ids_differ"] is True and v["models"] == {"fast": "model-q4", "slow": "model-q8"}
    assert {r["target"] for r in results["runs"]} == {"fast", "slow"}
    md = (tmp_path / "report.md").read_text()
    assert "Model ids differ between targets" in md and "fast (winner)" in md
    assert all(r["slo_failures"] == ["ttft_p95"] for r in results["runs"] if r["target"] == "slow")


def test_compare_through_two_routes_to_one_backend_never_repeats_a_prompt(tmp_path, capsys):
    """E.g. a runtime directly and through the gateway: the second target must not hit the cache."""
    with start_fake_backend(ttft_ms=2, itl_ms=1) as fake:
        assert main(["bench", "compare", "--target", f"direct={fake.url}", "--target", f"again={fake.url}/v1",
                     "--concurrency", "2", "--requests", "4", "--max-tokens", "2", "--out", str(tmp_path)]) == 0
        seen = fake.stats()
    # the targets took turns: A B, then B A
    ends = [line.split()[0] for line in capsys.readouterr().err.splitlines()
            if " concurrency 2: " in line and not line.startswith("warning:")]
    assert ends == ["direct", "again", "again", "direct"]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["load"]["rounds"] == 2 and [r["requests_ok"] for r in results["runs"]] == [4, 4]
    # per target: 4 calibration probes, then the level in 2 rounds (taking turns), 1 warm-up + 2 requests each
    assert seen["requests"] == 2 * (4 + 2 * (1 + 2))
    # only the calibration probes repeat (the same passages, to measure the same tokenizer)
    assert seen["distinct_prompts"] == seen["requests"] - 4


def test_compare_keeps_going_when_a_target_is_down(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connection refused
        with start_fake_backend(ttft_ms=2, itl_ms=1) as fake:
            rc = main(["bench", "compare", "--target", f"up={fake.url}", "--target", f"down={dead}",
                       "--requests", "2", "--max-tokens", "2", "--out", str(tmp_path)])
    assert rc == 1  # something was not measured
    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["target"] for r in results["runs"]} == {"up"}
    assert any("down: not measured" in n and "did not answer" in n for n in results["notes"])


def test_scenario_reports_each_class(tmp_path):
    scenario = tmp_path / "mix.toml"
    scenario.write_text("""
requests = 6
[defaults]
max_tokens = 3
prompt_tokens = 32
[[class]]
name = "interactive"
priority = "interactive"
concurrency = 2
turns = 2
[[class]]
name = "batch"
priority = "batch"
rate = 50
""")
    with start_fake_backend(ttft_ms=3, itl_ms=1) as fake:
        assert bench(["--url", fake.url, "--scenario", str(scenario), "--out", str(tmp_path / "out")]) == 0
    results = assert_report_consistent(tmp_path / "out")
    by_class = {r["class"]: r for r in results["runs"]}
    assert set(by_class) == {"interactive", "batch", "all"}
    assert by_class["interactive"]["requests_ok"] == 6 and by_class["interactive"]["concurrency"] == 2
    assert by_class["batch"]["requests_ok"] == 6 and by_class["batch"]["rate"] == 50
    assert by_class["all"]["requests_ok"] == 12
    # the second turn of each chat carries the first turn's history
    assert by_class["interactive"]["prompt_tokens_mean"] > by_class["batch"]["prompt_tokens_mean"]
    assert (tmp_path / "out" / "ttft_vs_class.png").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--out", "x"], "--url is required"),
    (["bench", "--url", "http://127.0.0.1:1"], "--out DIR is required"),
    (["bench", "--url", "http://127.0.0.1:1", "--slo", "ttft=1s", "--out", "x"], "SLO"),
    (["bench", "--url", "ftp://h", "--out", "x"], "not an http(s) URL"),
    (["bench", "compare", "--out", "x"], "at least one --target"),
    (["bench", "compare", "--target", "a=http://h", "--target", "a=http://i", "--out", "x"], "must differ"),
])
def test_usage_errors(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_fails_cleanly(tmp_path, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        assert bench(["--url", url, "--out", str(tmp_path)]) == 1
    assert "did not answer" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
