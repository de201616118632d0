"""What building a llama-server flavour needs installed, checked before a build starts.

Each missing piece is named with its package on Debian, Ubuntu and Fedora, so the message is the
command to run rather than a CMake error ten minutes in.

Example::

    >>> missing("cpu", which=lambda name: None, exists=lambda path: True)[0].what
    'cmake'
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from passerelle.runtimes.flavours import Which


@dataclass(frozen=True)
class Need:
    what: str  # what is looked for (a command, a header)
    debian: str
    ubuntu: str
    fedora: str


Exists = Callable[[str], bool]

_ROOTS = ("/usr", "/usr/local", "/opt/rocm", "/usr/local/cuda")
_CUDA_INCLUDES = ("/usr/include", "/usr/local/cuda/include", "/usr/local/cuda/targets/x86_64-linux/include",
                  "/usr/local/cuda/targets/sbsa-linux/include")


def _file(rel: str, exists: Exists) -> bool:
    return any(exists(f"{root}/{rel}") for root in _ROOTS)


def _spirv_headers(exists: Exists) -> bool:
    return any(exists(p) for p in ("/usr/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake",
                                   "/usr/lib/x86_64-linux-gnu/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake",
                                   "/usr/lib64/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake",
                                   "/usr/local/share/cmake/SPIRV-Headers/SPIRV-HeadersConfig.cmake"))


def missing(flavour: str, *, which: Which = shutil.which,
            exists: Exists = lambda p: Path(p).exists()) -> list[Need]:
    """What ``flavour`` (cpu, vulkan, rocm, cuda) lacks on this machine (empty: ready to build)."""
    out: list[Need] = []
    if not which("cmake"):
        out.append(Need("cmake", "cmake", "cmake", "cmake"))
    if not (which("c++") or which("g++") or which("clang++")):
        out.append(Need("a C++ compiler (g++)", "g++", "g++", "gcc-c++"))
    if flavour == "vulkan":
        if not _file("include/vulkan/vulkan.h", exists):
            out.append(Need("Vulkan headers and loader (vulkan/vulkan.h)", "libvulkan-dev", "libvulkan-dev",
                            "vulkan-headers vulkan-loader-devel"))
        if not which("glslc"):
            out.append(Need("glslc (GLSL to SPIR-V compiler)", "glslc", "glslc", "glslc"))
        if not _spirv_headers(exists):
            out.append(Need("SPIR-V headers (SPIRV-HeadersConfig.cmake)", "spirv-headers", "spirv-headers",
                            "spirv-headers-devel"))
        if not which("vulkaninfo"):
            out.append(Need("vulkaninfo (device detection)", "vulkan-tools", "vulkan-tools", "vulkan-tools"))
    elif flavour == "rocm":
        if not (which("hipconfig") or exists("/opt/rocm/bin/hipconfig")):
            out.append(Need("HIP (hipconfig, hipcc)", "hipcc (Debian 13) or AMD's rocm-hip-sdk",
                            "hipcc or AMD's rocm-hip-sdk", "rocm-hip-devel"))
        if not (_file("include/hipblas/hipblas.h", exists) or _file("include/hipblas.h", exists)):
            out.append(Need("hipBLAS and rocBLAS", "libhipblas-dev librocblas-dev", "libhipblas-dev librocblas-dev",
                            "hipblas-devel rocblas-devel"))
        if not (which("rocminfo") or exists("/opt/rocm/bin/rocminfo")):
            out.append(Need("rocminfo (GPU target detection)", "rocminfo", "rocminfo", "rocminfo"))
    elif flavour == "cuda":
        if not (which("nvcc") or exists("/usr/local/cuda/bin/nvcc")):
            out.append(Need("the CUDA toolkit (nvcc)", "nvidia-cuda-toolkit", "nvidia-cuda-toolkit",
                            "cuda-toolkit (NVIDIA's repository)"))
        if not any(exists(f"{root}/cublas_v2.h") for root in _CUDA_INCLUDES):
            out.append(Need("cuBLAS (cublas_v2.h)", "nvidia-cuda-dev", "nvidia-cuda-dev",
                            "libcublas-devel (NVIDIA's repository)"))
    return out


def message(flavour: str, needs: list[Need]) -> str:
    """The error a user reads: what is missing, then the install command for each distribution."""
    if not needs:
        return ""
    lines = [f"building llama-server for {flavour} needs: {', '.join(n.what for n in needs)}. Install with"]
    for distro, tool in (("debian", "sudo apt-get install"), ("ubuntu", "sudo apt-get install"),
                         ("fedora", "sudo dnf install")):
        pkgs = " ".join(dict.fromkeys(getattr(n, distro) for n in needs))
        lines.append(f"  {distro.capitalize():7} {tool} {pkgs}")
    return "\n".join(lines)


class MissingPrerequisites(RuntimeError):
    def __init__(self, flavour: str, needs: list[Need]) -> None:
        super().__init__(message(flavour, needs))
        self.flavour = flavour
        self.needs = needs


def check(flavour: str, *, which: Which = shutil.which, exists: Exists = lambda p: Path(p).exists()) -> None:
    """Raise :class:`MissingPrerequisites` naming the packages to install, if any are missing."""
    needs = missing(flavour, which=which, exists=exists)
    if needs:
        raise MissingPrerequisites(flavour, needs)
