"""The backends that serve, changed by a reload as its plan says (``reload_plan.py``), and the one
:func:`drain` a backend goes through before it stops (a reload here, a swap in the swapper).

A reload changes the fleet in two steps, so that a configuration that cannot serve changes nothing:

    stage   build the new backends (added, or replacing one of the same name) and start their
            runtimes, all of them, until ready, beside the ones still serving; one that fails to
            start: every new one is stopped again and the reload is refused (RuntimeFailed),
            the running fleet untouched
    commit  (no await: no request sees half of it) the new backends join the registry, the
            replaced and removed ones are marked draining: they take no new request, finish
            theirs within the drain deadline, then their runtime is stopped

A runtime started on demand is not started by a reload: it starts when its model is first asked
for, as it would at start-up.

Example::

    fleet = Fleet(registry, supervisor, on_ready=scheduler.dispatch)
    staged = await fleet.stage(plan, new_cfg)      # raises RuntimeFailed: nothing changed
    fleet.commit(staged, drain_timeout_s=120)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from passerelle.config import Config
from passerelle.runtimes.boxes import BoxBackend
from passerelle.runtimes.factory import build_runtime
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.registry import Registry
from passerelle.runtimes.reload_plan import ReloadPlan
from passerelle.runtimes.supervisor import RuntimeFailed, RuntimeProcess, Supervisor

log = logging.getLogger("passerelle.runtimes.fleet")


async def drain(backends: Sequence[Backend], timeout_s: float, wake: asyncio.Event | None = None, *,
                poll_s: float = 0.2) -> tuple[float, int]:
    """Wait until ``backends`` have no request in flight, for at most ``timeout_s``; returns
    (seconds waited, requests still running at the deadline). ``wake``, set when a request ends,
    ends a wait early; without it the count is looked at every ``poll_s``. The caller has already
    kept new requests away (``draining`` or ``fenced``)."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while any(b.in_flight for b in backends):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if wake is None:
            await asyncio.sleep(min(left, poll_s))
            continue
        wake.clear()
        with contextlib.suppress(TimeoutError):  # a release sets it; the timeout bounds the wait
            await asyncio.wait_for(wake.wait(), min(left, 1.0))
    return time.monotonic() - t0, sum(b.in_flight for b in backends)


@dataclass
class Staged:
    """New backends built and started for a plan, not yet serving."""

    plan: ReloadPlan
    backends: list[Backend] = field(default_factory=list)
    processes: list[RuntimeProcess] = field(default_factory=list)


class Fleet:
    def __init__(self, registry: Registry, supervisor: Supervisor, *, on_ready: Callable[[], None] | None = None,
                 on_change: Callable[[], None] | None = None) -> None:
        self.registry = registry
        self.supervisor = supervisor
        self.on_ready = on_ready  # a new runtime is ready: queued requests may go
        self.on_change = on_change  # the backend list changed (a drained backend left)
        self._tasks: set[asyncio.Task[Any]] = set()

    def serving(self) -> dict[str, Backend]:
        """The backends by name, those draining from an earlier reload left out, and other boxes'
        replicas too (those follow their box, not the configuration's backends)."""
        return {b.name: b for b in self.registry.backends if not b.draining and not isinstance(b, BoxBackend)}

    async def stage(self, plan: ReloadPlan, cfg: Config) -> Staged:
        """Build the backends ``plan`` starts, and start their runtimes (on-demand ones excepted)
        until ready; raise RuntimeFailed, with every one of them stopped again, if one fails."""
        wanted = {bc.name: bc for bc in cfg.backends}
        staged = Staged(plan)
        try:
            for name in plan.starts:
                backend, proc = build_runtime(wanted[name], cfg.timeouts, cfg.state_path())
                staged.backends.append(backend)
                await backend.start()
                if proc is not None:
                    staged.processes.append(proc)
            launches = [p for p in staged.processes if not p.backend.cfg.on_demand]
            results = await asyncio.gather(*(self.supervisor.launch(p) for p in launches), return_exceptions=True)
            failed = [(p, r) for p, r in zip(launches, results, strict=True) if isinstance(r, BaseException)]
            if failed:
                proc, exc = failed[0]
                if not isinstance(exc, Exception):
                    raise exc
                raise RuntimeFailed(f"runtime {proc.backend.name} did not start: {exc}") from exc
            # External runtimes: their health now, not at the poller's next pass, so that a model
            # whose backend is replaced never looks unserved (503) meanwhile.
            await asyncio.gather(*(b.scrape() for b in staged.backends if not b.supervised))
        except BaseException:
            await asyncio.shield(self._discard(staged))
            raise
        return staged

    async def _discard(self, staged: Staged) -> None:
        await asyncio.gather(*(p.stop() for p in staged.processes), return_exceptions=True)
        for b in staged.backends:
            await b.close()

    def commit(self, staged: Staged, *, drain_timeout_s: float) -> None:
        """The staged backends serve; those the plan drains finish their requests (at most
        ``drain_timeout_s``), then stop. Nothing here waits."""
        plan = staged.plan
        current = self.serving()
        still_draining = [b for b in self.registry.backends if b.draining]
        # the old processes are found before the new ones take their names
        olds = {n: p for n in plan.drains if (p := self.supervisor.get(n)) is not None and p.backend is current[n]}
        for proc in staged.processes:
            proc.on_ready = self.on_ready
            self.supervisor.adopt(proc)
        for name in plan.drains:
            current[name].draining = True
            old = olds.get(name)
            if old is not None:
                self.supervisor.retiring.add(old)  # stopped at shutdown too, if still draining then
            self._spawn(self._retire(current[name], old, drain_timeout_s), f"retire-{name}")
        kept = [current[n] for n in plan.backends.kept]
        remote: list[Backend] = [b for b in self.registry.backends if isinstance(b, BoxBackend)]  # (boxes.py)
        self.registry.set_backends(kept + staged.backends + [current[n] for n in plan.drains] + still_draining
                                   + remote)
        if self.on_ready is not None and staged.backends:
            self.on_ready()  # requests queued for a model the new backends serve may go now

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("retiring a backend failed", exc_info=task.exception())

    async def _retire(self, backend: Backend, proc: RuntimeProcess | None, timeout_s: float) -> None:
        waited, cut = await drain([backend], timeout_s)
        if cut:
            log.warning("reload: drain timeout (%g s): stopping %s under %d running request(s)", timeout_s,
                        backend.name, cut)
        else:
            log.info("reload: %s drained in %.1f s", backend.name, waited)
        if proc is not None:
            await self.supervisor.retire(proc)
        self.registry.set_backends([b for b in self.registry.backends if b is not backend])
        if self.on_change is not None:
            self.on_change()
        await backend.close()
