"""What the bench/ scripts share: the fake runtime and passerelle as services, the machine and its
load, the processes' CPU and memory, percentiles, and the head of every JSON report.

A script starts what it measures as :class:`Service` processes (a log file each in its work
folder, stopped with SIGTERM, killed if they linger), reads their CPU and RSS from /proc (the
whole process tree: a proxy may run workers), and says on what machine and under what load its
figures were taken, so that two runs can be compared honestly. The streaming load client is in
loadgen.py.

    from harness import start_fake, start_passerelle

    fake = start_fake(work, ttft_ms=50, itl_ms=10, tokens=32)
    gw = start_passerelle(work, fake.url)  # "[[backends]] fake", max_concurrency 1024
    gw.wait_ready("/ready", 60)
    try:
        c0 = cpu_s(gw.pids)
        ...  # the load
        print(f"gateway CPU {cpu_s(gw.pids) - c0:.2f} s")
    finally:
        gw.stop()
        fake.stop()

The bench/ scripts run as ``python bench/NAME.py``, so this folder is first on their import path.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from passerelle.bench.stats import percentile
from passerelle.procfs import process_tree as tree
from passerelle.runtimes.memory import rss_bytes
from passerelle.runtimes.supervisor import free_port

# The project's own, one definition each: free_port(); tree(pid), a process and all its descendants
# (LiteLLM may run workers; passerelle runs one process); rss_bytes(pids), their resident memory
# summed (the supervisor measures its runtimes so).
__all__ = ["free_port", "rss_bytes", "tree"]

ROOT = Path(__file__).resolve().parent.parent
MODEL = "fake-model"
MASTER_KEY = "sk-bench-" + "5a" * 16  # LiteLLM refuses to start without one; passerelle ignores it
TICKS = os.sysconf("SC_CLK_TCK")
WORK = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "passerelle" / "bench"


# --- processes: CPU and memory from /proc --------------------------------------------------------
def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) these processes have used so far; gone ones count 0."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime
    return total


def own_cpu_s(children: bool = False) -> float:
    """This process's CPU seconds (the load generator's own cost); with ``children``, plus those of
    its waited-for child processes (a generator that forks workers)."""
    usages = [resource.RUSAGE_SELF, *([resource.RUSAGE_CHILDREN] if children else [])]
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, usages))


# --- the machine and its load --------------------------------------------------------------------
def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def cpu_pressure() -> float | None:
    """Share of the last 10 s in which some runnable task waited for a CPU (Linux PSI), percent."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        return float(Path("/proc/pressure/cpu").read_text().split()[1].split("=")[1])
    return None


def settle(pids: list[int], limit_s: float = 20.0) -> float:
    """Wait until these processes are nearly idle (below 10 % of a core over 0.3 s), so that one
    target's backlog (a proxy still streaming answers its clients gave up on) does not run into the
    next target's round. Returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        c0 = cpu_s(pids)
        time.sleep(0.3)
        if cpu_s(pids) - c0 < 0.03:
            break
    return time.monotonic() - t0


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


# --- figures and reports -------------------------------------------------------------------------
def pct(xs: Sequence[float], p: float) -> float:
    """Percentile with linear interpolation between order statistics (``passerelle bench``'s own);
    NaN for no values."""
    return percentile(sorted(xs), p) if xs else float("nan")


def median(xs: Sequence[float]) -> float:
    return pct(xs, 50)


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None or x != x:  # None or NaN
        return "–"
    return f"{x:,.{digits}f}"


def report_head(benchmark: str) -> dict[str, Any]:
    """The fields a bench JSON report starts with: what ran, when, on what machine, how loaded.
    The script adds its settings and figures after them."""
    return {"benchmark": benchmark, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
            "loadavg_start": loadavg(), "cpu_pressure_start": cpu_pressure()}


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


# --- services ------------------------------------------------------------------------------------
class NotReady(RuntimeError):
    pass


def until_ok(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> str | None:
    """Ask ``url`` until it answers 200: None once it has, else why not (``proc``, the server's
    process, exited; or the time ran out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            req = urllib.request.Request(url, headers={"Authorization": f"Bearer {MASTER_KEY}"})
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return None
        except OSError:
            time.sleep(0.1)
    return f"not ready after {timeout:.0f} s"


def wait_http(url: str, timeout: float = 120) -> None:
    """Until ``url`` answers 200 (a runtime or gateway started elsewhere); exits the script if not."""
    if until_ok(url, timeout) is not None:
        raise SystemExit(f"{url} not ready")


@dataclass
class Service:
    """A process a bench script started: its base URL, its log, its process tree."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pids(self) -> list[int]:
        return tree(self.proc.pid)

    def wait_ready(self, path: str, timeout: float) -> None:
        """Until ``path`` answers 200; :class:`NotReady` if the process exits or time runs out."""
        why = until_ok(self.url + path, timeout, self.proc)
        if why is not None:
            raise NotReady(f"{self.name} {why}; see {self.log}")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` (a gateway stops the runtimes it launched
        within its own grace: give it that long)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(name: str, argv: list[str], work: Path, env: dict[str, str] | None = None, url: str = "") -> Service:
    log = work / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=work,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return Service(name, url, proc, log)


def source_env(src: Path | None) -> dict[str, str]:
    """The environment that runs ``python -m passerelle`` from the source tree ``src`` (an A/B
    against another copy); none for the installed one."""
    if src is None:
        return {}
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(src.resolve()), os.environ.get("PYTHONPATH")]))}


def start_fake(work: Path, ttft_ms: float, itl_ms: float, tokens: int, tag: str = "fake", *,
               extra: Sequence[str] = (), src: Path | None = None, slots: int = 0) -> Service:
    """``passerelle fake-backend`` on a free port, ready; ``extra``: more of its flags (faults);
    ``slots``: it runs that many streams at once and queues the rest (0: no limit)."""
    port = free_port()
    svc = spawn(tag, [sys.executable, "-m", "passerelle", "fake-backend", "--port", str(port), "--ttft-ms",
                      str(ttft_ms), "--itl-ms", str(itl_ms), "--tokens", str(tokens), "--model", MODEL,
                      *(["--slots", str(slots)] if slots else []), *extra],
                work, env=source_env(src), url=f"http://127.0.0.1:{port}")
    svc.wait_ready("/health", 30)
    return svc


def start_passerelle(work: Path, backend_url: str, extra_toml: str = "", *, name: str = "passerelle",
                     src: Path | None = None, env: dict[str, str] | None = None, upstream: str = "") -> Service:
    """passerelle from this checkout, or from the source tree ``src`` (an A/B against another copy),
    in front of one OpenAI-compatible backend (the fake) that queues nothing. ``upstream``: instead
    of a configuration, ``passerelle serve --upstream [KIND=]URL`` with no max_concurrency
    ("detect": the kind it detects; else the KIND to force, e.g. "openai")."""
    if upstream:
        port = free_port()
        state = work / f"{name}-state"
        shutil.rmtree(state, ignore_errors=True)
        spec = backend_url if upstream == "detect" else f"{upstream}={backend_url}"
        return spawn(name, [sys.executable, "-m", "passerelle", "serve", "--upstream", spec, "--port", str(port)],
                     work, env={"PASSERELLE_STATE": str(state), **(env or {}), **source_env(src)},
                     url=f"http://127.0.0.1:{port}")
    cfg = work / f"{name}.toml"
    cfg.write_text(f"{extra_toml}\n{fake_backend_toml(backend_url)}")
    return serve(work, cfg, name=name, src=src, env=env)


def fake_backend_toml(backend_url: str) -> str:
    """The configuration of passerelle's one backend in the overhead benchmark: the fake, an
    ``openai`` runtime that queues nothing (``max_concurrency`` 1024)."""
    return f"""[[backends]]
name = "fake"
kind = "openai"
url = "{backend_url}"
models = ["{MODEL}"]
max_concurrency = 1024
"""


def serve(work: Path, config: Path, *, name: str = "passerelle", src: Path | None = None,
          env: dict[str, str] | None = None) -> Service:
    """``passerelle serve --config CONFIG`` on a free port, with a fresh state folder (not yet
    ready: call ``wait_ready("/ready", ...)``, so that several start side by side)."""
    port = free_port()
    state = work / f"{name}-state"
    shutil.rmtree(state, ignore_errors=True)
    extra_env = {"PASSERELLE_STATE": str(state), **(env or {}), **source_env(src)}
    return spawn(name, [sys.executable, "-m", "passerelle", "serve", "--config", str(config), "--port", str(port)],
                 work, env=extra_env, url=f"http://127.0.0.1:{port}")


@contextlib.contextmanager
def fake_and_passerelle(work: Path, ttft_ms: float, itl_ms: float, tokens: int, extra_toml: str = "", *,
                        src: Path | None = None) -> Iterator[tuple[Service, Service]]:
    """The fake runtime and passerelle in front of it, both ready; both stopped on the way out."""
    fake = start_fake(work, ttft_ms, itl_ms, tokens)
    gw = None
    try:
        gw = start_passerelle(work, fake.url, extra_toml, src=src)
        gw.wait_ready("/ready", 60)
        yield fake, gw
    finally:
        if gw is not None:
            gw.stop()
        fake.stop()
