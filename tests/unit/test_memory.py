"""Measuring what a runtime holds: /proc, the GPU tools' outputs, what is learned; the budget keys."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from passerelle.config import budget_share, load_config
from passerelle.errors import ConfigError
from passerelle.runtimes import memory
from passerelle.runtimes.memory import GIB, MemoryBook, Reading, command_key


def vmrss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def child():
    """A Python child holding ~64 MiB, with a grandchild of its own."""
    code = ("import subprocess, sys, time; b = bytearray(64 << 20); "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(p.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())
    yield proc, grandchild
    subprocess.run(["kill", str(grandchild)], check=False)
    proc.kill()
    proc.wait()
    proc.stdout.close()


def test_process_tree_and_rss_match_proc_status(child):
    proc, grandchild = child
    tree = memory.process_tree(proc.pid)
    assert tree[0] == proc.pid and grandchild in tree
    expected = vmrss(proc.pid) + vmrss(grandchild)
    assert memory.rss_bytes(tree) == pytest.approx(expected, rel=0.05)
    reading = memory.measure(proc.pid)
    assert reading.rss_bytes > 64 << 20 and reading.gib("ram") == reading.rss_bytes / GIB


def test_reading_counts_what_the_budget_asks_for():
    r = Reading(rss_bytes=2 * GIB, gpu_bytes=6 * GIB, source="nvidia-smi")
    assert (r.gib("total"), r.gib("ram"), r.gib("gpu")) == (8.0, 2.0, 6.0)


def test_nvidia_smi_compute_apps():
    text = "1234, 5120\n1234, 1024\n999, 300\n[Not Supported]\n"
    assert memory.parse_nvidia_apps(text) == {1234: 6144 << 20, 999: 300 << 20}


def test_drm_fdinfo_amdgpu_old_and_new_keys():
    old = textwrap.dedent("""\
        pos:	0
        drm-driver:	amdgpu
        drm-pdev:	0000:c1:00.0
        drm-client-id:	42
        drm-memory-vram:	1048576 KiB
        drm-memory-gtt:	 2048 KiB
        drm-memory-cpu:	0 KiB
    """)
    assert memory.parse_drm_fdinfo(old) == ("0000:c1:00.0/42", {"vram": 1 << 30, "gtt": 2 << 20})
    new = "drm-pdev:\t0000:03:00.0\ndrm-client-id:\t7\ndrm-total-vram:\t3 GiB\ndrm-memory-vram:\t1 KiB\n"
    assert memory.parse_drm_fdinfo(new) == ("0000:03:00.0/7", {"vram": 3 << 30})


def test_rocm_smi_vram_json():
    text = ('{"card0": {"VRAM Total Memory (B)": "68719476736", "VRAM Total Used Memory (B)": "1073741824"},'
            ' "card1": {"VRAM Total Memory (B)": "1000", "VRAM Total Used Memory (B)": "10"}}')
    assert memory.parse_rocm_vram(text) == (1073741824 + 10, 68719476736 + 1000)
    assert memory.parse_rocm_vram("not json") is None


def test_machine_memory_is_read_from_proc():
    assert memory.system_memory_bytes() > 256 << 20
    assert memory.machine_gib("ram") == pytest.approx(memory.system_memory_bytes() / GIB)
    assert memory.machine_gib("total") >= memory.machine_gib("ram")


def test_memory_book_survives_a_restart_and_is_keyed_by_command(tmp_path):
    path = tmp_path / "state" / "runtime-memory.json"
    key = command_key("chat", ("llama-server", "-m", "a.gguf"))
    MemoryBook(path).learn(key, gib_total=9.5, load_s=12.0)
    assert MemoryBook(path).get(key) == {"gib_total": 9.5, "load_s": 12.0}
    assert command_key("chat", ("llama-server", "-m", "b.gguf")) != key
    assert MemoryBook(tmp_path / "missing.json").get(key) == {}


@pytest.mark.parametrize(("text", "share"), [("90%", 0.9), (" 50 % ", 0.5), ("12.5%", 0.125), ("0%", None),
                                             ("101%", None), ("12", None), ("lots%", None)])
def test_budget_share(text, share):
    assert budget_share(text) == (pytest.approx(share) if share is not None else None)


@pytest.mark.parametrize(("text", "key"), [
    ('[runtimes]\nmax_loaded = "ninety"\n', "runtimes.max_loaded"),
    ('[runtimes]\nmax_loaded = "90%"\nmax_loaded_gib = 12\n', "runtimes.max_loaded"),
    ('[runtimes]\nmemory = "vram"\n', "runtimes.memory"),
    ('[runtimes]\nswap_policy = "lru"\n', "runtimes.swap_policy"),
    ('[runtimes]\nmin_resident_s = -1\n', "runtimes.min_resident_s"),
])
def test_runtimes_errors_name_the_key_and_line(tmp_path, text, key):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert err.value.key == key and err.value.line is not None


def test_runtimes_keys_load(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[runtimes]\nmax_loaded = "90%"\nmin_resident_s = 10\ndrain_timeout_s = 5\n'
                    'swap_policy = "naive"\nmemory = "gpu"\n')
    rt = load_config(path, env={}).runtimes
    assert (rt.max_loaded, rt.min_resident_s, rt.drain_timeout_s, rt.swap_policy, rt.memory) == (
        "90%", 10.0, 5.0, "naive", "gpu")
