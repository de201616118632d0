"""Runtime processes that passerelle launches itself, each with an explicit state machine.

    STOPPED ──start──► STARTING ──health ok──► READY ──stop──► STOPPING ──► STOPPED
                          │    ▲                 │                 ▲
                          │    └──backoff──┐     │                 │
                          └──exit / no health──► FAILED ◄──crash───┘──stop (from STARTING, FAILED)

Every transition is checked against ``_ALLOWED``: one that is not there is a bug and raises.
STOPPING is the process being stopped (SIGTERM, then SIGKILL after the grace); it is not the
*draining* of a backend removed by a reload (``Backend.draining``: it finishes its requests first,
then its process is stopped).

A child runs in its own process group, so stopping it also stops anything it spawned, and on
Linux asks the kernel to kill it if passerelle dies (``PR_SET_PDEATHSIG``), so that not even a
``kill -9`` of the gateway leaves an orphan holding the model in memory.

Example::

    proc = RuntimeProcess(backend, ("llama-server", "-m", "m.gguf", "--port", "{port}"))
    await proc.start()     # returns once /health answers; backend.url points at it
    await proc.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from passerelle.errors import PasserelleError
from passerelle.paths import state_dir
from passerelle.runtimes.kinds import Backend

log = logging.getLogger("passerelle.runtimes.supervisor")

_PR_SET_PDEATHSIG = 1


class ProcState(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


_ALLOWED = {
    ProcState.STOPPED: {ProcState.STARTING},
    ProcState.STARTING: {ProcState.READY, ProcState.FAILED, ProcState.STOPPING},
    ProcState.READY: {ProcState.STOPPING, ProcState.FAILED},
    ProcState.FAILED: {ProcState.STARTING, ProcState.STOPPING},
    ProcState.STOPPING: {ProcState.STOPPED},
}


class RuntimeFailed(PasserelleError):
    """A runtime process exited or never became ready."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _child_setup() -> None:  # runs in the child between fork and exec
    # Its own process group, stopped as a whole; but not its own session: on Linux a new session
    # is a new scheduler autogroup, and a runtime that busy-waits (vLLM's engine) would then
    # starve the gateway on a small machine.
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class RuntimeProcess:
    def __init__(self, backend: Backend, command: tuple[str, ...], *, log_path: Path | None = None,
                 ready_timeout_s: float = 600.0, restart: bool = True) -> None:
        self.backend = backend
        backend.supervised = True
        self.template = command
        self.log_path = log_path or state_dir() / "logs" / f"{backend.name}.log"
        self.ready_timeout_s = ready_timeout_s
        self.restart = restart
        self.state = ProcState.STOPPED
        self.proc: asyncio.subprocess.Process | None = None
        self.port = 0
        self.restarts = 0
        self.command: list[str] = []
        self._monitor: asyncio.Task[None] | None = None
        self._stopping = False
        self._stopped: asyncio.Future[None] | None = None  # while a stop() runs: done when it ends
        self.on_ready: Callable[[], None] | None = None  # after a restart: queued requests may go

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _set(self, state: ProcState) -> None:
        if state is self.state:
            return
        if state not in _ALLOWED[self.state]:
            raise RuntimeError(f"runtime {self.backend.name}: illegal transition {self.state.name} -> {state.name}")
        log.info("runtime %s: %s -> %s", self.backend.name, self.state.value, state.value)
        self.state = state

    async def start(self) -> None:
        """Launch and wait until the runtime's health endpoint answers; raise RuntimeFailed.
        A stop still in progress is waited for first."""
        if self._stopped is not None:
            await asyncio.shield(self._stopped)
        if self.state is ProcState.READY:
            return
        self._stopping = False
        await self._launch()
        self._monitor = asyncio.create_task(self._watch(), name=f"supervise-{self.backend.name}")

    async def _launch(self) -> None:
        """One launch; the process is killed again if the launch does not end READY (failed,
        stopped or cancelled meanwhile), so no attempt leaves a process behind."""
        self._set(ProcState.STARTING)
        try:
            await self._spawn_and_wait()
        except BaseException:
            await asyncio.shield(self._kill(grace=2.0))
            raise

    async def _spawn_and_wait(self) -> None:
        self.port = free_port()
        self.command = [part.replace("{port}", str(self.port)) for part in self.template]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            logf.write(f"\n=== {time.strftime('%F %T')} {' '.join(self.command)}\n".encode())
            logf.flush()
            self.proc = await asyncio.create_subprocess_exec(
                *self.command, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf,
                preexec_fn=_child_setup)
        except OSError as exc:
            self._set(ProcState.FAILED)
            raise RuntimeFailed(f"cannot start runtime {self.backend.name}: {exc}") from exc
        finally:
            logf.close()
        self.backend.set_url(f"http://127.0.0.1:{self.port}")
        await self.backend.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._stopping:
                raise RuntimeFailed(f"runtime {self.backend.name} was stopped while starting")
            if self.proc.returncode is not None:
                self._set(ProcState.FAILED)
                raise RuntimeFailed(f"runtime {self.backend.name} exited with code {self.proc.returncode} "
                                    f"while starting; last lines of {self.log_path}:\n{self.log_tail()}")
            if await self.backend.check_health(timeout=1.0):
                await self.backend.scrape()
                if not self._stopping:  # (else: raised at the top of the loop)
                    self._set(ProcState.READY)
                    return
                continue
            await asyncio.sleep(0.1)
        if self._stopping:
            raise RuntimeFailed(f"runtime {self.backend.name} was stopped while starting")
        self._set(ProcState.FAILED)
        raise RuntimeFailed(f"runtime {self.backend.name} was not ready after {self.ready_timeout_s:g} s")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def _watch(self) -> None:
        """Restart a crashed runtime with exponential backoff (1 s, 2 s, 4 s … 30 s)."""
        backoff = 1.0
        while True:
            assert self.proc is not None
            code = await self.proc.wait()
            if self._stopping:
                return
            self.backend.stats.up = False
            self._set(ProcState.FAILED)
            log.error("runtime %s exited with code %s; last output:\n%s", self.backend.name, code, self.log_tail(5))
            if not self.restart:
                return
            while not self._stopping:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
                try:
                    await self._launch()
                    self.restarts += 1
                    backoff = 1.0
                    if self.on_ready is not None:
                        self.on_ready()
                    break
                except RuntimeFailed as exc:
                    log.error("%s", exc)

    async def _kill(self, grace: float = 10.0) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL after ``grace``; STOPPED once it is gone. A second
        call while one runs waits for it."""
        if self._stopped is not None:
            await asyncio.shield(self._stopped)
            return
        self._stopping = True
        if self.state is ProcState.STOPPED:
            return
        self._stopped = asyncio.get_running_loop().create_future()
        try:
            self._set(ProcState.STOPPING)
            if self._monitor is not None:
                self._monitor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._monitor
            await self._kill(grace)
            self.backend.stats.up = False
            self._set(ProcState.STOPPED)
        finally:
            self._stopped.set_result(None)
            self._stopped = None


def estimate_gib(command: tuple[str, ...]) -> float:
    """What a runtime needs loaded, from the model file in its command line (GGUF size plus a
    margin for the KV cache and buffers); 1 GiB when no model file can be found."""
    for flag in ("-m", "--model"):
        if flag in command:
            i = command.index(flag)
            if i + 1 < len(command):
                try:
                    return os.path.getsize(command[i + 1]) / 2**30 * 1.2 + 0.25
                except OSError:
                    break
    return 1.0


class Supervisor:
    """All launched runtimes of one gateway: start at boot or on demand, stop when idle, stay
    within the memory budget (``[runtimes] max_loaded_gib``), and never start one twice."""

    def __init__(self, processes: list[RuntimeProcess], *, max_loaded_gib: float = 0.0,
                 on_ready: Callable[[], None] | None = None) -> None:
        self.processes = {p.backend.name: p for p in processes}
        # Processes of backends a reload removed or replaced: no longer under their name, still to stop.
        self.retiring: set[RuntimeProcess] = set()
        self.max_loaded_gib = max_loaded_gib
        self.on_ready = on_ready  # a runtime became ready: queued requests may go
        self._lock = asyncio.Lock()  # one start decision at a time (budget, no double start)
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._reaper: asyncio.Task[None] | None = None

    def get(self, name: str) -> RuntimeProcess | None:
        return self.processes.get(name)

    async def start_all(self) -> None:
        await asyncio.gather(*(p.start() for p in self.processes.values() if not p.backend.cfg.on_demand))
        self._reaper = asyncio.create_task(self._reap_idle(), name="passerelle-idle-reaper")

    async def stop_all(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for task in self._starting.values():
            task.cancel()
        await asyncio.gather(*(p.stop() for p in [*self.processes.values(), *self.retiring]), return_exceptions=True)

    async def retire(self, proc: RuntimeProcess) -> None:
        """Stop ``proc`` for good (its backend left the configuration, or was replaced by a new
        process under the same name): it is not restarted, and it leaves ``processes`` unless its
        name now belongs to its replacement."""
        self.retiring.add(proc)
        try:
            await proc.stop()
        finally:
            self.retiring.discard(proc)
            if self.processes.get(proc.backend.name) is proc:
                del self.processes[proc.backend.name]

    def need_gib(self, proc: RuntimeProcess) -> float:
        return proc.backend.cfg.memory_gib or estimate_gib(proc.template)

    def loaded_gib(self, *, besides: RuntimeProcess | None = None) -> float:
        return sum(self.need_gib(p) for p in self.processes.values()
                   if p is not besides and p.state in (ProcState.STARTING, ProcState.READY, ProcState.FAILED)
                   and not p._stopping)

    async def start(self, name: str) -> None:
        """Start ``name`` (within the budget) and wait until it is ready; a second call while it
        starts waits for the same start."""
        proc = self.processes[name]
        task = self._starting.get(name)
        if task is None:
            task = asyncio.create_task(self._start(proc), name=f"start-{name}")
            self._starting[name] = task
            task.add_done_callback(lambda _t: self._starting.pop(name, None))
        await asyncio.shield(task)

    async def _start(self, proc: RuntimeProcess) -> None:
        async with self._lock:
            if proc.state is ProcState.READY and not proc._stopping:
                return
            if self.max_loaded_gib:
                need = self.need_gib(proc)
                while self.loaded_gib(besides=proc) + need > self.max_loaded_gib:
                    victim = self._idle_lru(besides=proc)
                    if victim is None:
                        raise RuntimeFailed(
                            f"runtime {proc.backend.name} needs {need:.1f} GiB; {self.loaded_gib():.1f} of "
                            f"{self.max_loaded_gib:g} GiB are held by busy runtimes")
                    log.info("runtime %s: stopping idle %s to make room (memory budget %g GiB)",
                             proc.backend.name, victim.backend.name, self.max_loaded_gib)
                    await victim.stop()
            await proc.start()
        if self.on_ready is not None:
            self.on_ready()

    def _idle_lru(self, *, besides: RuntimeProcess) -> RuntimeProcess | None:
        idle = [p for p in self.processes.values()
                if p is not besides and p.state is ProcState.READY and p.backend.in_flight == 0]
        return min(idle, key=lambda p: p.backend.last_used, default=None)

    def request_start(self, pool: list[Backend]) -> None:
        """A request waits for ``pool``: start one of its stopped on-demand runtimes, once."""
        if any(b.stats.up or b.name in self._starting for b in pool):
            return
        for b in pool:
            proc = self.processes.get(b.name)
            if proc is not None and b.cfg.on_demand and proc.state in (ProcState.STOPPED, ProcState.FAILED):
                task = asyncio.ensure_future(self.start(b.name))
                task.add_done_callback(_log_failure)
                return

    async def stop(self, name: str) -> None:
        await self.processes[name].stop()

    async def restart(self, name: str) -> None:
        await self.processes[name].stop()
        await self.start(name)

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for p in self.processes.values():
                ttl = p.backend.cfg.idle_ttl_s
                if (ttl and p.state is ProcState.READY and p.backend.in_flight == 0
                        and now - p.backend.last_used >= ttl and p.backend.name not in self._starting):
                    log.info("runtime %s: idle for %g s, stopping", p.backend.name, ttl)
                    await p.stop()

    def describe(self) -> list[dict[str, object]]:
        return [{"name": name, "kind": p.backend.kind, "state": p.state.value, "pid": p.pid, "url": p.backend.url,
                 "restarts": p.restarts, "in_flight": p.backend.in_flight, "up": p.backend.stats.up,
                 "on_demand": p.backend.cfg.on_demand, "need_gib": round(self.need_gib(p), 2),
                 "log": str(p.log_path), "command": p.command or list(p.template)}
                for name, p in self.processes.items()]


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("on-demand start failed: %s", task.exception())
