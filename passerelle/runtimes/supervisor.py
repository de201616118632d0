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
from typing import Any, Protocol

from passerelle.config import RuntimesConfig, budget_share
from passerelle.errors import PasserelleError
from passerelle.paths import state_dir
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.memory import MemoryBook, Reading, command_key, device_used, machine_gib, measure

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


class Watcher(Protocol):
    """What else a runtime's health needs besides its own process (a split's members, rpc.py):
    asked before each launch, told when it is ready, run beside it while it serves (its verdict
    kills the process), told when it died and when it was stopped."""

    async def before_launch(self, timeout_s: float) -> None: ...  # raises RuntimeFailed
    def ready(self) -> None: ...
    async def guard(self) -> str: ...  # returns a cause once the runtime cannot serve any more
    async def exited(self, code: int | None) -> None: ...
    def stopped(self) -> None: ...
    def describe(self) -> dict[str, Any]: ...


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]  # (host, port) for AF_INET
        return port


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
        self.on_exit: Callable[[], None] | None = None  # it died: memory it held is free again
        self.ready_at = 0.0  # monotonic time it last became ready (residency)
        self.load_s = 0.0  # how long its last start took, launch to ready
        self.reading: Reading | None = None  # its measured memory, this run (None until measured)
        self.device_before: int | None = None  # GPUs' used memory just before its launch, until measured
        self.watcher: Watcher | None = None  # what else its health needs (a split's members)

    @property
    def pid(self) -> int | None:
        """The running process's id; None before a start and once it exited."""
        return self.proc.pid if self.proc and self.proc.returncode is None else None

    @property
    def restarting(self) -> bool:
        """Crashed, and its monitor is bringing it back."""
        return (self.state is ProcState.FAILED and self.restart and not self._stopping
                and self._monitor is not None and not self._monitor.done())

    @property
    def holds_memory(self) -> bool:
        """Loaded, loading, draining, or coming back after a crash: counts against the budget."""
        return (self.state in (ProcState.STARTING, ProcState.READY, ProcState.STOPPING)) or self.restarting

    @property
    def stopping(self) -> bool:
        """A stop is under way (asked for, not finished)."""
        return self._stopping and self.state is not ProcState.STOPPED

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
        t0 = time.monotonic()
        if self.watcher is not None:
            try:
                await self.watcher.before_launch(self.ready_timeout_s)
            except RuntimeFailed:
                self._set(ProcState.FAILED)
                raise
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
                    self.ready_at = time.monotonic()
                    self.load_s = self.ready_at - t0
                    self._set(ProcState.READY)
                    if self.watcher is not None:
                        self.watcher.ready()
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
            code = await self._wait_exit()
            if self._stopping:
                return
            self.backend.stats.up = False
            self._set(ProcState.FAILED)
            self.reading = None
            if self.watcher is not None:
                await self.watcher.exited(code)
            log.error("runtime %s exited with code %s; last output:\n%s", self.backend.name, code, self.log_tail(5))
            if not self.restart:
                if self.on_exit is not None:
                    self.on_exit()
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

    async def _wait_exit(self) -> int:
        """The process's exit; with a watcher, also its verdict: a runtime that cannot serve any
        more (a split's member gone) is killed at once, so its streams end instead of hanging."""
        proc = self.proc
        assert proc is not None
        if self.watcher is None:
            return await proc.wait()
        exit_ = asyncio.ensure_future(proc.wait())
        guard = asyncio.create_task(self.watcher.guard(), name=f"guard-{self.backend.name}")
        try:
            await asyncio.wait({exit_, guard}, return_when=asyncio.FIRST_COMPLETED)
            if not exit_.done() and not self._stopping:
                cause = guard.result() if not guard.cancelled() and guard.exception() is None else "its guard failed"
                log.error("runtime %s: killed, it cannot serve: %s", self.backend.name, cause)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            return await exit_
        finally:
            guard.cancel()
            exit_.cancel()

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
            self.reading = None
            self._set(ProcState.STOPPED)
            if self.watcher is not None:
                self.watcher.stopped()
        finally:
            self._stopped.set_result(None)
            self._stopped = None


def estimate_gib(command: tuple[str, ...]) -> float:
    """What a runtime needs loaded, guessed from the model file in its command line (GGUF size
    plus a margin for the KV cache and buffers); 1 GiB when no model file can be found. Used
    until the runtime has run once and its memory was measured."""
    for flag in ("-m", "--model"):
        if flag in command:
            i = command.index(flag)
            if i + 1 < len(command):
                try:
                    return os.path.getsize(command[i + 1]) / 2**30 * 1.2 + 0.25
                except OSError:
                    break
    return 1.0


class NoRoom(RuntimeFailed):
    """A start that does not fit in the memory budget now."""


def budget_gib(rt: RuntimesConfig) -> float:
    """The memory budget in GiB: ``max_loaded_gib``, or ``max_loaded`` (a share) of the machine."""
    share = budget_share(rt.max_loaded) if rt.max_loaded else None
    if share is None:
        return rt.max_loaded_gib
    total = machine_gib(rt.memory)
    log.info("memory budget: %s of %.1f GiB (%s) = %.1f GiB", rt.max_loaded, total, rt.memory, share * total)
    return share * total


class Supervisor:
    """All launched runtimes of one gateway: start at boot or on demand, stop when idle, stay
    within the memory budget (``[runtimes] max_loaded_gib``), and never start one twice.

    What to stop to make room for what is the scheduler's decision (``scheduling/swap.py``); the
    supervisor keeps the books: what each runtime needs (measured once it ran, else configured,
    else estimated), what is loaded, and whether a start fits. ``on_change`` is called whenever
    memory may have been freed or a runtime became ready (a stop, a crash, an idle stop, a ready),
    so that deferred starts are retried at once.
    """

    MEASURE_EVERY_S = 15.0  # re-read a loaded runtime's memory (it grows: caches, lazy pages)

    def __init__(self, processes: list[RuntimeProcess], runtimes: RuntimesConfig, *,
                 book: MemoryBook | None = None, on_ready: Callable[[], None] | None = None) -> None:
        self.processes = {p.backend.name: p for p in processes}
        # Processes of backends a reload removed or replaced: no longer under their name, still to stop.
        self.retiring: set[RuntimeProcess] = set()
        self.runtimes: RuntimesConfig | None = None
        self.configure(runtimes)
        self.book = book or MemoryBook(None)
        self.on_ready = on_ready  # a runtime became ready: queued requests may go
        self.on_change: Callable[[], None] | None = None  # memory freed or a runtime ready: re-plan
        self._lock = asyncio.Lock()  # one start decision at a time (budget, no double start)
        self._starting: dict[str, asyncio.Task[None]] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._measured_at: dict[str, float] = {}
        for p in processes:
            self.adopt(p)

    def configure(self, runtimes: RuntimesConfig) -> None:
        """The memory budget and what counts against it; runtimes loaded past a lowered budget
        stay until the swapper needs their room (a start is what the budget is checked against)."""
        if runtimes == self.runtimes:
            return  # (the machine's memory is read once for a share: not again for the same budget)
        self.runtimes = runtimes
        self.max_loaded_gib = budget_gib(runtimes)
        self.memory_kind = runtimes.memory

    def adopt(self, proc: RuntimeProcess) -> None:
        """Take ``proc`` under supervision (at start, or added by a reload)."""
        self.processes[proc.backend.name] = proc
        proc.on_exit = self._changed

    def get(self, name: str) -> RuntimeProcess | None:
        return self.processes.get(name)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def start_all(self) -> None:
        # runtimes started at boot are what the operator asked for: they are not held to the budget
        await asyncio.gather(*(self.start(p.backend.name, budget=False) for p in self.processes.values()
                               if not p.backend.cfg.on_demand))
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

    # -- memory books -------------------------------------------------------------------------
    def key(self, proc: RuntimeProcess) -> str:
        return command_key(proc.backend.name, proc.template)

    def estimated_gib(self, proc: RuntimeProcess) -> float:
        return estimate_gib(proc.template)

    def measured_gib(self, proc: RuntimeProcess) -> float | None:
        """Measured in this run, else learned in an earlier one; None if never measured."""
        if proc.reading is not None:
            return proc.reading.gib(self.memory_kind)
        learned = self.book.get(self.key(proc)).get(f"gib_{self.memory_kind}")
        return float(learned) if learned else None

    def need_gib(self, proc: RuntimeProcess) -> float:
        """What ``proc`` counts for in the budget: its measured memory (never less than a
        configured ``memory_gib``), else ``memory_gib``, else the file-size estimate."""
        configured = proc.backend.cfg.memory_gib
        measured = self.measured_gib(proc)
        if measured is not None:
            return max(configured, measured)
        return configured or self.estimated_gib(proc)

    def load_estimate_s(self, proc: RuntimeProcess) -> float | None:
        """How long a start of ``proc`` takes, from the last one (None: never started)."""
        if proc.load_s:
            return proc.load_s
        learned = self.book.get(self.key(proc)).get("load_s")
        return float(learned) if learned else None

    def loaded_gib(self, *, besides: RuntimeProcess | None = None) -> float:
        return sum(self.need_gib(p) for p in self.processes.values() if p is not besides and p.holds_memory)

    def free_gib(self) -> float:
        return self.max_loaded_gib - self.loaded_gib() if self.max_loaded_gib else float("inf")

    def fits(self, proc: RuntimeProcess) -> bool:
        if not self.max_loaded_gib or proc.holds_memory:
            return True
        return self.loaded_gib(besides=proc) + self.need_gib(proc) <= self.max_loaded_gib + 1e-9

    async def measure(self, proc: RuntimeProcess) -> Reading | None:
        """Read ``proc``'s memory now and learn it (the largest figure of this run is kept)."""
        pid = proc.pid
        if pid is None or proc.state is not ProcState.READY:
            return None
        # A device-wide delta is right once only: just after the start, under the start lock, so
        # that no other runtime loaded between the two readings. Read again later, it would charge
        # this runtime every runtime started since; its GPU share stays the one measured then.
        before, proc.device_before = proc.device_before, None
        reading = await asyncio.to_thread(measure, pid, device_before=before)
        if proc.state is not ProcState.READY or proc.pid != pid:
            return None  # stopped meanwhile: the figure may be half a process
        if reading.source == "proc" and proc.reading is not None and proc.reading.source == "device-delta":
            reading = Reading(reading.rss_bytes, proc.reading.gpu_bytes, "device-delta")
        if proc.reading is None or reading.gib("total") > proc.reading.gib("total"):
            first = proc.reading is None
            proc.reading = reading
            values = {f"gib_{k}": round(reading.gib(k), 4) for k in ("total", "ram", "gpu")}
            self.book.learn(self.key(proc), **values, load_s=round(proc.load_s, 3))
            if first:
                log.info("runtime %s: measured %.2f GiB (RAM %.2f, GPU %.2f via %s); estimated %.2f GiB",
                         proc.backend.name, reading.gib(self.memory_kind), reading.gib("ram"), reading.gib("gpu"),
                         reading.source, self.estimated_gib(proc))
        self._measured_at[proc.backend.name] = time.monotonic()
        return reading

    # -- starting and stopping ----------------------------------------------------------------
    def starting(self, name: str) -> bool:
        return name in self._starting

    async def start(self, name: str, *, evict_idle: bool = True, budget: bool = True) -> None:
        """Start ``name`` and wait until it is ready; a second call while it starts waits for the
        same start. It must fit in the budget: with ``evict_idle`` (an operator's start), idle
        runtimes are stopped to make room, least recently used first; without (the scheduler's
        start, which made room itself), :class:`NoRoom` is raised."""
        proc = self.processes[name]
        task = self._starting.get(name)
        if task is None:
            task = asyncio.create_task(self._start(proc, evict_idle, budget), name=f"start-{name}")
            self._starting[name] = task
            task.add_done_callback(lambda _t: self._starting.pop(name, None))
        await asyncio.shield(task)

    async def _start(self, proc: RuntimeProcess, evict_idle: bool, budget: bool) -> None:
        if proc.watcher is not None and proc.state is not ProcState.READY:
            # what it needs elsewhere first (a split's members), outside the start lock: a member
            # that is away must not hold up this box's other runtimes
            await proc.watcher.before_launch(proc.ready_timeout_s)
        async with self._lock:
            if proc.state is ProcState.READY and not proc.stopping:
                return
            while budget and not self.fits(proc):
                victim = self._idle_lru(besides=proc) if evict_idle else None
                if victim is None:
                    raise NoRoom(f"runtime {proc.backend.name} needs {self.need_gib(proc):.2f} GiB; "
                                 f"{self.loaded_gib():.2f} of {self.max_loaded_gib:g} GiB are held by other runtimes")
                log.info("runtime %s: stopping idle %s to make room (memory budget %g GiB)",
                         proc.backend.name, victim.backend.name, self.max_loaded_gib)
                await victim.stop()
            proc.device_before = await asyncio.to_thread(device_used)
            try:
                await proc.start()
            except RuntimeFailed:
                self._changed()  # what it reserved is free again
                raise
            await self.measure(proc)  # (alone: before another start may begin)
        if self.on_ready is not None:
            self.on_ready()
        self._changed()

    async def launch(self, proc: RuntimeProcess) -> None:
        """Start ``proc``, not under supervision yet (a reload's new runtime, beside the one it may
        replace under the same name), and wait until it is ready; :meth:`adopt` it then. Outside the
        budget, as at start-up: the operator asked for it. Raises RuntimeFailed, leaving no process."""
        async with self._lock:
            proc.device_before = await asyncio.to_thread(device_used)
            await proc.start()
            await self.measure(proc)

    def _idle_lru(self, *, besides: RuntimeProcess) -> RuntimeProcess | None:
        idle = [p for p in self.processes.values()
                if p is not besides and p.state is ProcState.READY and p.backend.in_flight == 0
                and not p.backend.cfg.persistent]
        return min(idle, key=lambda p: p.backend.last_used, default=None)

    async def stop(self, name: str) -> None:
        await self.processes[name].stop()
        self._changed()

    async def restart(self, name: str) -> None:
        await self.processes[name].stop()
        await self.start(name)

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for p in list(self.processes.values()):
                name = p.backend.name
                ttl = p.backend.cfg.idle_ttl_s
                if (ttl and not p.backend.cfg.persistent and p.state is ProcState.READY and p.backend.in_flight == 0
                        and now - p.backend.last_used >= ttl and name not in self._starting):
                    log.info("runtime %s: idle for %g s, stopping", name, ttl)
                    await self.stop(name)
                elif p.state is ProcState.READY and now - self._measured_at.get(name, 0.0) >= self.MEASURE_EVERY_S:
                    try:
                        await self.measure(p)
                    except Exception:  # a broken tool must not end the reaper
                        log.exception("measuring runtime %s failed", name)

    def describe(self) -> list[dict[str, object]]:
        now = time.monotonic()
        out: list[dict[str, object]] = []
        for name, p in self.processes.items():
            measured = self.measured_gib(p)
            r = p.reading
            out.append({
                "name": name, "kind": p.backend.kind, "flavour": p.backend.cfg.flavour or None,
                "state": p.state.value, "pid": p.pid, "url": p.backend.url,
                "restarts": p.restarts, "in_flight": p.backend.in_flight, "up": p.backend.stats.up,
                "on_demand": p.backend.cfg.on_demand, "persistent": p.backend.cfg.persistent,
                "models": list(p.backend.models), "need_gib": round(self.need_gib(p), 3),
                "estimated_gib": round(self.estimated_gib(p), 3),
                "configured_gib": p.backend.cfg.memory_gib or None,
                "measured_gib": None if measured is None else round(measured, 3),
                "measured_now": r is not None,
                "rss_gib": None if r is None else round(r.gib("ram"), 3),
                "gpu_gib": None if r is None else round(r.gib("gpu"), 3),
                "memory_source": None if r is None else r.source,
                "loaded": p.holds_memory, "fenced": p.backend.fenced,
                "resident_s": round(now - p.ready_at, 1) if p.state is ProcState.READY else None,
                "load_s": round(p.load_s, 2) if p.load_s else None,
                **p.backend.capacity_info.as_dict(),
                **({"split": p.watcher.describe()} if p.watcher is not None else {}),
                "log": str(p.log_path), "command": p.command or list(p.template)})
        return out

    def troubles(self) -> list[dict[str, object]]:
        """Runtimes out for a cause other than their own process (a split's member gone), named."""
        out: list[dict[str, object]] = []
        for name, p in self.processes.items():
            split = p.watcher.describe() if p.watcher is not None else None
            if split is not None and split.get("cause"):
                out.append({"runtime": name, "state": split["state"], "cause": split["cause"],
                            "since": split.get("since")})
        return out

    def budget(self) -> dict[str, object]:
        return {"max_loaded_gib": self.max_loaded_gib or None, "loaded_gib": round(self.loaded_gib(), 3),
                "memory": self.memory_kind}
