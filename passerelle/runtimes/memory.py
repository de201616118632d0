"""What a runtime really holds in memory, and how much the machine has.

A runtime's footprint is the resident memory (RSS) of its process tree, read from ``/proc``, plus
the GPU memory its processes hold, read from the first of these that answers:

* NVIDIA: ``nvidia-smi --query-compute-apps=pid,used_memory`` (per process);
* AMD and other DRM drivers: ``/proc/PID/fdinfo/*`` ``drm-memory-*`` / ``drm-total-*`` keys (per
  process: VRAM and GTT, which on a unified-memory APU such as Strix Halo is system RAM);
* otherwise the device's used memory before the start and after it (``nvidia-smi``,
  ``rocm-smi --showmeminfo vram``, or the amdgpu sysfs ``mem_info_vram_used`` files), which is
  right as long as nothing else loads at the same time: it is taken once per start, under the
  supervisor's start lock, and that GPU share is kept for the run (a later delta would charge
  the runtime every runtime started since).

The measurement replaces the file-size estimate once a runtime has run; :class:`MemoryBook` keeps
what was learned per backend (and its launch command) in the state directory, so that the next
start of passerelle knows it too.

Example::

    reading = measure(pid)                    # Reading(rss_bytes=..., gpu_bytes=..., source="proc")
    reading.gib("total")                      # RSS + GPU, in GiB
    machine_gib("total")                      # what "90%" is a share of
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from passerelle.procfs import process_tree

log = logging.getLogger("passerelle.runtimes.memory")

GIB = 2**30
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_SMI_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Reading:
    """Memory held by one runtime's process tree at one moment."""

    rss_bytes: int = 0
    gpu_bytes: int = 0
    source: str = "proc"  # where the GPU figure came from: proc (none), nvidia-smi, drm-fdinfo, device-delta

    def gib(self, kind: str = "total") -> float:
        """The figure that counts against the budget: ``total`` (RAM + GPU), ``ram`` or ``gpu``."""
        n = {"ram": self.rss_bytes, "gpu": self.gpu_bytes}.get(kind, self.rss_bytes + self.gpu_bytes)
        return n / GIB


# -- processes --------------------------------------------------------------------------------
def rss_bytes(pids: list[int], proc: Path = Path("/proc")) -> int:
    """Resident memory of ``pids``, summed (``statm``'s second field, in pages)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((proc / str(pid) / "statm").read_text().split()[1]) * _PAGE
    return total


# -- GPUs -------------------------------------------------------------------------------------
def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def parse_nvidia_apps(text: str) -> dict[int, int]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` → bytes per pid
    (a process on two GPUs appears twice: summed)."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            with contextlib.suppress(ValueError):
                out[int(parts[0])] = out.get(int(parts[0]), 0) + int(float(parts[1]) * 2**20)
    return out


def nvidia_process_bytes(pids: list[int]) -> int | None:
    text = _run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
    if text is None:
        return None
    per_pid = parse_nvidia_apps(text)
    return sum(per_pid.get(p, 0) for p in pids)


_DRM_KEYS = ("drm-memory-vram", "drm-memory-gtt", "drm-total-vram", "drm-total-gtt", "drm-total-local",
             "drm-total-system", "drm-memory-local", "drm-memory-system")
_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def parse_drm_fdinfo(text: str) -> tuple[str, dict[str, int]]:
    """One ``/proc/PID/fdinfo/FD`` of a DRM device → (client key, bytes by memory region).

    A GPU context opened once may appear under several descriptors: the client key
    (``drm-pdev`` + ``drm-client-id``) lets the caller count it once. ``drm-total-*`` (newer
    kernels) is preferred to the older ``drm-memory-*`` for the same region."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        fields[k.strip()] = v.strip()
    client = f"{fields.get('drm-pdev', '')}/{fields.get('drm-client-id', '')}"
    regions: dict[str, int] = {}
    for key in _DRM_KEYS:
        if key not in fields:
            continue
        region = key.rsplit("-", 1)[1]
        if key.startswith("drm-memory-") and f"drm-total-{region}" in fields:
            continue
        number, _, unit = fields[key].partition(" ")
        with contextlib.suppress(ValueError):
            regions[region] = int(number) * _UNITS.get(unit.strip(), 1)
    return client, regions


def drm_process_bytes(pids: list[int], proc: Path = Path("/proc")) -> int | None:
    """GPU memory of ``pids`` from DRM fdinfo; None when none of them has a DRM client."""
    seen: dict[str, int] = {}
    for pid in pids:
        fdinfo = proc / str(pid) / "fdinfo"
        try:
            entries = list(fdinfo.iterdir())
        except OSError:
            continue
        for entry in entries:
            try:
                text = entry.read_text()
            except OSError:
                continue
            if "drm-client-id" not in text:
                continue
            client, regions = parse_drm_fdinfo(text)
            if regions:
                # "system" memory is counted in RSS already; VRAM, GTT and "local" are not
                seen[client] = sum(v for r, v in regions.items() if r in ("vram", "gtt", "local"))
    return sum(seen.values()) if seen else None


def parse_rocm_vram(text: str) -> tuple[int, int] | None:
    """``rocm-smi --showmeminfo vram --json`` → (used, total) bytes over all cards."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    used = total = 0
    read_used = False  # a card whose use cannot be read is not "nothing used": no figure at all
    for card in data.values() if isinstance(data, dict) else ():
        if not isinstance(card, dict):
            continue
        for k, v in card.items():
            with contextlib.suppress(ValueError, TypeError):
                if "Total Used" in k:
                    used += int(v)
                    read_used = True
                elif "Total Memory" in k:
                    total += int(v)
    return (used, total) if total and read_used else None


def _amdgpu_sysfs(sys_drm: Path = Path("/sys/class/drm")) -> tuple[int, int] | None:
    used = total = 0
    found = False
    for card in sorted(sys_drm.glob("card[0-9]*")):
        dev = card / "device"
        with contextlib.suppress(OSError, ValueError):
            total += int((dev / "mem_info_vram_total").read_text())
            used += int((dev / "mem_info_vram_used").read_text())
            found = True
    return (used, total) if found else None


def gpu_device_memory() -> tuple[int, int] | None:
    """(used, total) bytes of dedicated GPU memory over all devices, or None without a GPU."""
    text = _run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"])
    if text:
        used = total = 0
        readable = True  # a card reporting "[N/A]" makes the sum no figure, not a smaller one
        for line in filter(str.strip, text.splitlines()):
            parts = [p.strip() for p in line.split(",")]
            try:
                used += int(float(parts[0]) * 2**20)
                total += int(float(parts[1]) * 2**20)
            except (ValueError, IndexError):
                readable = False
        if total and readable:
            return used, total
    found = _amdgpu_sysfs()
    if found:
        return found
    text = _run(["rocm-smi", "--showmeminfo", "vram", "--json"])
    return parse_rocm_vram(text) if text else None


def system_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def machine_gib(kind: str = "total") -> float:
    """What a budget like ``max_loaded = "90%"`` is a share of: system RAM (``ram``), the GPUs'
    dedicated memory (``gpu``), or both (``total``; on a unified-memory APU the carve-out shown as
    VRAM is not in MemTotal, so the two add up to the machine)."""
    gpu = gpu_device_memory()
    gpu_total = gpu[1] if gpu else 0
    if kind == "gpu":
        return gpu_total / GIB
    ram = system_memory_bytes()
    return (ram if kind == "ram" else ram + gpu_total) / GIB


def measure(pid: int, *, device_before: int | None = None) -> Reading:
    """The footprint of ``pid``'s process tree now. ``device_before``: the GPUs' used memory taken
    before the runtime started, for the per-device fallback."""
    pids = process_tree(pid)
    rss = rss_bytes(pids)
    gpu = nvidia_process_bytes(pids)
    if gpu:
        return Reading(rss, gpu, "nvidia-smi")
    gpu = drm_process_bytes(pids)
    if gpu:
        return Reading(rss, gpu, "drm-fdinfo")
    if device_before is not None:
        now = gpu_device_memory()
        if now is not None and now[0] > device_before:
            return Reading(rss, now[0] - device_before, "device-delta")
    return Reading(rss, 0, "proc")


def device_used() -> int | None:
    found = gpu_device_memory()
    return found[0] if found else None


# -- what was learned -------------------------------------------------------------------------
def command_key(name: str, command: tuple[str, ...]) -> str:
    """A backend's learned memory is valid for the same name and launch command only."""
    digest = hashlib.blake2b("\0".join(command).encode(), digest_size=8).hexdigest()
    return f"{name}:{digest}"


class MemoryBook:
    """Measured footprints (GiB) and load times (s) by backend, kept in a small JSON file.

    Example::

        book = MemoryBook(state_dir() / "runtime-memory.json")
        book.learn("chat:ab12", gib=9.8, load_s=12.5)
        book.get("chat:ab12")          # {"gib": 9.8, "load_s": 12.5, ...}
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, dict[str, float]] = {}
        if path is not None:
            with contextlib.suppress(OSError, ValueError):
                data = json.loads(path.read_text())
                if isinstance(data, dict):
                    self.entries = {k: v for k, v in data.items() if isinstance(v, dict)}

    def get(self, key: str) -> dict[str, float]:
        return self.entries.get(key, {})

    def learn(self, key: str, **values: float) -> None:
        self.entries.setdefault(key, {}).update(values)
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".partial")
            tmp.write_text(json.dumps(self.entries, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as exc:  # a read-only state dir costs the memory of the next start, no more
            log.warning("cannot save learned runtime memory to %s: %s", self.path, exc)
