"""Energy a run used, where the machine reports it: RAPL counters, amdgpu's power, nvidia-smi.

Three sources, summed when several are present (a CPU package and a GPU):

- RAPL (``/sys/class/powercap/intel-rapl:N/energy_uj``, also on AMD CPUs): a cumulative counter in
  µJ per CPU package, read before and after (wrapping at ``max_energy_range_uj``);
- amdgpu (``/sys/class/drm/card*/device/hwmon/hwmon*/power1_average``, µW; Strix Halo's whole APU):
  sampled, integrated over time;
- ``nvidia-smi --query-gpu=power.draw`` (W per GPU): sampled, integrated over time.

With none of them the meter says so and the report shows "not available".

Example::

    meter = EnergyMeter()
    meter.start(); ...; joules = meter.stop()   # None: the machine reports no power
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

NOT_AVAILABLE = "not available"


def rapl_counters(root: Path = Path("/sys/class/powercap")) -> list[Path]:
    """The package-level RAPL domains (``intel-rapl:N``, not their sub-zones: those are inside)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1 and (p / "energy_uj").is_file())


def amdgpu_power_files(root: Path = Path("/sys/class/drm")) -> list[Path]:
    return sorted(root.glob("card*/device/hwmon/hwmon*/power1_average")) if root.is_dir() else []


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def nvidia_power_w(run: Callable[[list[str]], str | None] | None = None) -> float | None:
    """The GPUs' power draw summed, in watts (None without nvidia-smi or a reading)."""
    if run is None:
        if not shutil.which("nvidia-smi"):
            return None
        run = _run
    out = run(["nvidia-smi", "--query-gpu=power.draw", "--format=csv,noheader,nounits"])
    values = []
    for line in (out or "").splitlines():
        try:
            values.append(float(line.strip()))
        except ValueError:
            continue
    return sum(values) if values else None


def _run(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


class EnergyMeter:
    """Joules used between :meth:`start` and :meth:`stop`, from every source this machine has."""

    def __init__(self, *, powercap: Path = Path("/sys/class/powercap"), drm: Path = Path("/sys/class/drm"),
                 nvidia: Callable[[], float | None] | None = nvidia_power_w, interval_s: float = 0.5) -> None:
        self.rapl = rapl_counters(powercap)
        self.amdgpu = amdgpu_power_files(drm)
        self.nvidia = nvidia if nvidia is not None and nvidia() is not None else None
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_uj: dict[Path, int | None] = {}
        self._sampled_j = 0.0
        self._last: tuple[float, float] | None = None  # (time, watts) of the sampled sources

    @property
    def sources(self) -> list[str]:
        return ([f"RAPL ({len(self.rapl)} package{'s' if len(self.rapl) > 1 else ''})"] if self.rapl else []) \
            + (["amdgpu power1_average"] if self.amdgpu else []) + (["nvidia-smi power.draw"] if self.nvidia else [])

    @property
    def available(self) -> bool:
        return bool(self.sources)

    def _watts(self) -> float | None:
        total, seen = 0.0, False
        for f in self.amdgpu:
            uw = _read_int(f)
            if uw is not None:
                total, seen = total + uw / 1e6, True
        if self.nvidia is not None:
            w = self.nvidia()
            if w is not None:
                total, seen = total + w, True
        return total if seen else None

    def _sample(self) -> None:
        watts = self._watts()
        now = time.monotonic()
        if watts is not None:
            if self._last is not None:  # trapezoids between samples
                self._sampled_j += (now - self._last[0]) * (watts + self._last[1]) / 2
            self._last = (now, watts)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> None:
        self._start_uj = {p: _read_int(p / "energy_uj") for p in self.rapl}
        self._sampled_j, self._last = 0.0, None
        if self.amdgpu or self.nvidia:
            self._sample()
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="energy-meter", daemon=True)
            self._thread.start()

    def stop(self) -> float | None:
        """Joules since :meth:`start`; None where the machine reports no power."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=30)
            self._thread = None
            self._sample()
        if not self.available:
            return None
        joules = self._sampled_j
        for p, before in self._start_uj.items():
            after = _read_int(p / "energy_uj")
            if before is None or after is None:
                continue
            delta = after - before
            if delta < 0:  # the counter wrapped
                delta += _read_int(p / "max_energy_range_uj") or 0
            joules += delta / 1e6
        return joules
