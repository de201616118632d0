"""Build-time guards applied to a copy of llama.cpp's source when the build machine's headers are older.

The pinned source's Vulkan backend creates its instance with ``VK_EXT_layer_settings`` (a
validation-layer option), whose types appeared in Vulkan headers 1.3.261; Debian 12 ships 1.3.239.
The option only matters with ``GGML_VULKAN_VALIDATE``, so on older headers the same instance is
created without the layer settings. The guard is written as ``#if VK_HEADER_VERSION >= 261`` so the
patched file still compiles the original code on newer headers, and it is applied only to the build
directory's copy (the cached sdist is never modified), only when the headers need it.

Example::

    >>> vulkan_header_version("#define VK_HEADER_VERSION 239\\n")
    239
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

# The first Vulkan headers that declare vk::LayerSettingEXT / VK_EXT_layer_settings.
LAYER_SETTINGS_HEADER_VERSION = 261
VULKAN_SOURCE = Path("ggml") / "src" / "ggml-vulkan" / "ggml-vulkan.cpp"
HEADER_CANDIDATES = (Path("/usr/include/vulkan/vulkan_core.h"), Path("/usr/local/include/vulkan/vulkan_core.h"))

_BLOCK_START = "    VkBool32 enable_best_practice = layer_settings;\n"
_BLOCK_END_RE = re.compile(
    r"    vk::InstanceCreateInfo instance_create_info\(vk::InstanceCreateFlags\{\}, &app_info, layers, "
    r"extensions, &layer_setting_info\);\n")
_FALLBACK = ("    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, "
             "extensions);\n")
_GUARD = f"#if VK_HEADER_VERSION >= {LAYER_SETTINGS_HEADER_VERSION}\n"
MARK = "// passerelle: guarded for Vulkan headers older than 1.3.261 (no VK_EXT_layer_settings)\n"


class PatchError(RuntimeError):
    """The source does not have the shape the guard was written for (a new llama.cpp pin)."""


def vulkan_header_version(header_text: str) -> int | None:
    """``VK_HEADER_VERSION`` as defined in ``vulkan_core.h``'s text, ``None`` if absent."""
    match = re.search(r"^#define\s+VK_HEADER_VERSION\s+(\d+)\s*$", header_text, re.MULTILINE)
    return int(match.group(1)) if match else None


def installed_vulkan_header_version(candidates: tuple[Path, ...] = HEADER_CANDIDATES) -> int | None:
    """The version of the first Vulkan headers found on this machine (``None``: not installed)."""
    for path in candidates:
        try:
            return vulkan_header_version(path.read_text(errors="replace"))
        except OSError:
            continue
    return None


def guard_layer_settings(source: str) -> str:
    """The source with its layer-settings instance block guarded by the header version (idempotent)."""
    if MARK in source:
        return source
    start = source.find(_BLOCK_START)
    end = _BLOCK_END_RE.search(source, start if start >= 0 else 0)
    if start < 0 or end is None:
        raise PatchError(f"{VULKAN_SOURCE}: the VK_EXT_layer_settings instance block was not found; "
                         "install Vulkan headers >= 1.3.261 or update the guard for this llama.cpp")
    original = source[start:end.end()]
    guarded = f"{MARK}{_GUARD}{original}#else\n{_FALLBACK}#endif\n"
    return source[:start] + guarded + source[end.end():]


def prepare_vulkan_source(src_root: Path, header_version: int | None, *,
                          log: Callable[[str], object] = print) -> bool:
    """Guard the build copy's Vulkan source when ``header_version`` predates layer settings.

    Returns whether the file was patched. Newer headers (or none found: CMake will say so) leave
    the source untouched.
    """
    if header_version is None or header_version >= LAYER_SETTINGS_HEADER_VERSION:
        return False
    path = src_root / VULKAN_SOURCE
    text = path.read_text()
    patched = guard_layer_settings(text)
    if patched != text:
        path.write_text(patched)
        log(f"passerelle: Vulkan headers 1.3.{header_version} predate VK_EXT_layer_settings (1.3.261); "
            f"guarded its use in {VULKAN_SOURCE} for this build")
    return True
