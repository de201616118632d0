"""The swapper carrying out swaps, in-process: real scheduler, supervisor and backends, runtimes
replaced by processes that start and stop at once (so the order of fence, drain, stop, start and
dispatch can be checked exactly). Real runtimes: tests/integration/test_models_llama.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from passerelle.config import DEFAULT_CLASSES, BackendConfig, RuntimesConfig, TimeoutConfig
from passerelle.errors import NoBackend
from passerelle.runtimes.kinds import make_backend
from passerelle.runtimes.supervisor import ProcState, RuntimeFailed, RuntimeProcess, Supervisor
from passerelle.scheduling.scheduler import Job, Scheduler
from passerelle.scheduling.swapper import Swapper
from tests.unit.test_scheduler import scheduler
from tests.waiting import until

CLS = {c.name: c for c in DEFAULT_CLASSES}


class InstantProcess(RuntimeProcess):
    """A runtime that is ready as soon as it starts; it records what happened to it."""

    def __init__(self, name: str, gib: float, log: list, tmp_path, *, fail: bool = False, **cfg) -> None:
        bc = BackendConfig(name=name, kind="openai", launch=("runtime", "{port}"), models=(f"model-{name}",),
                           on_demand=True, memory_gib=gib, max_concurrency=2, **cfg)
        super().__init__(make_backend(bc, TimeoutConfig()), bc.launch, log_path=tmp_path / f"{name}.log")
        self.log, self.fail = log, fail

    async def start(self) -> None:
        self._stopping = False  # as RuntimeProcess.start does
        self.state = ProcState.STARTING
        await asyncio.sleep(0)  # a start takes at least one pass of the loop
        if self.fail:
            self.state = ProcState.FAILED
            raise RuntimeFailed(f"runtime {self.backend.name} exited with code 1 while starting")
        self.backend.stats.up = True
        self.ready_at = self.backend.last_used = time.monotonic()
        self.state = ProcState.READY
        self.log.append(("start", self.backend.name))

    async def stop(self, grace: float = 10.0) -> None:
        self.log.append(("stop", self.backend.name, self.backend.in_flight))
        self._stopping = True  # as RuntimeProcess.stop does; a stopped runtime must start again
        self.backend.stats.up = False
        self.state = ProcState.STOPPED


@pytest.fixture
def box(tmp_path):
    """Two on-demand runtimes of 6 GiB under a 10 GiB budget, wired like the app wires them."""

    def make(*, min_resident_s: float = 300.0, drain_timeout_s: float = 30.0, fail_b: bool = False, **extra):
        log: list = []
        a = InstantProcess("a", 6.0, log, tmp_path, **extra)
        b = InstantProcess("b", 6.0, log, tmp_path, fail=fail_b)
        sched = scheduler()
        runtimes = RuntimesConfig(max_loaded_gib=10.0, min_resident_s=min_resident_s, drain_timeout_s=drain_timeout_s)
        sup = Supervisor([a, b], runtimes, on_ready=sched.dispatch)
        swapper = Swapper(sched, sup, runtimes)
        sched.on_need = sup.on_change = swapper.poke
        return log, a, b, sched, swapper

    return make


def request(proc: RuntimeProcess, tenant: str = "t") -> Job:
    return Job(pool=[proc.backend], cls=CLS["standard"], tenant=tenant, can_wait_for_start=True)


async def acquire(sched: Scheduler, job: Job, timeout: float = 10.0):
    return await asyncio.wait_for(sched.acquire(job), timeout)


async def test_a_stopped_model_is_started_for_its_first_request(box):
    log, a, _, sched, swapper = box()
    assert await acquire(sched, request(a)) is a.backend
    assert log == [("start", "a")] and swapper.counts.swaps == 0


async def test_a_start_deferred_for_memory_runs_as_soon_as_the_holder_goes_idle(box):
    log, a, b, sched, swapper = box(min_resident_s=300)  # only idleness can free a
    ja = request(a)
    await acquire(sched, ja)
    jb = request(b)
    waiting = asyncio.ensure_future(acquire(sched, jb))
    await until(lambda: swapper._wake is not None, what="the swapper deferring b")  # a is busy, resident
    assert not waiting.done() and b.state is ProcState.STOPPED and a.state is ProcState.READY
    sched.release(ja)
    assert await waiting is b.backend  # once a was idle for the grace, with no timer of the test's
    assert log == [("start", "a"), ("stop", "a", 0), ("start", "b")]
    assert swapper.counts.swaps == 1 and swapper.events[-1].reason == "idle"


async def test_a_swapped_out_model_finishes_its_running_request_and_takes_no_new_one(box):
    log, a, b, sched, swapper = box(min_resident_s=0)
    running = request(a)
    await acquire(sched, running)
    jb = request(b, tenant="other")
    for_b = asyncio.ensure_future(acquire(sched, jb))
    await until(lambda: a.backend.fenced, what="a fenced")
    late = request(a)  # arrives during the drain: waits, is not sent to the model going away
    for_a = asyncio.ensure_future(acquire(sched, late))
    await until(lambda: late in sched.waiting, what="the late request queued")
    assert late.backend is None and a.backend.in_flight == 1
    assert ("stop", "a", 1) not in log and swapper.current is not None  # draining, not stopped
    sched.release(running)
    assert await for_b is b.backend
    assert ("stop", "a", 0) in log  # stopped only once its request had ended
    ev = swapper.events[-1]
    assert ev.unloaded == ("a",) and ev.loaded == "b" and ev.reason == "outranked" and ev.cut == 0
    assert ev.drain_s > 0 and ev.load_s is not None
    sched.release(jb)
    assert await for_a is a.backend  # and it comes back for the request that waited
    assert swapper.counts.swaps == 2


async def test_the_drain_is_bounded_by_its_timeout(box):
    log, a, b, sched, swapper = box(min_resident_s=0, drain_timeout_s=0.2)
    stuck = request(a)
    await acquire(sched, stuck)
    assert await acquire(sched, request(b)) is b.backend
    assert ("stop", "a", 1) in log and swapper.events[-1].cut == 1


async def test_a_persistent_model_is_never_unloaded(box):
    log, a, b, sched, swapper = box(min_resident_s=0, persistent=True)
    ja = request(a)
    await acquire(sched, ja)
    sched.release(ja)
    a.backend.last_used -= 3600  # idle for an hour
    for_b = asyncio.ensure_future(acquire(sched, request(b)))
    await until(lambda: sched.waiting, what="b's request queued")
    plan = swapper.plan()
    assert plan.start is None and plan.wake_in_s is None  # nothing can make room, nothing to wait for
    for_b.cancel()
    assert log == [("start", "a")]


async def test_a_failed_start_ends_the_requests_only_it_could_serve(box):
    _, _, b, sched, swapper = box(fail_b=True)
    with pytest.raises(NoBackend, match="failed to start"):
        await acquire(sched, request(b))
    assert swapper.describe()["swaps"] == 0 and not sched.waiting


async def test_eta_of_a_pool_for_fallback_decisions(box):
    _, a, b, sched, swapper = box(min_resident_s=300)
    assert swapper.eta_s([a.backend]) == pytest.approx(10.0)  # never started: the default guess
    ja = request(a)
    await acquire(sched, ja)
    assert swapper.eta_s([a.backend]) == 0.0
    # b does not fit beside the busy a, which has 300 s of residency left
    assert swapper.eta_s([b.backend]) > 250
    assert swapper.eta_s([]) is None
