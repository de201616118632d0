"""Memory per target: a real child process found from its port, its tree, its resident memory
sampled while it grows; GPU readers on recorded tool output and sysfs/fdinfo files; runtime metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from passerelle import procfs
from passerelle.bench import memory
from passerelle.bench.monitor import Monitor, _counter_delta, parse_metrics, runtime_report, vllm_cache_config
from passerelle.testing.fake_runtime import start_fake_backend
from tests.conftest import wait_until

MiB = 2**20
CHILD = textwrap.dedent("""
    import socket, subprocess, sys
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    # a grandchild, as a gateway has its runtime or vLLM its engine process
    kid = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    print(s.getsockname()[1], kid.pid, flush=True)
    held = []
    for line in sys.stdin:
        if line.strip() == "grow":
            held.append(bytearray(b"\\x01") * (96 << 20))  # written, so resident
            print("grown", flush=True)
    kid.stdin.close()
    kid.wait()
""")


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port, kid = map(int, proc.stdout.readline().split())
        yield proc, port, kid
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()


def test_a_real_child_is_found_from_its_port_with_its_tree(child):
    proc, port, kid = child
    assert memory.listening_pid("127.0.0.1", port) == proc.pid
    assert memory.listening_pid("localhost", port) == proc.pid
    assert memory.listening_pid("192.0.2.1", port) is None  # not an address of this machine
    assert procfs.process_tree(proc.pid) == [proc.pid, kid]
    info = memory.describe_process(proc.pid)
    assert info["pid"] == proc.pid and info["name"].startswith("python")
    rss, pss = memory.tree_memory([proc.pid, kid])
    alone, _ = memory.process_memory(proc.pid)
    assert rss > alone > 1 * MiB and pss is not None and 0 < pss <= rss


def test_the_monitor_sees_the_peak_of_a_growing_process(child):
    proc, _, _ = child
    mon = Monitor(proc.pid, None, {}, period=0.05)
    mon.start()
    try:
        mon.mark("start", 0)
        proc.stdin.write("grow\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "grown"
        wait_until(lambda: any((s.get("rss") or 0) > mon.samples[0]["rss"] + 90 * MiB for s in mon.samples), 10,
                   what="a sample after the allocation")
        mon.mark("end", 0)
    finally:
        mon.stop()
    rest, peak = mon.at_rest(), mon.window(0)
    assert rest["processes"] == 2 and peak["samples"] >= 2
    assert peak["rss_peak_bytes"] - rest["rss_bytes"] >= 90 * MiB
    assert peak["pss_peak_bytes"] - rest["pss_bytes"] >= 90 * MiB
    assert mon.window(1) == {}  # a level never marked


def test_bench_reports_the_fake_runtime_s_memory(tmp_path):
    from passerelle.cli import main

    with start_fake_backend(ttft_ms=2, itl_ms=1) as fake:
        assert main(["bench", "--url", fake.url, "--requests", "4", "--max-tokens", "2", "--no-calibrate",
                     "--out", str(tmp_path)]) == 0
        pid = fake.process.pid
    results = json.loads((tmp_path / "results.json").read_text())
    mem = results["targets"][0]["memory"]
    assert mem["process"]["pid"] == pid and mem["found"].startswith("listening on port")
    assert mem["at_rest"]["rss_bytes"] > 5 * MiB
    run = results["runs"][0]
    assert run["memory"]["rss_peak_bytes"] >= mem["at_rest"]["rss_bytes"] * 0.5
    assert "MiB resident (PSS, peak)" in results["verdict"]["reason"]
    md = (tmp_path / "report.md").read_text()
    assert f"pid {pid}, listening on port" in md and "| RSS peak | PSS peak |" in md


def test_no_memory_and_a_given_pid(tmp_path, child):
    from passerelle.cli import main

    proc, _, _ = child
    with start_fake_backend(ttft_ms=2, itl_ms=1) as fake:
        assert main(["bench", "compare", "--target", f"off={fake.url}", "--requests", "2", "--max-tokens", "2",
                     "--no-calibrate", "--no-memory", "--out", str(tmp_path / "off")]) == 0
        assert main(["bench", "compare", "--target", f"given={fake.url},pid={proc.pid}", "--requests", "2",
                     "--max-tokens", "2", "--no-calibrate", "--out", str(tmp_path / "given")]) == 0
    off = json.loads((tmp_path / "off" / "results.json").read_text())
    assert off["targets"][0]["memory"]["found"] == "not measured (--no-memory)" and off["runs"][0]["memory"] is None
    given = json.loads((tmp_path / "given" / "results.json").read_text())
    assert given["targets"][0]["memory"]["process"]["pid"] == proc.pid
    assert given["targets"][0]["memory"]["found"] == "given (pid=)"


# --- GPU readers, on recorded output -------------------------------------------------------------
def test_nvidia_smi_output():
    gpus = memory.parse_nvidia_gpus("0, NVIDIA H200, 81234, 143771\n1, NVIDIA RTX 4090, 10, 24564\n")
    assert gpus[0] == {"index": 0, "name": "NVIDIA H200", "used_bytes": 81234 * MiB, "total_bytes": 143771 * MiB}
    assert gpus[1]["name"] == "NVIDIA RTX 4090"
    apps = memory.parse_nvidia_apps("4242, 70000\n4243, [N/A]\n4242, 1000\n")
    assert apps == {4242: 71000 * MiB}


def test_amdgpu_sysfs_and_rocm_smi(tmp_path: Path):
    dev = tmp_path / "sys/class/drm/card1/device"
    dev.mkdir(parents=True)
    for key, value in {"vram_used": 512 * MiB, "vram_total": 512 * MiB, "gtt_used": 30 * 2**30,
                       "gtt_total": 96 * 2**30}.items():
        (dev / f"mem_info_{key}").write_text(f"{value}\n")
    (tmp_path / "sys/class/drm/card1-DP-1").mkdir()  # a connector, not a card
    assert memory.amdgpu_sysfs(tmp_path) == [{"card": "card1", "vram_used_bytes": 512 * MiB,
                                              "vram_total_bytes": 512 * MiB, "gtt_used_bytes": 30 * 2**30,
                                              "gtt_total_bytes": 96 * 2**30}]
    text = json.dumps({"card0": {"VRAM Total Memory (B)": "536870912", "VRAM Total Used Memory (B)": "100",
                                 "GTT Total Memory (B)": "1000", "GTT Total Used Memory (B)": "900"}})
    assert memory.parse_rocm_smi(text) == [{"card": "card0", "vram_total_bytes": 536870912, "vram_used_bytes": 100,
                                            "gtt_total_bytes": 1000, "gtt_used_bytes": 900}]
    assert memory.parse_rocm_smi("not json") == []


def test_drm_fdinfo_counts_each_client_once(tmp_path: Path):
    proc = tmp_path / "proc"
    for pid, fds in {10: {"3": ("/dev/dri/renderD128", 7), "4": ("/dev/dri/renderD128", 7), "5": ("/tmp/x", 0)},
                     11: {"3": ("/dev/dri/renderD128", 8)}}.items():
        (proc / str(pid) / "fd").mkdir(parents=True)
        (proc / str(pid) / "fdinfo").mkdir()
        for fd, (target, client) in fds.items():
            os.symlink(target, proc / str(pid) / "fd" / fd)
            (proc / str(pid) / "fdinfo" / fd).write_text(
                f"pos:\t0\ndrm-driver:\tamdgpu\ndrm-pdev:\t0000:c3:00.0\ndrm-client-id:\t{client}\n"
                "drm-memory-vram:\t1024 KiB\ndrm-memory-gtt:\t2 GiB\ndrm-resident-gtt:\t1 GiB\n")
    # client 7 (two fds) once, client 8 once; drm-resident-gtt preferred to drm-memory-gtt
    assert memory.drm_fdinfo([10, 11], proc) == {"vram": 2 * 1024 * 1024, "gtt": 2 * 2**30}


# --- what runtimes report ------------------------------------------------------------------------
VLLM_METRICS = """# HELP vllm:kv_cache_usage_perc KV-cache usage.
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="2048"} 1.0
vllm:num_requests_running{model_name="m"} 3.0
"""
VLLM_032 = """vllm:cache_config_info{block_size="128",kv_cache_memory_bytes="1073741824",\
kv_cache_size_tokens="1048576",num_gpu_blocks="8192",engine="0"} 1.0
vllm:num_requests_running{model_name="m"} 3.0
"""


def test_runtime_metrics():
    m = parse_metrics(VLLM_METRICS)
    assert m == {"vllm:kv_cache_usage_perc": 0.5, "vllm:prefix_cache_queries_total": 1000.0,
                 "vllm:prefix_cache_hits_total": 640.0}
    assert vllm_cache_config(VLLM_METRICS) == {"num_gpu_blocks": "2048", "block_size": "16", "cache_dtype": "auto",
                                               "enable_prefix_caching": "True", "kv_capacity_tokens": 32768}
    assert vllm_cache_config(VLLM_032) == {"num_gpu_blocks": "8192", "block_size": "128",
                                           "kv_capacity_tokens": 1048576, "kv_cache_bytes": 2**30}
    before = {"vllm:prefix_cache_queries_total": 1000.0, "vllm:prefix_cache_hits_total": 640.0}
    after = {"vllm:prefix_cache_queries_total": 3000.0, "vllm:prefix_cache_hits_total": 740.0}
    assert _counter_delta(before, after)["hit_fraction"] == 0.05
    llama = _counter_delta({"llamacpp:prompt_tokens_total": 90, "llamacpp:prompt_tokens_cached_total": 37},
                           {"llamacpp:prompt_tokens_total": 190, "llamacpp:prompt_tokens_cached_total": 337})
    assert llama["cached_tokens"] == 300 and llama["prompt_tokens"] == 400 and llama["hit_fraction"] == 0.75


def test_runtime_report_reads_slots_where_offered():
    with start_fake_backend(ttft_ms=2, itl_ms=1, slots=3) as fake:
        assert runtime_report(fake.url, {}) == {"slots": 3}
