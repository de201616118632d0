"""The bench/ scripts' shared harness (bench/harness.py, bench/loadgen.py) and bench/overhead.py's
figures: services that start, answer and stop, the load client's counts against the real fake
runtime and passerelle (real sockets), and what a gateway adds, taken round by round."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import each other by name, as `python bench/X.py` does

import harness  # noqa: E402
import loadgen  # noqa: E402
import overhead  # noqa: E402
import overhead_report  # noqa: E402
import routers  # noqa: E402

from passerelle.bench.stats import percentile  # noqa: E402
from tests.waiting import wait_until  # noqa: E402


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


def test_cpu_of_a_process_counts_all_its_threads(tmp_path):
    # A Rust router's work runs on threads other than its main one: /proc/PID/stat's utime + stime
    # are the whole process's, so a busy second thread shows.
    busy = ("import threading, time\n"
            "def spin():\n"
            "    t = time.thread_time()\n"
            "    while time.thread_time() - t < 0.4: pass\n"
            "th = threading.Thread(target=spin); th.start(); th.join()\n"
            "print('done', flush=True); time.sleep(30)\n")
    svc = harness.spawn("threads", [sys.executable, "-c", busy], tmp_path)
    try:
        wait_until(lambda: "done" in svc.log.read_text(), timeout=30)
        task = Path(f"/proc/{svc.proc.pid}/task/{svc.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        main_thread = (int(task[11]) + int(task[12])) / harness.TICKS
        assert harness.cpu_s(svc.pids) >= 0.35 and main_thread < 0.2
    finally:
        svc.stop(grace_s=2)


def test_a_wave_writes_all_its_requests_at_once(tmp_path):
    def stats() -> dict[str, int]:
        with urllib.request.urlopen(fake.url + "/fake/stats", timeout=10) as resp:
            return dict(json.load(resp))

    fake = harness.start_fake(tmp_path, 20, 1, 4, src=harness.ROOT)
    try:
        before = stats()
        r = loadgen.run_async(loadgen.run_waves(fake.url, 16, 3, 4, timeout=30, gap_s=0.01))
        after = stats()
    finally:
        fake.stop()
    assert not r.errors
    assert len(r.ttft_ms) == len(r.e2e_ms) == r.requests == 3 * 16  # the warm-ups are not measured
    assert len(r.spread_ms) == 3 and max(r.spread_ms) < 50  # each wave's 16 writes, first to last
    assert min(r.ttft_ms) >= 19 and r.tokens_per_s > 0
    # one keep-alive connection per request of a wave, reused by every wave; never more in flight
    assert after["connections"] - before["connections"] == 16 + 1  # and this stats request's
    assert after["peak_in_flight"] == 16 and after["completed"] == 4 * 16


def test_several_urls_share_the_connections_evenly(tmp_path):
    # ``--gateway-processes N``: the load's connections spread over N gateways, as SO_REUSEPORT would, in
    # streams and in waves alike; each request goes out whole to the one its connection is on.
    def stats(fake: harness.Service) -> dict[str, int]:
        with urllib.request.urlopen(fake.url + "/fake/stats", timeout=10) as resp:
            return dict(json.load(resp))

    fakes = [harness.start_fake(tmp_path, 5, 1, 4, src=harness.ROOT, tag=f"fake{i}") for i in range(2)]
    try:
        url = ",".join(f.url for f in fakes)
        r = loadgen.run_async(loadgen.run_load(url, 4, 12, 4, stagger_s=0.01, timeout=30))
        w = loadgen.run_async(loadgen.run_waves(url, 6, 2, 4, timeout=30, gap_s=0.01))
        counts = [stats(f) for f in fakes]
    finally:
        for f in fakes:
            f.stop()
    assert not r.errors and not w.errors and len(w.ttft_ms) == 2 * 6
    # streams: 2 users each, every request answered; waves: 3 connections each, 3 requests a wave
    # (and a warm-up) on each
    # (and the readiness check and this stats request)
    assert [c["connections"] for c in counts] == [2 + 3 + 2, 2 + 3 + 2]
    assert [c["peak_in_flight"] for c in counts] == [3, 3]
    assert sum(c["completed"] for c in counts) == r.requests + w.requests + 6
    assert all(c["completed"] >= 3 * 3 for c in counts)


def test_a_group_of_processes_is_one_target_with_their_urls_and_pids(tmp_path):
    fakes = [harness.start_fake(tmp_path, 0, 1, 2, src=harness.ROOT, tag=f"fake{i}") for i in range(2)]
    try:
        group = overhead.Group(fakes)
        assert group.url == f"{fakes[0].url},{fakes[1].url}"
        assert set(group.pids) == {fakes[0].proc.pid, fakes[1].proc.pid}
    finally:
        for f in fakes:
            f.stop()


def test_the_report_says_what_n_processes_reach():
    def cell(cpu: float, p99: float) -> dict[str, object]:
        return {"cpu_s_per_1k_requests": cpu, "added_ttft_ms": {"p50": 1.0, "p95": 1.0, "p99": p99}}

    results = {"processes": 2, "levels": [{"concurrency": 256, "targets": {
        "passerelle": cell(1.0, 9.0), overhead_report.GROUP: cell(1.1, 3.0), "vllm-router": cell(0.5, 1.0)}}],
        "waves": [{"size": 64, "targets": {overhead_report.GROUP: cell(1.2, 7.5)}}]}
    assert overhead_report.bound(results) == [
        "2 processes (a bound), 256 streams: added TTFT p99 +3.00 ms (goal <= 2), CPU per request 1.10x one "
        "process's, 2.20x vllm-router's (goal <= 1.2)",
        "2 processes (a bound), waves of 64: added TTFT p99 +7.50 ms (goal <= 5)"]
    assert overhead_report.bound({**results, "processes": None}) == []


def test_targets_default_to_passerelle_the_installed_routers_and_litellm(tmp_path):
    stamp = tmp_path / "smg" / ".passerelle-bench-installed"
    stamp.parent.mkdir()
    stamp.write_text(routers.PEERS["smg"].spec + "\n")
    assert overhead.choose_targets("auto", False, tmp_path) == ["passerelle", "smg", "litellm"]
    assert overhead.choose_targets("auto", True, tmp_path) == ["passerelle", "smg"]
    stamp.write_text("smg==0.0.1\n")  # another version: installed on first use, not by default
    assert overhead.choose_targets("auto", True, tmp_path) == ["passerelle"]
    assert overhead.choose_targets("litellm,smg,envoy,passerelle", False, tmp_path) == [
        "passerelle", "envoy", "smg", "litellm"]
    with pytest.raises(SystemExit, match="unknown nginx"):
        overhead.choose_targets("passerelle,nginx", False, tmp_path)


def test_a_peer_that_fails_is_reported_and_the_rest_runs(tmp_path, monkeypatch):
    # Without installing a peer: "relay" is a second fake runtime started as a peer would be;
    # "broken" fails to install, "quitter" exits at start.
    def relay(venv: Path, work: Path, backend_url: str, extra: list[str]) -> harness.Service:
        port = harness.free_port()
        return harness.spawn("relay", [sys.executable, "-m", "passerelle", "fake-backend", "--port", str(port),
                                       "--ttft-ms", "5", "--itl-ms", "1", "--tokens", "4", "--model", harness.MODEL],
                             work, env=harness.source_env(harness.ROOT), url=f"http://127.0.0.1:{port}")

    def quitter(venv: Path, work: Path, backend_url: str, extra: list[str]) -> harness.Service:
        return harness.spawn("quitter", [sys.executable, "-c", "raise SystemExit(3)"], work,
                             url=f"http://127.0.0.1:{harness.free_port()}")

    def install(peer: routers.Peer, root: Path) -> Path:
        if peer.name == "broken":
            raise subprocess.CalledProcessError(1, ["pip", "install", peer.spec])
        venv = tmp_path / "venvs" / peer.name
        (venv / "bin").mkdir(parents=True, exist_ok=True)
        (venv / "bin" / "python").unlink(missing_ok=True)
        (venv / "bin" / "python").symlink_to(sys.executable)
        return venv

    peers = {**routers.PEERS, **{p.name: p for p in (routers.Peer("relay", "pytest", "pytest", relay, "/health", 30),
                                 routers.Peer("broken", "nothing==0", "nothing", relay, "/health"),
                                 routers.Peer("quitter", "pytest", "pytest", quitter, "/health", 30))}}
    monkeypatch.setattr(overhead, "PEERS", peers)
    monkeypatch.setattr(overhead, "install", install)
    out = tmp_path / "out"
    assert overhead.main(["--targets", "relay,broken,quitter", "--concurrency", "4", "--requests-per-level", "8",
                          "--rounds", "1", "--waves", "4", "--wave-count", "2", "--no-ceiling", "--ttft-ms", "5",
                          "--itl-ms", "1", "--tokens", "4", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["targets"] == ["direct", "relay"]
    assert set(results["failed"]) == {"broken", "quitter"} and "quitter exited with 3" in results["failed"]["quitter"]
    relay_version = results["versions"]["relay"]  # pytest's, as the peer's interpreter finds it
    assert relay_version[0].isdigit()
    (level,), (wave,) = results["levels"], results["waves"]
    assert level["targets"]["relay"]["requests_measured"] == 8
    assert level["targets"]["relay"]["cpu_s_per_1k_requests"] is not None  # the peer's process tree, measured
    relay_wave = wave["targets"]["relay"]
    assert relay_wave["requests_measured"] == 2 * 4 and relay_wave["added_ttft_ms"] is not None
    assert relay_wave["write_spread_ms"]["max"] < 50 and relay_wave["cpu_s_per_1k_requests"] is not None
    text = (out / "report.md").read_text()
    assert "| 4 | relay |" in text and "Not measured: broken, could not install" in text
    assert "Synchronized waves" in text and f"relay {relay_version}" in text
