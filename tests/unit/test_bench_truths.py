"""What the benchmark says must be true: errors count against a load (an error budget, 429s
included), a refused key is named, the progress line and the report agree, one target wins
nothing, a p95 of few requests is flagged, and a passerelle target's version is its version."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from passerelle.bench.report import _version
from passerelle.bench.target import Target, discover, server_kind
from passerelle.cli import main
from passerelle.testing.fake_runtime import start_fake_backend

FAST = ("--max-tokens", "4", "--prompt-tokens", "16", "--no-calibrate", "--no-progress")


def bench(out: Path, url: str, *args: str, rc: int = 0) -> dict:
    assert main(["bench", "--url", url, "--name", "fake", "--out", str(out), *FAST, *args]) == rc
    return json.loads((out / "results.json").read_text())


def test_a_runtime_failing_80_percent_of_requests_never_holds(tmp_path, capsys):
    with start_fake_backend(ttft_ms=5, itl_ms=1, fail_rate=0.8, seed=7) as fake:
        # (no warm-up: a target whose every warm-up request fails is not measured at all)
        results = bench(tmp_path / "a", fake.url, "--concurrency", "1,2,4", "--requests", "20", "--warmup", "0")
        said = capsys.readouterr().out
        lenient = bench(tmp_path / "b", fake.url, "--concurrency", "1", "--requests", "20", "--warmup", "0",
                        "--error-budget", "95%")
    runs, v = results["runs"], results["verdict"]
    assert [r["concurrency"] for r in runs] == [1, 2, 4]
    assert all(r["errors"] >= 10 and not r["meets_slo"] and "error_rate" in r["slo_failures"] for r in runs)
    t = v["targets"]["fake"]
    assert t["max_concurrency"] is None and t["loads_meeting_slo"] == []
    assert "holds" not in v["reason"] and "error rate" in v["reason"] and "error_rate ≤ 1 %" in v["reason"]
    assert re.search(r"error rate [6-9]\d%", t["summary"])
    assert "holds" not in (tmp_path / "a" / "report.md").read_text().split("## Verdict")[1].split("##")[0]
    assert "holds" not in said and "fake fails at the lowest load tried" in said
    # the budget is the user's to set: at 95 % the same runtime holds its load
    assert lenient["verdict"]["targets"]["fake"]["max_concurrency"] == 1
    assert {"key": "error_rate", "threshold": 0.95, "unit": "fraction"} in lenient["verdict"]["slo"]


def test_find_max_stops_at_the_first_level_over_the_error_budget_even_with_fast_429s(tmp_path):
    # a gateway shedding half its requests at once with 429: the answers it does give are fast,
    # so only the error budget stops the climb
    with start_fake_backend(ttft_ms=5, itl_ms=1, fail_rate=0.5, fail_status=429, seed=3) as fake:
        results = bench(tmp_path, fake.url, "--find-max", "--slo", "ttft_p95=5s", "--requests", "20", "--warmup", "0")
    runs = results["runs"]
    assert [r["concurrency"] for r in runs] == [1]
    assert set(runs[0]["errors_by_kind"]) == {"http_429"} and runs[0]["slo_failures"] == ["error_rate"]
    t = results["verdict"]["targets"]["fake"]
    assert t["max_concurrency"] is None and t["fails_on"] == ["error_rate"]


def test_an_error_budget_and_an_error_rate_slo_that_disagree_are_a_usage_error(tmp_path, capsys):
    assert main(["bench", "--url", "http://127.0.0.1:1", "--out", str(tmp_path), "--slo", "error_rate=1%",
                 "--error-budget", "5%"]) == 2
    assert "--error-budget and error_rate" in capsys.readouterr().err


class _Locked(BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"error": {"message": "a key is required", "type": "invalid_request_error"}}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_401_asks_for_an_api_key_instead_of_asking_whether_the_server_runs(tmp_path, capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Locked)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert main(["bench", "--url", url, "--out", str(tmp_path), *FAST]) == 1
        err = capsys.readouterr().err
        assert "401: pass --api-key" in err and "is the server running" not in err
        assert main(["bench", "--url", url, "--out", str(tmp_path), "--api-key", "wrong", *FAST]) == 1
        assert "401: the key given was refused" in capsys.readouterr().err
    finally:
        server.shutdown()
        server.server_close()
    assert main(["bench", "--url", url, "--out", str(tmp_path), *FAST]) == 1  # nobody there now
    assert "did not answer (is the server running?)" in capsys.readouterr().err


def _report_row(report: str, target: str, concurrency: int) -> dict[str, str]:
    section = report.split("## Results\n")[1].split(f"### {target}\n")[1]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == str(concurrency):
            return dict(zip(head, cells, strict=True))
    raise AssertionError(f"no row for concurrency {concurrency}")


def test_one_target_is_no_winner_and_its_progress_lines_match_its_report(tmp_path, capsys):
    with start_fake_backend(ttft_ms=20, itl_ms=5) as fake:
        results = bench(tmp_path, fake.url, "--concurrency", "1,3", "--max-tokens", "8")
    captured = capsys.readouterr()
    v = results["verdict"]
    assert v["winner"] is None and "winner" not in v["reason"] and v["reason"].startswith("fake holds ≥ 3")
    report = (tmp_path / "report.md").read_text()
    assert "(winner)" not in report
    for conc in (1, 3):
        line = next(x for x in captured.err.splitlines() if x.startswith(f"fake concurrency {conc}: "))
        row = _report_row(report, "fake", conc)
        p50, tok = re.search(r"TTFT p50 ([\d.]+) ms, ([\d.]+) output tok/s", line).groups()
        assert (p50, tok) == (row["TTFT p50"], row["out tok/s"])
        assert line.startswith(f"fake concurrency {conc}: {row['ok']} ok, {row['errors']} errors, ")


def test_a_p95_of_fewer_than_20_requests_is_flagged(tmp_path, capsys):
    with start_fake_backend(ttft_ms=5, itl_ms=1) as fake:
        few = bench(tmp_path / "few", fake.url, "--requests", "8")
        enough = bench(tmp_path / "enough", fake.url)  # the default: 20 requests a level
    err = capsys.readouterr().err
    run = few["runs"][0]
    assert run["tail_warning"] and "rest on 8 requests, fewer than 20" in run["tail_warning"]
    assert "rest on 8 requests" in err
    report = (tmp_path / "few" / "report.md").read_text()
    row = _report_row(report, "fake", 1)
    assert row["TTFT p95"].endswith("*") and row["E2E p95"].endswith("*") and not row["TTFT p50"].endswith("*")
    assert "rest on 8 requests" in report and "marked * rests on fewer than 20 requests" in report
    assert enough["runs"][0]["requests_ok"] == 20 and enough["runs"][0]["tail_warning"] is None
    assert not _report_row((tmp_path / "enough" / "report.md").read_text(), "fake", 1)["TTFT p95"].endswith("*")


async def test_a_passerelle_target_reports_its_version_not_who_owns_its_models():
    async def models(_req: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "passerelle"}]})

    async def health(_req: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "server": "passerelle", "version": "0.1.0"})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        async with aiohttp.ClientSession() as session:
            target = await asyncio.wait_for(discover(session, Target("gw", url)), 10)
    finally:
        await runner.cleanup()
    assert target.version["passerelle"] == "0.1.0" and server_kind(target) == "passerelle"
    shown = _version(target.describe())
    assert shown == "passerelle 0.1.0" and "owned_by" not in shown
    assert _version({"version": {"owned_by": "acme"}}) == "not reported (models owned by acme)"


@pytest.mark.parametrize("status", [429, 503])
def test_the_fake_fails_with_the_status_asked_for(status):
    import httpx

    with start_fake_backend(fail_rate=1.0, fail_status=status) as fake:
        r = httpx.post(fake.url + "/v1/chat/completions",
                       json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == status and "injected failure" in r.json()["error"]["message"]


def test_a_compare_names_its_rounds_in_the_progress_lines(tmp_path, capsys):
    with start_fake_backend(ttft_ms=5, itl_ms=1) as fake:
        assert main(["bench", "compare", "--target", f"a={fake.url}", "--target", f"b={fake.url}/v1",
                     "--concurrency", "2", "--requests", "20", "--out", str(tmp_path), *FAST]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if " concurrency 2: " in x and not x.startswith("warn")]
    assert len(lines) == 4 and all(x.endswith("of 2; the report pools the rounds)") for x in lines)
    results = json.loads((tmp_path / "results.json").read_text())
    v = results["verdict"]
    assert v["winner"] in ("a", "b") or sorted(v["tie"]) == ["a", "b"]  # two targets: compared
