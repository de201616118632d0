"""Loading and unloading models as the queue asks: the swap decision (swap.py), carried out.

The swapper looks at the scheduler's queue whenever something may have changed (a request left
waiting, a slot released, a runtime stopped, crashed or became ready, a residency ran out) and
carries out :func:`~passerelle.scheduling.swap.decide`'s plan, one at a time:

    fence the runtimes to unload (no new request goes to them; their queued ones wait)
    → wait for their running requests to end (at most ``drain_timeout_s``)
    → stop them → start the needed runtime → the scheduler dispatches its waiting requests

A start that does not fit is never just logged: it stays a demand and is decided again on every
release and stop, so it happens as soon as memory frees. A start that fails ends the requests
that only that runtime could serve (503 ``no_backend``), and the runtime is not tried again for a
few seconds (doubling up to a minute). Every swap is counted and logged with its reason, what it
unloaded, how long the drain and the load took.

Example::

    swapper = Swapper(scheduler, supervisor, cfg.runtimes, RuntimeMetrics(metrics.registry))
    scheduler.on_need = supervisor.on_change = swapper.poke
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field

from passerelle.config import RuntimesConfig
from passerelle.errors import NoBackend
from passerelle.observe.runtime_metrics import RuntimeMetrics
from passerelle.runtimes.fleet import drain
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.memory import GIB
from passerelle.runtimes.supervisor import NoRoom, ProcState, RuntimeFailed, RuntimeProcess, Supervisor
from passerelle.scheduling.scheduler import Job, Scheduler
from passerelle.scheduling.swap import Demand, Key, Plan, Resident, decide

log = logging.getLogger("passerelle.scheduling.swapper")

DEFAULT_LOAD_S = 10.0  # a runtime never started yet: what a fallback decision assumes its load takes


@dataclass
class SwapEvent:
    """One swap: what was unloaded for what, why, and what it cost."""

    at: float  # wall-clock time it began
    loaded: str
    unloaded: tuple[str, ...]
    reason: str
    waiting: int  # requests waiting for the loaded runtime when it was decided
    drain_s: float = 0.0
    load_s: float | None = None
    cut: int = 0  # requests still running when the drain timed out (ended by the stop)
    error: str = ""

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["unloaded"] = list(self.unloaded)
        return d


@dataclass
class _Backoff:
    until: float = 0.0
    delay_s: float = 0.0


@dataclass
class SwapCounts:
    swaps: int = 0
    starts: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class Swapper:
    def __init__(self, scheduler: Scheduler, supervisor: Supervisor, cfg: RuntimesConfig,
                 metrics: RuntimeMetrics | None = None) -> None:
        self.scheduler = scheduler
        self.supervisor = supervisor
        self.configure(cfg)
        self.metrics = metrics
        self.clock = scheduler.clock
        self.events: deque[SwapEvent] = deque(maxlen=50)
        self.counts = SwapCounts()
        self.current: SwapEvent | None = None  # the swap in progress
        self._task: asyncio.Task[None] | None = None
        self._scheduled = False
        self._wake: asyncio.TimerHandle | None = None
        self._changed: asyncio.Event | None = None
        self._backoff: dict[str, _Backoff] = {}

    def configure(self, cfg: RuntimesConfig) -> None:
        """``[runtimes]``' swap policy, residency and drain deadline, from the next decision on."""
        self.cfg = cfg

    # -- events ----------------------------------------------------------------------------
    def poke(self, *_: object) -> None:
        """Something changed: decide again, on the loop's next pass (many pokes make one decision)."""
        if self._changed is not None:
            self._changed.set()
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller in a test): nothing to carry out
            return
        self._scheduled = True
        loop.call_soon(self._decide)

    def _decide(self) -> None:
        self._scheduled = False
        if self._task is not None and not self._task.done():
            return  # the running step pokes again when it ends
        plan = self.plan()
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        if plan.start is None:
            if plan.wake_in_s is not None:
                self._wake = asyncio.get_running_loop().call_later(max(0.05, plan.wake_in_s), self.poke)
            return
        self._task = asyncio.ensure_future(self._carry_out(plan))
        self._task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("swap failed inside the gateway", exc_info=task.exception())
        self.poke()

    async def stop(self) -> None:
        if self._wake is not None:
            self._wake.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    # -- what the queue asks for -----------------------------------------------------------
    def _proc_of(self, backend: Backend) -> RuntimeProcess | None:
        proc = self.supervisor.get(backend.name)
        return proc if proc is not None and proc.backend is backend else None

    def _coming(self, b: Backend) -> bool:
        """Will ``b`` take requests without a decision of ours (up, or starting by itself)?"""
        if b.routable(time.monotonic()):
            return True
        proc = self._proc_of(b)
        return proc is not None and (self.supervisor.starting(b.name) or proc.state is ProcState.STARTING
                                     or proc.restarting)

    def _startable(self, job: Job, now: float) -> RuntimeProcess | None:
        """The stopped on-demand runtime that would serve ``job``, or None."""
        for b in job.pool:
            proc = self._proc_of(b)
            if (proc is not None and b.name not in job.exclude and b.cfg.on_demand and not b.draining
                    and proc.state in (ProcState.STOPPED, ProcState.FAILED) and not proc.restarting
                    and not proc.stopping and self._backoff.get(b.name, _Backoff()).until <= now):
                return proc
        return None

    def demands(self) -> tuple[list[Demand], dict[str, list[Job]]]:
        now = self.clock()
        groups: dict[str, list[Job]] = {}
        keys: dict[str, Key] = {}
        for job in self.scheduler.waiting:
            if job.future is not None and job.future.done():
                continue
            if any(self._coming(b) for b in job.pool if b.name not in job.exclude):
                continue
            proc = self._startable(job, now)
            if proc is None:
                continue
            name = proc.backend.name
            groups.setdefault(name, []).append(job)
            key = self.scheduler.key(job)
            keys[name] = min(keys.get(name, key), key)
        procs = self.supervisor.processes
        out = [Demand(name, self.supervisor.need_gib(procs[name]), keys[name], len(jobs),
                      max(now - j.enqueued_at for j in jobs), load_s=self.supervisor.load_estimate_s(procs[name]))
               for name, jobs in groups.items()]
        return out, groups

    def residents(self) -> list[Resident]:
        mono = time.monotonic()
        queued: dict[str, list[Key]] = {}
        for job in self.scheduler.waiting:
            if job.future is not None and job.future.done():
                continue
            key = self.scheduler.key(job)
            for b in job.pool:
                queued.setdefault(b.name, []).append(key)
        out = []
        for name, p in self.supervisor.processes.items():
            if not p.holds_memory:
                continue
            b = p.backend
            keys = queued.get(name, [])
            out.append(Resident(
                name, self.supervisor.need_gib(p), b.in_flight, min(keys, default=None), len(keys),
                resident_s=mono - p.ready_at if p.state is ProcState.READY else 0.0,
                idle_s=mono - b.last_used, pinned=b.cfg.persistent or not b.cfg.on_demand,
                ready=p.state is ProcState.READY and not b.fenced and not p.stopping and not b.draining,
                load_s=self.supervisor.load_estimate_s(p)))
        return out

    def plan(self) -> Plan:
        demands, _ = self.demands()
        if not demands:
            return Plan()
        return decide(demands, self.residents(), free_gib=self.supervisor.free_gib(),
                      min_resident_s=self.cfg.min_resident_s, policy=self.cfg.swap_policy)

    # -- carrying it out -------------------------------------------------------------------
    async def _carry_out(self, plan: Plan) -> None:
        assert plan.start is not None
        target = self.supervisor.processes[plan.start]
        event = SwapEvent(at=time.time(), loaded=plan.start, unloaded=plan.evict, reason=plan.reason,
                          waiting=plan.demand.waiting if plan.demand else 0)
        if plan.evict:
            self.current = event
            victims = [self.supervisor.processes[n] for n in plan.evict]
            log.info("swap: unloading %s to load %s (%s; %d request(s) waiting for it, the oldest for %.1f s)",
                     ", ".join(plan.evict), plan.start, plan.reason, event.waiting,
                     plan.demand.oldest_s if plan.demand else 0.0)
            event.drain_s, event.cut = await self._drain(victims)
            for v in victims:
                try:
                    await self.supervisor.stop(v.backend.name)
                finally:
                    v.backend.fenced = False
        t0 = time.monotonic()
        try:
            await self.supervisor.start(plan.start, evict_idle=False)
            event.load_s = time.monotonic() - t0
            self._backoff.pop(plan.start, None)
        except NoRoom as exc:  # something else took the memory meanwhile: decided again
            event.error = str(exc)
            log.info("swap: %s", exc)
        except RuntimeFailed as exc:
            event.error = str(exc)
            self._failed(target, exc)
        finally:
            self.current = None
        self.counts.starts += 1
        if self.metrics is not None:
            if plan.evict:
                self.metrics.swap(plan.start, reason=plan.reason, drain_s=event.drain_s, load_s=event.load_s)
            elif event.load_s is not None:
                self.metrics.load.labels(plan.start).observe(event.load_s)
        if plan.evict:
            self.counts.swaps += 1
            self.counts.by_reason[plan.reason] = self.counts.by_reason.get(plan.reason, 0) + 1
            self.events.append(event)
            load = f"{event.load_s:.1f} s" if event.load_s is not None else f"failed ({event.error})"
            log.info("swap %d: %s -> %s (%s): drain %.1f s%s, load %s", self.counts.swaps, ",".join(plan.evict),
                     plan.start, plan.reason, event.drain_s,
                     f" ({event.cut} request(s) cut at the drain timeout)" if event.cut else "", load)

    async def _drain(self, victims: list[RuntimeProcess]) -> tuple[float, int]:
        """Fence ``victims`` and wait for their running requests; (seconds waited, requests cut)."""
        for v in victims:
            v.backend.fenced = True
        self._changed = asyncio.Event()  # set by every poke: a release ends the wait early
        try:
            waited, cut = await drain([v.backend for v in victims], self.cfg.drain_timeout_s, self._changed)
        finally:
            self._changed = None
        if cut:
            log.warning("swap: drain timeout (%g s): stopping %s under %d running request(s)",
                        self.cfg.drain_timeout_s, ", ".join(v.backend.name for v in victims), cut)
        return waited, cut

    def _failed(self, proc: RuntimeProcess, exc: RuntimeFailed) -> None:
        name = proc.backend.name
        b = self._backoff.setdefault(name, _Backoff())
        b.delay_s = min(60.0, max(5.0, b.delay_s * 2))
        b.until = self.clock() + b.delay_s
        if self.metrics is not None:
            self.metrics.starts_failed.labels(name).inc()
        log.error("on-demand start of %s failed (not tried again for %g s): %s", name, b.delay_s, exc)

        def only_this(job: Job) -> bool:
            return proc.backend in job.pool and not any(
                self._coming(b) or (self._proc_of(b) is not None and b is not proc.backend and b.cfg.on_demand)
                for b in job.pool)

        n = self.scheduler.fail_waiting(only_this, lambda: NoBackend(
            f"The runtime '{name}' serving this model failed to start; see its log "
            f"(passerelle runtime logs {name}).", retry_after=b.delay_s))
        if n:
            log.error("%d waiting request(s) ended: their only runtime %s failed to start", n, name)

    # -- for fallbacks, the dashboard and /metrics -----------------------------------------
    def eta_s(self, pool: list[Backend]) -> float | None:
        """About how long until ``pool`` can take a request: 0 when a replica is up, the load time
        (plus a drain and what residency is left, when memory must be freed) when one can be
        loaded, None when none can (all down, nothing to start)."""
        now = time.monotonic()
        best: float | None = None
        for b in pool:
            if b.routable(now):
                return 0.0
            proc = self._proc_of(b)
            if proc is None:
                continue
            load = self.supervisor.load_estimate_s(proc) or DEFAULT_LOAD_S
            if proc.state is ProcState.STARTING or self.supervisor.starting(b.name) or proc.restarting:
                eta = load
            elif b.cfg.on_demand and not b.draining:
                eta = load + (0.0 if self.supervisor.fits(proc) else self._room_eta(proc))
            else:
                continue
            best = eta if best is None else min(best, eta)
        return best

    def _room_eta(self, proc: RuntimeProcess) -> float:
        need = self.supervisor.need_gib(proc) - self.supervisor.free_gib()
        waits = []
        for r in self.residents():
            if r.pinned:
                continue
            p = self.supervisor.processes[r.runtime]
            left = 0.0 if r.idle else max(0.0, self.cfg.min_resident_s - r.resident_s)
            drain = 0.0 if not p.backend.in_flight else min(self.cfg.drain_timeout_s, self._typical_drain_s())
            waits.append((left + drain, r.need_gib))
        waits.sort()
        freed = 0.0
        for wait, gib in waits:
            freed += gib
            if freed >= need:
                return wait
        return float(self.cfg.drain_timeout_s + self.cfg.min_resident_s)

    def _typical_drain_s(self) -> float:
        drains = [e.drain_s for e in self.events]
        return sum(drains) / len(drains) if drains else 5.0

    def waiting_for_load(self) -> dict[str, int]:
        """Requests waiting for each stopped runtime to be loaded."""
        _, groups = self.demands()
        return {name: len(jobs) for name, jobs in groups.items()}

    def describe(self) -> dict[str, object]:
        c = self.counts
        cur = self.current
        return {"policy": self.cfg.swap_policy, "min_resident_s": self.cfg.min_resident_s,
                "drain_timeout_s": self.cfg.drain_timeout_s, "swaps": c.swaps, "starts": c.starts,
                "by_reason": dict(c.by_reason), "waiting_for_load": self.waiting_for_load(),
                "in_progress": cur.as_dict() if cur is not None else None,
                "recent": [e.as_dict() for e in reversed(self.events)][:10], **self.supervisor.budget()}

    def refresh_metrics(self) -> None:
        if self.metrics is None:
            return
        sup = self.supervisor
        waiting = self.waiting_for_load()
        self.metrics.budget.set(sup.max_loaded_gib * GIB)
        self.metrics.budget_used.set(sup.loaded_gib() * GIB)
        for name, p in sup.processes.items():
            r = p.reading
            measured = sup.measured_gib(p)
            self.metrics.set_runtime(name, loaded=p.holds_memory, waiting=waiting.get(name, 0), memory={
                "rss": r.rss_bytes if r else None, "gpu": r.gpu_bytes if r else None,
                "measured": measured * GIB if measured is not None else None,
                "estimated": sup.estimated_gib(p) * GIB, "need": sup.need_gib(p) * GIB})
