"""llama-server build flavours: which GPU this machine has, the CMake flags for it, what to install.

A flavour is one build of the pinned llama.cpp: ``cpu`` (portable AVX2), ``vulkan`` (any Vulkan
driver: RADV on AMD, NVIDIA's, Mesa's software lavapipe), ``rocm`` (HIP, for one GPU target such as
``gfx1151``) or ``cuda``. Each is cached side by side under ``~/.cache/passerelle/llama.cpp``.
``auto`` picks the machine's GPU: CUDA where ``nvidia-smi`` lists one, ROCm where ``/dev/kfd`` and
HIP's tools are present, Vulkan where ``vulkaninfo`` lists a device that is not a CPU, else CPU.
``passerelle bench flavours`` measures which of the built ones serves this machine best.

Example::

    >>> spec("rocm", gpu_target="gfx1151").cmake_flags[-2:]
    ('-DGGML_HIP=ON', '-DGPU_TARGETS=gfx1151')
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from passerelle.config import EMBEDDED_FLAVOURS

FLAVOUR_CHOICES = EMBEDDED_FLAVOURS
FLAVOURS = tuple(f for f in FLAVOUR_CHOICES if f != "auto")
GPU_FLAVOURS = ("vulkan", "rocm", "cuda")

# Flags that run on any x86-64 with AVX2. GGML_NATIVE=ON is unsafe on virtual machines that
# advertise AMX in cpuid but trap on it (SIGILL in tinygemm_kernel_amx). GPU builds keep them:
# their CPU backend runs what is not offloaded.
CPU_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON")
GPU_FLAGS = {"vulkan": ("-DGGML_VULKAN=ON",), "rocm": ("-DGGML_HIP=ON",), "cuda": ("-DGGML_CUDA=ON",)}
# every layer on the GPU (llama-server caps it at the model's count)
GPU_LAYERS = "99"

Which = Callable[[str], str | None]
Run = Callable[[list[str]], str | None]


@dataclass(frozen=True)
class FlavourSpec:
    """One build: its cache key, the CMake flags, and what its launch needs."""

    flavour: str  # cpu, vulkan, rocm, cuda, or an operator's name (PASSERELLE_LLAMA_FLAVOUR)
    key: str  # the cache folder's suffix: cpu-avx2, vulkan, rocm-gfx1151, cuda
    cmake_flags: tuple[str, ...]
    gpu_target: str = ""  # ROCm's gfx target

    @property
    def offloads(self) -> bool:
        return self.kind in GPU_FLAVOURS

    @property
    def kind(self) -> str:
        """What the flags build: cpu, vulkan, rocm or cuda (an operator's custom flavour is classified by its flags)."""
        if self.flavour in FLAVOURS:
            return self.flavour
        for kind, flags in GPU_FLAGS.items():
            if any(f in self.cmake_flags for f in flags):
                return kind
        return "cpu"


def spec(flavour: str, *, gpu_target: str = "", env: Mapping[str, str] | None = None) -> FlavourSpec:
    """The build of ``flavour`` (cpu, vulkan, rocm, cuda), with the operator's overrides from ``env``.

    ``PASSERELLE_LLAMA_FLAVOUR`` names a build of one's own (its cache key) and
    ``PASSERELLE_LLAMA_CMAKE_FLAGS`` replaces the flavour's own flags (the common ones stay).
    """
    env = os.environ if env is None else env
    if flavour not in FLAVOURS:
        raise ValueError(f"unknown flavour {flavour!r}; expected one of {', '.join(FLAVOUR_CHOICES)}")
    if flavour == "rocm" and not gpu_target:
        raise ValueError("the rocm flavour needs a GPU target such as gfx1151 (rocminfo lists it)")
    flags = CPU_FLAGS + GPU_FLAGS.get(flavour, ())
    if gpu_target:
        flags += (f"-DGPU_TARGETS={gpu_target}",)
    key = {"cpu": "cpu-avx2", "rocm": f"rocm-{gpu_target}"}.get(flavour, flavour)
    name = flavour
    if env.get("PASSERELLE_LLAMA_CMAKE_FLAGS"):
        flags = tuple(env["PASSERELLE_LLAMA_CMAKE_FLAGS"].split())
    if env.get("PASSERELLE_LLAMA_FLAVOUR"):
        key = name = env["PASSERELLE_LLAMA_FLAVOUR"]
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", key):
        raise ValueError(f"flavour name {key!r}: use letters, digits and . _ + - (it names a folder)")
    return FlavourSpec(flavour=name, key=key, cmake_flags=flags, gpu_target=gpu_target)


# -- detection ---------------------------------------------------------------------------------

def _run(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


@dataclass(frozen=True)
class VulkanDevice:
    index: int
    name: str
    type: str  # DISCRETE_GPU, INTEGRATED_GPU, VIRTUAL_GPU, CPU, OTHER
    driver: str = ""

    @property
    def is_cpu(self) -> bool:
        return self.type == "CPU"


def parse_vulkan_summary(text: str) -> list[VulkanDevice]:
    """The devices of ``vulkaninfo --summary``, in its order (the order ggml numbers them)."""
    devices: list[VulkanDevice] = []
    current: dict[str, str] | None = None
    for line in text.splitlines():
        if re.match(r"^GPU\d+:\s*$", line.strip()):
            if current is not None:
                devices.append(_device(len(devices), current))
            current = {}
        elif current is not None and (m := re.match(r"^\s+(\w+)\s*=\s*(.*?)\s*$", line)):
            current[m.group(1)] = m.group(2)
    if current is not None:
        devices.append(_device(len(devices), current))
    return devices


def _device(index: int, fields: dict[str, str]) -> VulkanDevice:
    kind = fields.get("deviceType", "").removeprefix("PHYSICAL_DEVICE_TYPE_") or "OTHER"
    return VulkanDevice(index=index, name=fields.get("deviceName", "?"), type=kind,
                        driver=fields.get("driverName", ""))


def parse_rocminfo_targets(text: str) -> list[str]:
    """The GPU agents' ``gfx`` names in ``rocminfo``'s output (a CPU agent has none), in order."""
    return list(dict.fromkeys(re.findall(r"^\s*Name:\s+(gfx[0-9a-f]+)\s*$", text, re.MULTILINE)))


@dataclass(frozen=True)
class Detection:
    """What this machine offers: the flavour ``auto`` picks, and why."""

    flavour: str
    reason: str
    gpu_target: str = ""
    vulkan_devices: tuple[VulkanDevice, ...] = ()


def vulkan_devices(*, which: Which = shutil.which, run: Run = _run) -> tuple[VulkanDevice, ...]:
    if not which("vulkaninfo"):
        return ()
    out = run(["vulkaninfo", "--summary"])
    return tuple(parse_vulkan_summary(out or ""))


def rocm_target(*, which: Which = shutil.which, run: Run = _run) -> str:
    """The first GPU target ``rocminfo`` reports ("" without ROCm)."""
    if not which("rocminfo"):
        return ""
    targets = parse_rocminfo_targets(run(["rocminfo"]) or "")
    return targets[0] if targets else ""


def detect(*, which: Which = shutil.which, run: Run = _run, kfd: Path = Path("/dev/kfd")) -> Detection:
    """The flavour ``auto`` builds here: CUDA, then ROCm, then a Vulkan GPU, else CPU."""
    if which("nvidia-smi"):
        listed = [line for line in (run(["nvidia-smi", "-L"]) or "").splitlines() if line.startswith("GPU ")]
        if listed:
            return Detection("cuda", f"nvidia-smi lists {listed[0].split(' (UUID')[0]}")
    if kfd.exists() and (which("hipconfig") or which("rocminfo")):
        target = rocm_target(which=which, run=run)
        if target:
            return Detection("rocm", f"/dev/kfd and rocminfo report {target}", gpu_target=target)
    devices = vulkan_devices(which=which, run=run)
    gpus = [d for d in devices if not d.is_cpu]
    if gpus:
        return Detection("vulkan", f"vulkaninfo lists {gpus[0].name} ({gpus[0].type.lower()})",
                         vulkan_devices=devices)
    why = ("vulkaninfo lists only CPU devices (" + ", ".join(d.name for d in devices) + ")" if devices
           else "no GPU found (nvidia-smi, /dev/kfd with rocminfo, vulkaninfo)")
    return Detection("cpu", why, vulkan_devices=devices)


def launch_env(flavour: str, devices: tuple[VulkanDevice, ...]) -> tuple[str, ...]:
    """Environment a launch needs: ggml's Vulkan backend skips CPU-type devices (Mesa's lavapipe)
    unless ``GGML_VK_VISIBLE_DEVICES`` names them, so with no GPU device it names the CPU ones."""
    if flavour != "vulkan" or not devices or any(not d.is_cpu for d in devices):
        return ()
    return (f"GGML_VK_VISIBLE_DEVICES={','.join(str(d.index) for d in devices)}",)


def with_flavour(detection: Detection, flavour: str) -> Detection:
    return dataclasses.replace(detection, flavour=flavour)


def driver_description(kind: str, *, which: Which = shutil.which, run: Run = _run) -> str:
    """The device and driver a flavour runs on, as this machine reports them (for reports)."""
    if kind == "vulkan":
        devices = vulkan_devices(which=which, run=run)
        return "; ".join(f"{d.name} ({d.driver or d.type.lower()})" for d in devices) or "no Vulkan device listed"
    if kind == "cuda":
        out = run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]) if which("nvidia-smi") \
            else None
        return (out or "").strip() or "nvidia-smi did not answer"
    if kind == "rocm":
        target = rocm_target(which=which, run=run)
        return f"ROCm, {target}" if target else "ROCm (rocminfo lists no GPU)"
    return "CPU (no GPU driver)"
