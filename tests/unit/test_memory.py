"""Measuring what a runtime holds: /proc, the GPU tools' outputs, what is learned; the budget keys."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import pytest

from passerelle import procfs
from passerelle.config import BackendConfig, RuntimesConfig, TimeoutConfig, budget_share, load_config
from passerelle.errors import ConfigError
from passerelle.runtimes import memory
from passerelle.runtimes.factory import build_runtime
from passerelle.runtimes.memory import GIB, MemoryBook, Reading, command_key
from passerelle.runtimes.supervisor import Supervisor


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
    tree = procfs.process_tree(proc.pid)
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


ROCM_SMI = """#!/bin/sh
# A stand-in for rocm-smi: one 64 GiB card whose used VRAM is what the test wrote to $ROCM_USED_FILE.
[ "$*" = "--showmeminfo vram --json" ] || exit 2
printf '{"card0": {"VRAM Total Memory (B)": "68719476736", "VRAM Total Used Memory (B)": "%s"}}\\n' \\
  "$(cat "$ROCM_USED_FILE")"
"""


def test_a_device_without_per_process_figures_is_measured_by_its_use_before_and_after(child, tmp_path, monkeypatch):
    """The rocm-smi path end to end: the tool found on PATH and run (a script here, answering what
    the real one answers), an nvidia-smi that fails passed over, the runtime's share taken as the
    device's use after its start less the use before."""
    proc, _ = child
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (tools / "rocm-smi").write_text(ROCM_SMI)
    for tool in tools.iterdir():
        tool.chmod(0o755)
    used = tmp_path / "used"
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    monkeypatch.setenv("ROCM_USED_FILE", str(used))
    # (an amdgpu card's sysfs files, where this runs on one, would answer before rocm-smi)
    monkeypatch.setattr(memory, "_amdgpu_sysfs", functools.partial(memory._amdgpu_sysfs, tmp_path / "no-drm"))
    used.write_text(str(1 << 30))
    before = memory.device_used()
    assert before == 1 << 30 and memory.machine_gib("gpu") == 64.0
    used.write_text(str(7 << 29))  # the runtime loaded: 3.5 GiB used
    reading = memory.measure(proc.pid, device_before=before)
    assert (reading.source, reading.gpu_bytes) == ("device-delta", 5 << 29)
    assert reading.rss_bytes > 64 << 20 and reading.gib() == pytest.approx((reading.rss_bytes + (5 << 29)) / GIB)
    assert memory.measure(proc.pid).source == "proc"  # no figure from before the start: no GPU share
    used.write_text("garbage")  # a figure that cannot be read is none, not "nothing used"
    assert memory.device_used() is None


def test_a_card_whose_use_nvidia_smi_cannot_read_gives_no_device_figure(tmp_path, monkeypatch):
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text("#!/bin/sh\nprintf '1024, 81559\\n[N/A], 81559\\n'\n")
    (tools / "rocm-smi").write_text("#!/bin/sh\nexit 1\n")
    for tool in tools.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    monkeypatch.setattr(memory, "_amdgpu_sysfs", functools.partial(memory._amdgpu_sysfs, tmp_path / "no-drm"))
    assert memory.device_used() is None and memory.machine_gib("gpu") == 0.0
    (tools / "nvidia-smi").write_text("#!/bin/sh\nprintf '1024, 81559\\n2048, 81559\\n'\n")
    assert memory.device_used() == 3072 << 20 and memory.machine_gib("gpu") == pytest.approx(2 * 81559 / 1024)


def test_amdgpu_sysfs_sums_the_cards(tmp_path):
    for card, total, use in (("card0", 96 << 30, 10 << 30), ("card1", 16 << 30, 1 << 30)):
        dev = tmp_path / card / "device"
        dev.mkdir(parents=True)
        (dev / "mem_info_vram_total").write_text(f"{total}\n")
        (dev / "mem_info_vram_used").write_text(f"{use}\n")
    (tmp_path / "card0-DP-1").mkdir()  # a connector: no memory files
    assert memory._amdgpu_sysfs(tmp_path) == (11 << 30, 112 << 30)
    assert memory._amdgpu_sysfs(tmp_path / "none") is None


def test_drm_fdinfo_counts_each_gpu_client_once_and_not_system_memory(tmp_path):
    def fdinfo(pid: int, fd: int, text: str) -> None:
        d = tmp_path / str(pid) / "fdinfo"
        d.mkdir(parents=True, exist_ok=True)
        (d / str(fd)).write_text(text)

    client = "drm-driver:\tamdgpu\ndrm-pdev:\t0000:c1:00.0\ndrm-client-id:\t{}\n"
    # the same context under two descriptors, counted once: VRAM and GTT
    for fd in (5, 6):
        fdinfo(100, fd, client.format(7) + "drm-memory-vram:\t1048576 KiB\ndrm-memory-gtt:\t524288 KiB\n")
    fdinfo(100, 0, "pos:\t0\nflags:\t02\n")  # not a DRM file
    # a worker with a context of its own: "local" counts, "system" is in its RSS already
    fdinfo(101, 9, client.format(8) + "drm-total-local:\t256 MiB\ndrm-total-system:\t4 GiB\n")
    assert memory.drm_process_bytes([100, 101], proc=tmp_path) == (3 << 29) + (256 << 20)
    assert memory.drm_process_bytes([102], proc=tmp_path) is None


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


async def test_a_device_delta_is_taken_once_per_runtime_and_never_charges_it_another(tmp_path, monkeypatch):
    """The regression: a runtime measured by the device's use before and after its start was measured
    again later the same way, with a second runtime loaded since: charged both, and the inflated
    figure saved to runtime-memory.json."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (tools / "rocm-smi").write_text(ROCM_SMI)
    for tool in tools.iterdir():
        tool.chmod(0o755)
    used = tmp_path / "used"
    used.write_text(str(1 << 30))  # something else holds 1 GiB of the card
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    monkeypatch.setenv("ROCM_USED_FILE", str(used))
    monkeypatch.setattr(memory, "_amdgpu_sysfs", functools.partial(memory._amdgpu_sysfs, tmp_path / "no-drm"))
    fake = (sys.executable, "-m", "passerelle", "fake-backend", "--port", "{port}", "--ttft-ms", "1", "--itl-ms", "1")
    procs = []
    for name, gpu in (("a", 2 << 30), ("b", 3 << 30)):
        bc = BackendConfig(name=name, kind="openai", launch=fake, models=("fake-model",),
                           log_file=str(tmp_path / f"{name}.log"), ready_timeout_s=60)
        _, proc = build_runtime(bc, TimeoutConfig())
        assert proc is not None
        real_start = proc.start

        async def start(real_start=real_start, gpu=gpu) -> None:  # the runtime loads its weights on the card
            await real_start()
            used.write_text(str(int(used.read_text()) + gpu))

        monkeypatch.setattr(proc, "start", start)
        procs.append(proc)
    book_path = tmp_path / "runtime-memory.json"
    sup = Supervisor(procs, RuntimesConfig(), book=MemoryBook(book_path))
    a, b = procs
    try:
        await sup.start("a")
        await sup.start("b")
        for _ in range(2):  # the periodic re-reading, with both loaded
            await sup.measure(a)
            await sup.measure(b)
        assert (a.reading.source, a.reading.gpu_bytes) == ("device-delta", 2 << 30)
        assert (b.reading.source, b.reading.gpu_bytes) == ("device-delta", 3 << 30)
        saved = MemoryBook(book_path)
        assert saved.get(sup.key(a))["gib_gpu"] == 2.0 and saved.get(sup.key(b))["gib_gpu"] == 3.0
        assert a.reading.rss_bytes > 0  # RAM is still read each time
    finally:
        for p in procs:
            await p.stop()
            await p.backend.close()
