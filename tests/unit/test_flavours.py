"""llama-server flavours: detection from the tools a machine has (stand-ins on PATH answering what
the real ones answer), CMake flags, the prerequisites message, the cache layout, the Vulkan header
guard, and what the embedded runtime launches for a flavour."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import orjson
import pytest

from passerelle.config import EmbeddedConfig, load_config
from passerelle.errors import ConfigError
from passerelle.runtimes import embedded, factory, flavours, prerequisites, source_patches
from passerelle.runtimes.flavours import Detection, VulkanDevice, spec
from passerelle.server.control import render

STRIX_HALO_VULKAN = """\
==========
VULKANINFO
==========

Vulkan Instance Version: 1.4.309

Devices:
========
GPU0:
\tapiVersion         = 1.4.305
\tdriverVersion      = 25.0.2
\tvendorID           = 0x1002
\tdeviceType         = PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU
\tdeviceName         = AMD Radeon Graphics (RADV GFX1151)
\tdriverID           = DRIVER_ID_MESA_RADV
\tdriverName         = radv
GPU1:
\tapiVersion         = 1.3.230
\tdeviceType         = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName         = llvmpipe (LLVM 15.0.6, 256 bits)
\tdriverName         = llvmpipe
"""
LAVAPIPE_ONLY = """\
Devices:
========
GPU0:
\tapiVersion         = 1.3.230
\tvendorID           = 0x10005
\tdeviceType         = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName         = llvmpipe (LLVM 15.0.6, 256 bits)
\tdriverID           = DRIVER_ID_MESA_LLVMPIPE
\tdriverName         = llvmpipe
"""
ROCMINFO = """\
*******
Agent 1
*******
  Name:                    AMD RYZEN AI MAX+ 395 w/ Radeon 8060S
  Device Type:             CPU
*******
Agent 2
*******
  Name:                    gfx1151
  Marketing Name:          AMD Radeon Graphics
  Device Type:             GPU
      Name:                    amdgcn-amd-amdhsa--gfx1151
"""


def _tools(tmp_path: Path, monkeypatch, **scripts: str) -> Path:
    """A PATH holding only the given stand-ins (name -> shell body)."""
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for name, body in scripts.items():
        f = tools / name.replace("_", "-")
        f.write_text(f"#!/bin/sh\n{body}\n")
        f.chmod(0o755)
    monkeypatch.setenv("PATH", str(tools))
    return tools


def _printing(text: str) -> str:
    return f"/bin/cat <<'EOF'\n{text}EOF"


# -- detection -------------------------------------------------------------------------------

def test_an_nvidia_gpu_listed_by_nvidia_smi_means_cuda(tmp_path, monkeypatch):
    _tools(tmp_path, monkeypatch, nvidia_smi='[ "$1" = "-L" ] && echo "GPU 0: NVIDIA H200 (UUID: GPU-1234)"',
           vulkaninfo=_printing(LAVAPIPE_ONLY))
    found = flavours.detect(kfd=tmp_path / "no-kfd")
    assert found.flavour == "cuda" and "NVIDIA H200" in found.reason and "UUID" not in found.reason


def test_kfd_and_rocminfo_mean_rocm_with_the_gfx_target(tmp_path, monkeypatch):
    kfd = tmp_path / "kfd"
    kfd.write_text("")
    # an nvidia-smi without a GPU (driver installed, no card) is passed over
    _tools(tmp_path, monkeypatch, nvidia_smi="echo 'NVIDIA-SMI has failed' >&2; exit 9", rocminfo=_printing(ROCMINFO),
           vulkaninfo=_printing(STRIX_HALO_VULKAN))
    found = flavours.detect(kfd=kfd)
    assert (found.flavour, found.gpu_target) == ("rocm", "gfx1151")
    built = spec("rocm", gpu_target=found.gpu_target, env={})
    assert built.key == "rocm-gfx1151" and built.cmake_flags[-2:] == ("-DGGML_HIP=ON", "-DGPU_TARGETS=gfx1151")


def test_rocminfo_without_dev_kfd_is_not_rocm_and_a_radv_gpu_means_vulkan(tmp_path, monkeypatch):
    _tools(tmp_path, monkeypatch, rocminfo=_printing(ROCMINFO), vulkaninfo=_printing(STRIX_HALO_VULKAN))
    found = flavours.detect(kfd=tmp_path / "no-kfd")
    assert found.flavour == "vulkan" and "RADV GFX1151" in found.reason
    assert [(d.index, d.type) for d in found.vulkan_devices] == [(0, "INTEGRATED_GPU"), (1, "CPU")]
    # a real GPU is there: ggml's own choice of devices stands
    assert flavours.launch_env("vulkan", found.vulkan_devices) == ()


def test_only_a_software_vulkan_device_means_cpu_and_the_vulkan_launch_names_it(tmp_path, monkeypatch):
    _tools(tmp_path, monkeypatch, vulkaninfo=_printing(LAVAPIPE_ONLY))
    found = flavours.detect(kfd=tmp_path / "no-kfd")
    assert found.flavour == "cpu" and "llvmpipe" in found.reason
    assert flavours.launch_env("vulkan", found.vulkan_devices) == ("GGML_VK_VISIBLE_DEVICES=0",)
    assert flavours.launch_env("cpu", found.vulkan_devices) == ()


def test_no_tools_at_all_means_cpu(tmp_path, monkeypatch):
    _tools(tmp_path, monkeypatch)
    found = flavours.detect(kfd=tmp_path / "no-kfd")
    assert found == Detection("cpu", "no GPU found (nvidia-smi, /dev/kfd with rocminfo, vulkaninfo)")


def test_a_failing_vulkaninfo_lists_no_device(tmp_path, monkeypatch):
    _tools(tmp_path, monkeypatch, vulkaninfo="echo 'ERROR_INCOMPATIBLE_DRIVER' >&2; exit 1")
    assert flavours.vulkan_devices() == ()


# -- flags and overrides -----------------------------------------------------------------------

@pytest.mark.parametrize(("flavour", "flag", "key"), [("cpu", None, "cpu-avx2"),
                                                     ("vulkan", "-DGGML_VULKAN=ON", "vulkan"),
                                                     ("cuda", "-DGGML_CUDA=ON", "cuda")])
def test_each_flavour_keeps_the_portable_cpu_flags_and_adds_its_own(flavour, flag, key):
    built = spec(flavour, env={})
    assert built.key == key and built.cmake_flags[:len(flavours.CPU_FLAGS)] == flavours.CPU_FLAGS
    assert built.cmake_flags[len(flavours.CPU_FLAGS):] == ((flag,) if flag else ())
    assert built.offloads == (flag is not None)
    assert "-DGGML_NATIVE=ON" not in built.cmake_flags


def test_rocm_needs_a_target_and_unknown_flavours_are_refused():
    with pytest.raises(ValueError, match="gfx1151"):
        spec("rocm", env={})
    with pytest.raises(ValueError, match="auto, cpu, vulkan, rocm, cuda"):
        spec("metal", env={})


def test_the_environment_overrides_name_a_build_of_ones_own():
    blas = ("-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_BLAS=ON -DGGML_BLAS_VENDOR=OpenBLAS")
    built = spec("cpu", env={"PASSERELLE_LLAMA_FLAVOUR": "openblas", "PASSERELLE_LLAMA_CMAKE_FLAGS": blas})
    assert (built.key, built.flavour, built.cmake_flags) == ("openblas", "openblas", tuple(blas.split()))
    assert built.kind == "cpu" and not built.offloads
    # a custom build is classified by its flags: this one offloads
    radv = spec("cpu", env={"PASSERELLE_LLAMA_FLAVOUR": "vulkan-radv",
                            "PASSERELLE_LLAMA_CMAKE_FLAGS": "-DGGML_VULKAN=ON"})
    assert radv.kind == "vulkan" and radv.offloads
    with pytest.raises(ValueError, match="names a folder"):
        spec("cpu", env={"PASSERELLE_LLAMA_FLAVOUR": "../escape"})


# -- prerequisites -----------------------------------------------------------------------------

def test_a_vulkan_build_without_its_packages_names_them_for_each_distribution():
    needs = prerequisites.missing("vulkan", which=lambda name: "/usr/bin/" + name if name in ("cmake", "g++") else None,
                                  exists=lambda path: False)
    text = prerequisites.message("vulkan", needs)
    assert "glslc" in text and "vulkan/vulkan.h" in text
    lines = text.splitlines()
    assert lines[1].split() == ["Debian", "sudo", "apt-get", "install", "libvulkan-dev", "glslc", "spirv-headers",
                                "vulkan-tools"]
    assert lines[3].split()[:3] == ["Fedora", "sudo", "dnf"]
    assert "vulkan-loader-devel" in lines[3] and "spirv-headers-devel" in lines[3]
    assert all("cmake" not in line.split() for line in lines[1:])  # cmake and g++ are there


def test_everything_installed_means_nothing_missing():
    for flavour in ("cpu", "vulkan", "rocm", "cuda"):
        assert prerequisites.missing(flavour, which=lambda name: f"/usr/bin/{name}", exists=lambda path: True) == []


def test_rocm_and_cuda_name_their_toolkits():
    none = prerequisites.missing("rocm", which=lambda name: None, exists=lambda path: False)
    text = prerequisites.message("rocm", none)
    assert "hipconfig" in text and "libhipblas-dev librocblas-dev" in text and "rocm-hip-devel" in text
    cuda = prerequisites.message("cuda", prerequisites.missing("cuda", which=lambda n: None, exists=lambda p: False))
    assert "nvidia-cuda-toolkit" in cuda and "cublas" in cuda.lower() and "g++" in cuda and "gcc-c++" in cuda


def test_a_build_checks_prerequisites_before_touching_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("PASSERELLE_CACHE", str(tmp_path / "cache"))
    _tools(tmp_path, monkeypatch)  # no cmake, no compiler
    with pytest.raises(prerequisites.MissingPrerequisites, match="cmake") as err:
        embedded.build_llama_server(spec("cpu", env={}))
    assert err.value.flavour == "cpu"
    assert not (tmp_path / "cache").exists()


# -- the cache layout, the source copy, a build with a stand-in CMake ---------------------------

def _fake_sdist(cache: Path, source: str) -> Path:
    src = cache / "src"
    src.mkdir(parents=True)
    sdist = src / f"llama_cpp_python-{embedded.LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    inner = cache / "inner" / f"llama_cpp_python-{embedded.LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    (inner / source_patches.VULKAN_SOURCE).parent.mkdir(parents=True)
    (inner / source_patches.VULKAN_SOURCE).write_text(source)
    (inner / "CMakeLists.txt").write_text("project(x)\n")
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(cache / "inner" / f"llama_cpp_python-{embedded.LLAMA_CPP_PYTHON_VERSION}",
                arcname=f"llama_cpp_python-{embedded.LLAMA_CPP_PYTHON_VERSION}")
    return sdist


def test_builds_are_cached_side_by_side_per_flavour(tmp_path, monkeypatch):
    monkeypatch.setenv("PASSERELLE_CACHE", str(tmp_path))
    for name in ("PASSERELLE_LLAMA_FLAVOUR", "PASSERELLE_LLAMA_CMAKE_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    v = embedded.BUILD_ID
    assert v == f"{embedded.LLAMA_CPP_PYTHON_VERSION}+rpc"  # built with the RPC backend: not an older build's folder
    root = tmp_path / "llama.cpp"
    assert embedded.build_dir() == root / f"{v}-cpu-avx2"
    assert embedded.cached_rpc_server() == root / f"{v}-cpu-avx2" / "bin" / "rpc-server"
    assert embedded.cached_binary(spec("vulkan")) == root / f"{v}-vulkan" / "bin" / "llama-server"
    assert embedded.build_dir(spec("rocm", gpu_target="gfx1151")) == root / f"{v}-rocm-gfx1151"
    for key in ("cpu-avx2", "vulkan"):
        (root / f"{v}-{key}" / "bin").mkdir(parents=True)
        (root / f"{v}-{key}" / "bin" / "llama-server").write_text("")
        (root / f"{v}-{key}" / "build-info.json").write_text(json.dumps({"flavour": key.split("-")[0]}))
    (root / f"{v}-cuda.work").mkdir()  # a build under way is not a build
    (root / "0.2.0-cpu-avx2" / "bin").mkdir(parents=True)  # another pin's
    (root / f"{embedded.LLAMA_CPP_PYTHON_VERSION}-cpu-avx2" / "bin").mkdir(parents=True)  # built without RPC
    assert [(b["key"], b["flavour"]) for b in embedded.built_flavours()] == [("cpu-avx2", "cpu"), ("vulkan", "vulkan")]


SOURCE = """\
static void instance_init() {
    std::vector<const char*> extensions;
    VkBool32 enable_best_practice = layer_settings;
    std::vector<vk::LayerSettingEXT> settings = { { "VK_LAYER_KHRONOS_validation", "validate_best_practices",
        vk::LayerSettingTypeEXT::eBool32, 1, &enable_best_practice }, };
    vk::LayerSettingsCreateInfoEXT layer_setting_info(settings);
    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions, \
&layer_setting_info);
    vk_instance.instance = vk::createInstance(instance_create_info);
}
"""


def test_the_guard_keeps_the_original_for_new_headers_and_creates_the_same_instance_without_settings():
    guarded = source_patches.guard_layer_settings(SOURCE)
    before, _, rest = guarded.partition("#if VK_HEADER_VERSION >= 261\n")
    original, _, rest = rest.partition("#else\n")
    fallback, _, after = rest.partition("#endif\n")
    assert SOURCE.startswith(before.split("// ")[0]) and original in SOURCE
    assert "&layer_setting_info" in original and "LayerSetting" not in fallback
    assert fallback.strip() == ("vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, "
                                "layers, extensions);")
    assert after.startswith("    vk_instance.instance = vk::createInstance(instance_create_info);")
    assert source_patches.guard_layer_settings(guarded) == guarded  # applied once
    with pytest.raises(source_patches.PatchError, match=r"1\.3\.261"):
        source_patches.guard_layer_settings("int main() {}\n")


def test_the_header_version_is_read_from_vulkan_core_h(tmp_path):
    header = tmp_path / "vulkan_core.h"
    header.write_text("#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 3, VK_HEADER_VERSION)\n"
                      "// Version of this file\n#define VK_HEADER_VERSION 239\n")
    assert source_patches.installed_vulkan_header_version((tmp_path / "absent.h", header)) == 239
    assert source_patches.installed_vulkan_header_version((tmp_path / "absent.h",)) is None


@pytest.mark.parametrize(("headers", "patched"), [(239, True), (261, False), (275, False)])
def test_the_source_copy_is_guarded_only_for_older_headers_and_the_sdist_stays_pristine(tmp_path, monkeypatch,
                                                                                        headers, patched):
    monkeypatch.setenv("PASSERELLE_CACHE", str(tmp_path))
    sdist = _fake_sdist(tmp_path, SOURCE)
    pristine = sdist.read_bytes()
    work = tmp_path / "work"
    work.mkdir()
    src = embedded.prepare_source(work, spec("vulkan", env={}), header_version=headers, log=lambda m: None)
    text = (src / source_patches.VULKAN_SOURCE).read_text()
    assert (source_patches.MARK in text) == patched and sdist.read_bytes() == pristine
    # prepared once: a resumed build reuses the copy (and its object files)
    (src / "kept").write_text("")
    assert embedded.prepare_source(work, spec("vulkan", env={}), header_version=headers) == src
    assert (src / "kept").exists()
    # no headers found: left as it is, CMake's own check says what is missing
    assert source_patches.prepare_vulkan_source(tmp_path / "nowhere", None) is False


def test_a_build_runs_cmake_with_the_flavour_flags_and_records_what_it_built(tmp_path, monkeypatch):
    monkeypatch.setenv("PASSERELLE_CACHE", str(tmp_path / "cache"))
    _fake_sdist(tmp_path / "cache", SOURCE)
    calls = tmp_path / "cmake-calls"
    # CMake's stand-in: records each call; --build leaves a llama-server that prints its version
    _tools(tmp_path, monkeypatch, **{"g++": "exit 0", "cmake": f"""echo "$@" >> {calls}
if [ "$1" = "--build" ]; then /bin/mkdir -p "$2/bin"
printf '#!/bin/sh\\necho "version: 1 (test)"\\n' > "$2/bin/llama-server"; /bin/chmod +x "$2/bin/llama-server"
printf '#!/bin/sh\\n' > "$2/bin/ggml-rpc-server"; /bin/chmod +x "$2/bin/ggml-rpc-server"; fi"""})
    built = spec("cpu", env={"PASSERELLE_LLAMA_FLAVOUR": "openblas",
                             "PASSERELLE_LLAMA_CMAKE_FLAGS": "-DGGML_BLAS=ON -DGGML_BLAS_VENDOR=OpenBLAS"})
    binary = embedded.build_llama_server(built, log=lambda m: None)
    folder = tmp_path / "cache" / "llama.cpp" / f"{embedded.BUILD_ID}-openblas"
    assert binary == folder / "bin" / "llama-server" and os.access(binary, os.X_OK)
    assert os.access(folder / "bin" / "rpc-server", os.X_OK)  # the RPC worker, built beside it
    configure, build = calls.read_text().splitlines()
    assert configure.split()[-2:] == ["-DGGML_BLAS=ON", "-DGGML_BLAS_VENDOR=OpenBLAS"]
    assert {"-DLLAMA_CURL=OFF", "-DGGML_RPC=ON"} <= set(configure.split())  # (an operator's flags keep RPC on)
    assert build.split()[:5] == ["--build", str(folder) + ".work/build", "--target", "llama-server", "ggml-rpc-server"]
    info = json.loads((folder / "build-info.json").read_text())
    assert (info["flavour"], info["kind"], info["llama_server_version"]) == ("openblas", "cpu", ["version: 1 (test)"])
    assert not (folder.parent / (folder.name + ".work")).exists()  # the work folder goes once it succeeded
    assert embedded.build_info(built) == info


# -- what is launched for a flavour ------------------------------------------------------------

LAVAPIPE = Detection("cpu", "vulkaninfo lists only CPU devices", vulkan_devices=(VulkanDevice(0, "llvmpipe", "CPU"),))


def _cached(tmp_path: Path, key: str) -> None:
    binary = tmp_path / "llama.cpp" / f"{embedded.BUILD_ID}-{key}" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)


def _embedded_cfg(tmp_path: Path, monkeypatch, flavour: str, **more):
    monkeypatch.setenv("PASSERELLE_CACHE", str(tmp_path))
    monkeypatch.setattr(flavours, "detect", lambda **kw: LAVAPIPE)
    for name in ("PASSERELLE_LLAMA_FLAVOUR", "PASSERELLE_LLAMA_CMAKE_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    cfg = load_config(None, env={})
    import dataclasses
    e = dataclasses.replace(cfg.embedded, flavour=flavour, model_path=str(model), rerank=False, **more)
    return dataclasses.replace(cfg, embedded=e)


def test_the_vulkan_flavour_offloads_and_shows_ggml_the_software_device(tmp_path, monkeypatch):
    _cached(tmp_path, "vulkan")
    monkeypatch.setattr("shutil.which", lambda name: "/usr/local/bin/llama-server" if name == "llama-server" else None)
    backends = factory.embedded_backends(_embedded_cfg(tmp_path, monkeypatch, "vulkan"))
    assert [b.flavour for b in backends] == ["vulkan", "vulkan"]
    chat = backends[0].launch
    assert chat[:3] == ("env", "GGML_VK_VISIBLE_DEVICES=0", str(embedded.cached_binary(spec("vulkan", env={}))))
    assert chat[chat.index("-ngl") + 1] == "99"  # an explicit flavour is not the llama-server on PATH


def test_the_operators_gpu_layers_win_and_cpu_does_not_offload(tmp_path, monkeypatch):
    _cached(tmp_path, "vulkan")
    _cached(tmp_path, "cpu-avx2")
    mine = factory.embedded_backends(_embedded_cfg(tmp_path, monkeypatch, "vulkan", extra_args=("-ngl", "10")))
    launch = mine[0].launch
    assert launch.count("-ngl") == 1 and launch[launch.index("-ngl") + 1] == "10"
    cpu = factory.embedded_backends(_embedded_cfg(tmp_path, monkeypatch, "cpu", embeddings=False))
    assert len(cpu) == 1 and cpu[0].flavour == "cpu" and "-ngl" not in cpu[0].launch and cpu[0].launch[0] != "env"


def test_auto_falls_back_to_cpu_saying_what_a_detected_gpu_needs(tmp_path, monkeypatch):
    monkeypatch.setenv("PASSERELLE_CACHE", str(tmp_path))
    _tools(tmp_path, monkeypatch, cmake="exit 0", **{"g++": "exit 0"})  # no glslc, no vulkaninfo
    said: list[str] = []
    radv = Detection("vulkan", "vulkaninfo lists AMD Radeon Graphics (integrated_gpu)")
    chosen, _ = embedded.resolve("auto", detection=radv, log=said.append)
    assert chosen.flavour == "cpu" and "install glslc" in said[0] and "AMD Radeon" in said[0]
    _cached(tmp_path, "vulkan")  # once built, auto serves it
    assert embedded.resolve("auto", detection=radv, log=said.append)[0].flavour == "vulkan"


@pytest.mark.parametrize("key", ["flavour", "backend"])  # backend: its old name, still read
def test_the_flavour_key_is_validated_under_the_name_the_file_gives_it(tmp_path, key):
    (tmp_path / "p.toml").write_text(f'[embedded]\n{key} = "metal"\n')
    with pytest.raises(ConfigError, match=rf"embedded\.{key}\b") as err:
        load_config(tmp_path / "p.toml", env={})
    assert "p.toml:2:" in str(err.value) and "auto, cpu, vulkan, rocm, cuda" in str(err.value)
    assert EmbeddedConfig().flavour == "auto"


def test_the_old_name_of_the_flavour_key_still_loads_and_says_it_is_deprecated(tmp_path, caplog):
    # A build was called a backend in [embedded] and on the command line; a backend is a runtime.
    # The old spellings stay: a configuration contract only grows.
    (tmp_path / "old.toml").write_text('[embedded]\nbackend = "cpu"\n')
    (tmp_path / "new.toml").write_text('[embedded]\nflavour = "cpu"\n')
    assert load_config(tmp_path / "new.toml", env={}).embedded.flavour == "cpu" and not caplog.records
    assert load_config(tmp_path / "old.toml", env={}).embedded.flavour == "cpu"
    assert "[embedded] backend is deprecated; it is called flavour now" in caplog.text
    assert load_config(None, env={"PASSERELLE_EMBEDDED_BACKEND": "vulkan"}).embedded.flavour == "vulkan"
    assert load_config(None, env={"PASSERELLE_EMBEDDED_FLAVOUR": "rocm"}).embedded.flavour == "rocm"
    assert load_config(None, env={"PASSERELLE_EMBEDDED_FLAVOUR": "rocm",  # the new name wins
                                  "PASSERELLE_EMBEDDED_BACKEND": "vulkan"}).embedded.flavour == "rocm"
    (tmp_path / "both.toml").write_text('[embedded]\nflavour = "cpu"\nbackend = "vulkan"\n')
    with pytest.raises(ConfigError, match=r"embedded\.backend.*old name of flavour") as err:
        load_config(tmp_path / "both.toml", env={})
    assert "both.toml:3:" in str(err.value)


@pytest.mark.parametrize("option", ["--flavour", "--backend"])  # --backend: its old name, still taken
def test_setup_takes_the_flavour_under_either_name(option, capsys):
    from passerelle.cli import build_parser

    assert build_parser().parse_args(["setup", option, "vulkan"]).flavour == "vulkan"
    said = capsys.readouterr().err
    assert ("--backend is deprecated; it is called --flavour now" in said) == (option == "--backend")
    assert build_parser().parse_args(["setup"]).flavour == "auto"


def test_runtime_list_shows_the_flavour():
    body = orjson.dumps({"runtimes": [{"name": "local", "kind": "llama-server", "flavour": "vulkan", "state": "ready",
                                       "pid": 7, "up": True, "in_flight": 0, "restarts": 0, "url": "http://x"}]})
    header, row = render(body).splitlines()[:2]
    assert "FLAVOUR" in header and row.split()[:3] == ["local", "llama-server", "vulkan"]


def _recorded(tmp_path: Path, key: str, info: dict) -> None:
    _cached(tmp_path, key)
    folder = tmp_path / "llama.cpp" / f"{embedded.BUILD_ID}-{key}"
    (folder / "build-info.json").write_text(json.dumps(info))


def test_bench_flavours_launches_each_build_as_the_embedded_runtime_would(tmp_path, monkeypatch):
    monkeypatch.setenv("PASSERELLE_CACHE", str(tmp_path))
    _tools(tmp_path, monkeypatch, vulkaninfo=_printing(LAVAPIPE_ONLY))
    _recorded(tmp_path, "cpu-avx2", {"flavour": "cpu-avx2", "flags": " ".join(flavours.CPU_FLAGS)})  # an older record
    _recorded(tmp_path, "vulkan", {"flavour": "vulkan", "kind": "vulkan", "flags": "-DGGML_VULKAN=ON"})
    model = tmp_path / "m.gguf"
    launches = {x["name"]: x for x in embedded.flavour_launches(model, alias="m", slots=2, ctx_per_slot=512)}
    assert set(launches) == {"cpu-avx2", "vulkan"}
    vk, cpu = launches["vulkan"], launches["cpu-avx2"]
    assert vk["env"] == ("GGML_VK_VISIBLE_DEVICES=0",) and vk["command"][vk["command"].index("-ngl") + 1] == "99"
    assert vk["driver"] == "llvmpipe (LLVM 15.0.6, 256 bits) (llvmpipe)"
    assert cpu["env"] == () and "-ngl" not in cpu["command"] and cpu["info"]["kind"] == "cpu"
    assert cpu["command"][cpu["command"].index("-c") + 1] == "1024"  # the same slots × context for each
    assert [x["name"] for x in embedded.flavour_launches(model, alias="m", slots=1, ctx_per_slot=512,
                                                         wanted=["vulkan"])] == ["vulkan"]
    with pytest.raises(ValueError, match="passerelle setup --flavour rocm"):
        embedded.flavour_launches(model, alias="m", slots=1, ctx_per_slot=512, wanted=["rocm"])


@pytest.mark.parametrize("command", ["flavours", "backends"])  # backends: its old name, still taken
def test_bench_flavours_without_a_build_says_how_to_make_one(tmp_path, monkeypatch, capsys, command):
    from passerelle.cli import main

    monkeypatch.setenv("PASSERELLE_CACHE", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert main(["bench", command, "--model-file", str(model), "--out", str(tmp_path / "out")]) == 2
    said = capsys.readouterr().err
    assert "passerelle setup --flavour" in said
    assert ("`bench backends` is deprecated; it is called `bench flavours` now" in said) == (command == "backends")


def test_driver_descriptions_come_from_the_machines_tools(tmp_path, monkeypatch):
    _tools(tmp_path, monkeypatch, rocminfo=_printing(ROCMINFO),
           nvidia_smi='echo "NVIDIA H200, 570.124.06"')
    assert flavours.driver_description("rocm") == "ROCm, gfx1151"
    assert flavours.driver_description("cuda") == "NVIDIA H200, 570.124.06"
    assert flavours.driver_description("vulkan") == "no Vulkan device listed"
    assert flavours.driver_description("cpu") == "CPU (no GPU driver)"


def test_serving_a_flavour_that_cannot_be_built_here_is_a_configuration_error(tmp_path, monkeypatch):
    cfg = _embedded_cfg(tmp_path, monkeypatch, "cuda")
    _tools(tmp_path, monkeypatch, cmake="exit 0", **{"g++": "exit 0"})
    monkeypatch.setattr(prerequisites, "_CUDA_INCLUDES", (str(tmp_path / "none"),))
    with pytest.raises(ConfigError, match=r"embedded\.flavour") as err:
        factory.embedded_backends(cfg)
    assert "sudo apt-get install nvidia-cuda" in str(err.value)  # the toolkit, its cuBLAS, or both
