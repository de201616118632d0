"""Peers installed for a comparison, each in a virtualenv of its own, never a project dependency.

``tool_venv("vllm-router", "vllm-router==0.1.17")`` creates ``~/.cache/passerelle/bench/vllm-router``
on first use (minutes, once; the log beside it) and returns it; a stamp file records the spec, so a
changed spec reinstalls. A file lock makes two benchmarks that ask at once install it once.

    venv = tool_venv("smg", "smg==1.13.0")
    exe = venv / "bin" / "smg"
    version("smg", venv)   # '1.13.0'
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

ROOT = Path.home() / ".cache" / "passerelle" / "bench"


def tool_venv(name: str, spec: str, root: Path = ROOT) -> Path:
    venv, stamp = root / name, root / name / ".passerelle-bench-installed"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if stamp.exists() and stamp.read_text().strip() == spec:
            return venv
        base = getattr(sys, "_base_executable", None) or sys.executable
        print(f"installing {spec} into {venv} (once; log in {venv}.install.log) ...", flush=True)
        with open(f"{venv}.install.log", "wb") as log:
            subprocess.run([base, "-m", "venv", "--clear", str(venv)], check=True, stdout=log,
                           stderr=subprocess.STDOUT, timeout=300)
            subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", spec], check=True, stdout=log,
                           stderr=subprocess.STDOUT, timeout=1800)
        stamp.write_text(spec + "\n")
        return venv


def version(package: str, venv: Path) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.metadata as m;"
                          f"print(m.version({package!r}))"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "?"
