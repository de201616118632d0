"""The memory a runtime holds: its processes, their resident memory, and GPU memory.

Which processes: the one listening on the target's port when the target runs on this machine
(its socket's inode in ``/proc/net/tcp`` or ``tcp6``, then the process holding that inode among
``/proc/*/fd``), or a PID given on the command line; then its whole tree of descendants, so a
gateway that launched its runtime, or vLLM's API server with its engine process, count as one::

    pid = listening_pid("127.0.0.1", 8080)       # None when not found (another host, no permission)
    pids = procfs.process_tree(pid)              # [pid, child, grandchild, ...]
    rss, pss = tree_memory(pids)                 # bytes; PSS None where smaps_rollup is unreadable

RSS counts every resident page of each process, so pages shared between processes of the tree
(libraries, a forked engine's copy-on-write memory) count once per process; PSS (from
``/proc/PID/smaps_rollup``) divides each shared page between its users, so the tree's sum is what
it costs the machine. Both are reported.

GPU memory, where a GPU is present: NVIDIA through ``nvidia-smi`` (the device's used memory, and
the tree's own from ``--query-compute-apps``); AMD through the amdgpu sysfs files
(``/sys/class/drm/card*/device/mem_info_vram_used`` and ``mem_info_gtt_used``: GTT is where a
unified-memory APU such as Strix Halo puts most allocations) or ``rocm-smi``; and per process
through the DRM ``fdinfo`` keys (``drm-memory-vram``, ``drm-resident-gtt``...) of any GPU driver
that writes them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

from passerelle import procfs

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_LISTEN = "0A"


# --- which process ---------------------------------------------------------------------------
def is_local_host(host: str) -> bool:
    """True when ``host`` is an address of this machine (loopback, or one a socket can bind to)."""
    if host in ("localhost", "", "0.0.0.0", "::"):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        ip = addr[0]
        try:
            if ipaddress.ip_address(ip).is_loopback:
                return True
        except ValueError:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((ip, 0))  # only an address of one of this machine's interfaces binds
                return True
            except OSError:
                continue
    return False


def _listening_inodes(port: int, proc: Path) -> set[str]:
    inodes = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[9] != "0":
                inodes.add(fields[9])
    return inodes


def listening_pid(host: str, port: int, proc: Path = Path("/proc")) -> int | None:
    """The process listening on ``port`` here, when ``host`` is this machine; else ``None``."""
    if not is_local_host(host):
        return None
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port, proc)}
    if not wanted:
        return None
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in wanted:
                    found.append(int(entry.name))
                    break
            except OSError:
                continue
    # a forked worker may share the listening socket with its parent: the topmost holder is the server
    if not found:
        return None
    parents = procfs.parents(proc)
    holders = set(found)
    top = [p for p in found if parents.get(p) not in holders]
    return min(top or found)


def describe_process(pid: int, proc: Path = Path("/proc")) -> dict[str, Any]:
    """Name and executable of a process (never its arguments: they may hold keys)."""
    info: dict[str, Any] = {"pid": pid}
    with contextlib.suppress(OSError):
        info["name"] = (proc / str(pid) / "comm").read_text().strip()
    with contextlib.suppress(OSError):
        info["exe"] = os.path.basename(os.readlink(proc / str(pid) / "exe"))
    return info


# --- resident memory -----------------------------------------------------------------------
def process_memory(pid: int, proc: Path = Path("/proc")) -> tuple[int | None, int | None]:
    """(RSS, PSS) in bytes; PSS is ``None`` where ``smaps_rollup`` cannot be read."""
    rss = pss = None
    try:
        for line in (proc / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if rss is None:
        try:
            rss = int((proc / str(pid) / "statm").read_text().split()[1]) * PAGE
        except (OSError, ValueError, IndexError):
            return None, None
    return rss, pss


def tree_memory(pids: list[int], proc: Path = Path("/proc")) -> tuple[int | None, int | None]:
    """Summed RSS and PSS of the processes (PSS ``None`` unless every one could be read)."""
    rss_total, pss_total, seen = 0, 0, 0
    pss_ok = True
    for pid in pids:
        rss, pss = process_memory(pid, proc)
        if rss is None:
            continue  # exited meanwhile
        seen += 1
        rss_total += rss
        if pss is None:
            pss_ok = False
        else:
            pss_total += pss
    if not seen:
        return None, None
    return rss_total, (pss_total if pss_ok else None)


# --- GPU memory ----------------------------------------------------------------------------
def parse_nvidia_gpus(text: str) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader,nounits``."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            out.append({"index": int(parts[0]), "name": ",".join(parts[1:-2]),
                        "used_bytes": int(float(parts[-2]) * 2**20), "total_bytes": int(float(parts[-1]) * 2**20)})
        except ValueError:
            continue
    return out


def parse_nvidia_apps(text: str) -> dict[int, int]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` → pid: bytes."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            out[int(parts[0])] = out.get(int(parts[0]), 0) + int(float(parts[1]) * 2**20)
        except (ValueError, IndexError):
            continue  # "[N/A]" where the driver does not say
    return out


def amdgpu_sysfs(root: Path = Path("/")) -> list[dict[str, Any]]:
    """The amdgpu memory counters of each card (bytes), from sysfs."""
    out = []
    for dev in sorted((root / "sys/class/drm").glob("card[0-9]*/device")):
        if not (dev / "mem_info_vram_used").exists():
            continue
        card: dict[str, Any] = {"card": dev.parent.name}
        for key in ("vram_used", "vram_total", "gtt_used", "gtt_total"):
            with contextlib.suppress(OSError, ValueError):
                card[f"{key}_bytes"] = int((dev / f"mem_info_{key}").read_text().strip())
        out.append(card)
    return out


def parse_rocm_smi(text: str) -> list[dict[str, Any]]:
    """``rocm-smi --showmeminfo vram gtt --json``: {"card0": {"VRAM Total Used Memory (B)": "…", …}}."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    out = []
    for card, fields in sorted(data.items()) if isinstance(data, dict) else ():
        if not isinstance(fields, dict):
            continue
        entry: dict[str, Any] = {"card": card}
        for key, value in fields.items():
            k = key.lower()
            kind = "vram" if "vram" in k else "gtt" if "gtt" in k else None
            if kind is None or "(b)" not in k:
                continue
            try:
                entry[f"{kind}_{'used' if 'used' in k else 'total'}_bytes"] = int(value)
            except (TypeError, ValueError):
                continue
        out.append(entry)
    return out


def drm_fdinfo(pids: list[int], proc: Path = Path("/proc")) -> dict[str, int]:
    """GPU memory the processes hold by DRM region (``vram``, ``gtt``, ``system``...), in bytes.

    Each open DRM file reports its client's memory; files of one client (same ``drm-client-id``
    on the same device) are counted once. ``drm-resident-*`` is preferred to ``drm-memory-*``.
    """
    totals: dict[str, int] = {}
    seen: set[tuple[str, str]] = set()
    for pid in pids:
        try:
            fds = list((proc / str(pid) / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if not os.readlink(fd).startswith("/dev/dri/"):
                    continue
                lines = (proc / str(pid) / "fdinfo" / fd.name).read_text().splitlines()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in lines if ":" in line)
            fields = {k.strip(): v.strip() for k, v in fields.items()}
            client = (fields.get("drm-pdev", ""), fields.get("drm-client-id", f"{pid}:{fd.name}"))
            if client in seen:
                continue
            seen.add(client)
            regions: dict[str, int] = {}
            for prefix in ("drm-memory-", "drm-resident-"):  # the later one wins where both exist
                for key, value in fields.items():
                    if key.startswith(prefix):
                        regions[key[len(prefix):]] = _size(value)
            for region, size in regions.items():
                totals[region] = totals.get(region, 0) + size
    return totals


def _size(value: str) -> int:
    parts = value.split()
    try:
        n = int(parts[0])
    except (ValueError, IndexError):
        return 0
    unit = parts[1] if len(parts) > 1 else ""
    return n * {"": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}.get(unit, 1)


class GpuReader:
    """Reads GPU memory with what this machine has; ``source`` is ``None`` without a GPU."""

    def __init__(self, root: Path = Path("/")) -> None:
        self.root = root
        self.nvidia = shutil.which("nvidia-smi")
        self.rocm = shutil.which("rocm-smi")
        self.source: str | None = None
        if self.nvidia and self._run(self.nvidia, "--query-gpu=index,name,memory.used,memory.total"):
            self.source = "nvidia-smi"
        elif amdgpu_sysfs(root):
            self.source = "amdgpu sysfs"
        elif self.rocm and parse_rocm_smi(self._run(self.rocm, "--showmeminfo", "vram", "gtt", "--json",
                                                     csv=False)):
            self.source = "rocm-smi"

    def _run(self, *argv: str, csv: bool = True) -> str:
        args = [*argv, "--format=csv,noheader,nounits"] if csv else list(argv)
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout if done.returncode == 0 else ""

    def devices(self) -> list[dict[str, Any]]:
        """Each GPU's name and total memory (for the report)."""
        if self.source == "nvidia-smi":
            return [{"name": g["name"], "total_bytes": g["total_bytes"]} for g in parse_nvidia_gpus(
                self._run(self.nvidia or "nvidia-smi", "--query-gpu=index,name,memory.used,memory.total"))]
        cards = self._amd()
        return [{"name": c["card"], "total_bytes": c.get("vram_total_bytes"),
                 "gtt_total_bytes": c.get("gtt_total_bytes")} for c in cards]

    def _amd(self) -> list[dict[str, Any]]:
        if self.source == "amdgpu sysfs":
            return amdgpu_sysfs(self.root)
        if self.source == "rocm-smi":
            return parse_rocm_smi(self._run(self.rocm or "rocm-smi", "--showmeminfo", "vram", "gtt", "--json",
                                            csv=False))
        return []

    def sample(self, pids: list[int]) -> dict[str, int | None]:
        """``device_used_bytes`` (all GPUs, everyone's), ``process_bytes`` (the tree's own, where
        the driver says), and for AMD ``gtt_used_bytes``."""
        out: dict[str, int | None] = {}
        if self.source == "nvidia-smi":
            gpus = parse_nvidia_gpus(self._run(self.nvidia or "nvidia-smi",
                                               "--query-gpu=index,name,memory.used,memory.total"))
            out["device_used_bytes"] = sum(g["used_bytes"] for g in gpus) if gpus else None
            apps = parse_nvidia_apps(self._run(self.nvidia or "nvidia-smi", "--query-compute-apps=pid,used_memory"))
            mine = [apps[p] for p in pids if p in apps]
            out["process_bytes"] = sum(mine) if mine else None
        elif self.source is not None:
            cards = self._amd()
            out["device_used_bytes"] = sum(c.get("vram_used_bytes", 0) for c in cards) if cards else None
            out["gtt_used_bytes"] = sum(c.get("gtt_used_bytes", 0) for c in cards) if cards else None
            regions = drm_fdinfo(pids)
            out["process_bytes"] = (regions.get("vram", 0) + regions.get("gtt", 0)) if regions else None
        return out
