"""The scheduling policy with an injected clock: no sleeps, no servers."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from passerelle.config import DEFAULT_CLASSES, ClassConfig, RoutingConfig, SchedulerConfig
from passerelle.errors import NoBackend, QueueFull, QueueTimeout
from passerelle.runtimes.base import Backend, BackendStats
from passerelle.runtimes.breaker import BreakerState, CircuitBreaker, Outcome
from passerelle.scheduling.scheduler import Job, PreemptionPolicy, Scheduler

CLS = {c.name: c for c in DEFAULT_CLASSES}


@dataclass(eq=False)
class FakeBackend:
    """The scheduler's view of a backend, without a network."""

    name: str = "b"
    capacity: int = 1
    in_flight: int = 0
    stats: BackendStats = field(default_factory=lambda: BackendStats(up=True))
    draining: bool = False
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    fenced: bool = False
    last_used: float = 0.0
    slot_ids: bool = False
    routable = Backend.routable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


_ROUTING = {f.name for f in dataclasses.fields(RoutingConfig)}


def scheduler(classes: tuple[ClassConfig, ...] = DEFAULT_CLASSES, *, clock: Callable[[], float] = time.monotonic,
              preemption: PreemptionPolicy | None = None, tenant_queue_share: float = 1.0, **kw: Any) -> Scheduler:
    """A scheduler for ``[scheduler]`` and ``[routing]`` fields given by name; without preemption
    and fair admission unless asked (``preemption``: its policy; ``tenant_queue_share``)."""
    pre = {} if preemption is None else {"preempt_after_ms": preemption.after_s * 1000,
                                         "min_run_s": preemption.min_run_s}
    sc = SchedulerConfig(preemption=preemption is not None, tenant_queue_share=tenant_queue_share, **pre,
                         **{k: v for k, v in kw.items() if k not in _ROUTING})
    return Scheduler(sc, RoutingConfig(**{k: v for k, v in kw.items() if k in _ROUTING}), tuple(classes), clock=clock)


def make(clock, **kw) -> Scheduler:
    return scheduler(clock=clock, **kw)


def job(pool, cls="standard", tenant="t", loop=None, **kw) -> Job:
    j = Job(pool=pool, cls=CLS[cls] if isinstance(cls, str) else cls, tenant=tenant, **kw)
    j.future = (loop or asyncio.get_running_loop()).create_future()
    return j


def started(jobs):
    return [j for j in jobs if j.backend is not None]


async def test_capacity_is_never_exceeded(clock):
    b = FakeBackend(capacity=2)
    s = make(clock)
    jobs = [job([b]) for _ in range(5)]
    for j in jobs:
        s.submit(j)
    assert b.in_flight == 2 and len(started(jobs)) == 2 and len(s.waiting) == 3
    s.release(jobs[0])
    assert b.in_flight == 2 and jobs[2].backend is b


async def test_interactive_queued_later_goes_before_batch(clock):
    b = FakeBackend(capacity=1)
    s = make(clock)
    first = job([b], "standard")
    s.submit(first)
    batch = [job([b], "batch", tenant="bulk") for _ in range(3)]
    for j in batch:
        s.submit(j)
    clock.now += 1
    chat = job([b], "interactive", tenant="alice")
    s.submit(chat)
    s.release(first)
    assert chat.backend is b and not started(batch)


async def test_fifo_within_a_tenant(clock):
    b = FakeBackend(capacity=1)
    s = make(clock)
    jobs = [job([b], tenant="a") for _ in range(4)]
    for j in jobs:
        s.submit(j)
    order = []
    for _ in range(4):
        running = next(j for j in jobs if j.backend is not None)
        order.append(jobs.index(running))
        s.release(running)
    assert order == [0, 1, 2, 3]


async def test_aging_promotes_a_waiting_batch_request(clock):
    b = FakeBackend(capacity=1)
    s = make(clock, aging_s=30)
    blocker = job([b])
    s.submit(blocker)
    old_batch = job([b], "batch", tenant="bulk")
    s.submit(old_batch)
    clock.now += 61  # two promotions: batch (2) now ranks with interactive (0)
    chat = job([b], "interactive", tenant="alice")
    s.submit(chat)
    s.release(blocker)
    assert old_batch.backend is b and chat.backend is None


async def test_without_aging_time_batch_still_waits(clock):
    b = FakeBackend(capacity=1)
    s = make(clock, aging_s=30)
    blocker = job([b])
    s.submit(blocker)
    old_batch = job([b], "batch", tenant="bulk")
    s.submit(old_batch)
    clock.now += 29
    chat = job([b], "interactive", tenant="alice")
    s.submit(chat)
    s.release(blocker)
    assert chat.backend is b and old_batch.backend is None


def simulate_two_tenants(s: Scheduler, b: FakeBackend, loop, conc_a: int, conc_b: int, rounds: int) -> dict:
    """Closed-loop clients: each keeps its concurrency outstanding; answers are 100 tokens."""
    outstanding = {"a": [], "b": []}
    served = {"a": 0, "b": 0}
    for tenant, n in (("a", conc_a), ("b", conc_b)):
        for _ in range(n):
            j = job([b], "batch", tenant=tenant, loop=loop, est_prompt_tokens=10, est_output_tokens=100)
            outstanding[tenant].append(j)
            s.submit(j)
    running_order: list[Job] = [j for js in outstanding.values() for j in js if j.backend is not None]
    for _ in range(rounds):
        done = running_order.pop(0)  # oldest running finishes first
        served[done.tenant] += 100
        outstanding[done.tenant].remove(done)
        before = {id(j) for js in outstanding.values() for j in js if j.backend is not None}
        s.release(done, prompt_tokens=10, completion_tokens=100)
        nxt = job([b], "batch", tenant=done.tenant, loop=loop, est_prompt_tokens=10, est_output_tokens=100)
        outstanding[done.tenant].append(nxt)
        s.submit(nxt)
        running_order += [j for js in outstanding.values() for j in js
                          if j.backend is not None and id(j) not in before and j not in running_order]
    return served


async def test_vtc_fair_share_between_unequal_tenants(clock):
    b = FakeBackend(capacity=4)  # batch may hold 3 of 4
    s = make(clock)
    served = simulate_two_tenants(s, b, asyncio.get_running_loop(), conc_a=8, conc_b=2, rounds=400)
    share_b = served["b"] / (served["a"] + served["b"])
    assert 0.45 <= share_b <= 0.55, served


async def test_equal_demand_gets_equal_service(clock):
    b = FakeBackend(capacity=4)
    s = make(clock)
    served = simulate_two_tenants(s, b, asyncio.get_running_loop(), conc_a=8, conc_b=8, rounds=200)
    assert abs(served["a"] - served["b"]) / (served["a"] + served["b"]) <= 0.05


async def test_tenant_back_from_idle_banks_no_credit(clock):
    b = FakeBackend(capacity=1)
    s = make(clock)
    loop = asyncio.get_running_loop()
    # a runs alone for a while and accumulates service
    for _ in range(20):
        j = job([b], tenant="a", loop=loop)
        s.submit(j)
        s.release(j, prompt_tokens=10, completion_tokens=100)
    blocker = job([b], tenant="a", loop=loop)
    s.submit(blocker)
    a_jobs = [job([b], tenant="a", loop=loop) for _ in range(10)]
    b_jobs = [job([b], tenant="newcomer", loop=loop) for _ in range(10)]
    for x, y in zip(a_jobs, b_jobs, strict=True):
        s.submit(x)
        s.submit(y)
    order, current = [], blocker
    for _ in range(10):
        s.release(current, prompt_tokens=10, completion_tokens=100)
        current = next(j for j in a_jobs + b_jobs if j.backend is not None)
        order.append(current.tenant)
    # a newcomer does not get the next ten slots in a row: they alternate
    assert order.count("newcomer") <= 6 and order.count("a") >= 4, order


async def test_class_slot_share_keeps_a_slot_for_interactive(clock):
    b = FakeBackend(capacity=4)
    share = ClassConfig("batch", 2, slot_share=0.75)  # the default without preemption
    s = make(clock, classes=(CLS["interactive"], CLS["standard"], share))
    batch = [job([b], share, tenant="bulk") for _ in range(6)]
    for j in batch:
        s.submit(j)
    assert len(started(batch)) == 3 and b.in_flight == 3  # 0.75 of 4
    chat = job([b], "interactive")
    s.submit(chat)
    assert chat.backend is b


async def test_slot_share_is_at_least_one(clock):
    b = FakeBackend(capacity=1)
    s = make(clock)
    j = job([b], "batch")
    s.submit(j)
    assert j.backend is b


async def test_bounded_queue_raises_queue_full_with_retry_after(clock):
    b = FakeBackend(capacity=1)
    tiny = ClassConfig("standard", 1, max_queue=2)
    s = make(clock, classes=(tiny,))
    for _ in range(3):
        s.submit(job([b], tiny))
    with pytest.raises(QueueFull) as info:
        s.submit(job([b], tiny))
    assert info.value.retry_after >= 1 and info.value.status == 429


async def test_queue_deadline_expires_with_queue_timeout(clock):
    b = FakeBackend(capacity=1)
    short = ClassConfig("standard", 1, max_queue_wait_s=10)
    s = make(clock, classes=(short,))
    s.submit(job([b], short))
    waiting = job([b], short)
    s.submit(waiting)
    clock.now += 9
    s.expire_due()
    assert not waiting.future.done()
    clock.now += 2
    s.expire_due()
    assert isinstance(waiting.future.exception(), QueueTimeout)
    assert s.waiting == []


async def test_cancelled_waiter_is_removed_and_never_dispatched(clock):
    b = FakeBackend(capacity=1)
    s = make(clock)
    first = job([b])
    s.submit(first)
    j = Job(pool=[b], cls=CLS["standard"], tenant="gone")
    task = asyncio.ensure_future(s.acquire(j))
    await asyncio.sleep(0)  # let it enqueue
    assert j in s.waiting
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert j not in s.waiting and s.tenants["gone"].waiting == 0
    s.release(first)
    assert j.backend is None and b.in_flight == 0


async def test_retry_after_follows_the_drain_rate(clock):
    b = FakeBackend(capacity=1)
    s = make(clock)
    current = job([b])
    s.submit(current)
    for _ in range(10):  # ten dispatches, one every 0.5 s: 2 per second
        clock.now += 0.5
        nxt = job([b])
        s.submit(nxt)
        s.release(current)
        current = nxt
    for _ in range(4):
        s.submit(job([b]))
    # 4 waiting + this one, at about 2 per second
    assert 2.0 <= s.retry_after() <= 3.0
    clock.now += 0  # a slower drain gives a longer wait
    slow = make(Clock())
    assert slow.retry_after() != s.retry_after()


async def test_no_backend_up_is_503_unless_one_is_starting(clock):
    b = FakeBackend(capacity=1)
    b.stats.up = False
    s = make(clock)
    with pytest.raises(NoBackend):
        s.submit(job([b]))
    waits = job([b], can_wait_for_start=True)
    s.submit(waits)
    assert waits in s.waiting
    b.stats.up = True
    s.dispatch()
    assert waits.backend is b


async def test_least_loaded_replica_is_chosen(clock):
    b1, b2 = FakeBackend("b1", capacity=4), FakeBackend("b2", capacity=2)
    s = make(clock)
    jobs = [job([b1, b2]) for _ in range(4)]
    for j in jobs:
        s.submit(j)
    assert (b1.in_flight, b2.in_flight) == (2, 2) or (b1.in_flight, b2.in_flight) == (3, 1)
    assert b1.in_flight / 4 <= 0.75 and b2.in_flight / 2 <= 1


async def test_usage_correction_changes_the_tenant_counter(clock):
    b = FakeBackend(capacity=1)
    s = make(clock)
    j = job([b], tenant="x", est_prompt_tokens=10, est_output_tokens=256)
    s.submit(j)
    before = s.tenants["x"].counter
    s.release(j, prompt_tokens=10, completion_tokens=6)
    assert s.tenants["x"].counter == pytest.approx(before - 2 * 250)


async def test_prefix_affinity_keeps_a_conversation_on_its_replica_while_load_allows(clock):
    b1, b2 = FakeBackend("b1", capacity=4), FakeBackend("b2", capacity=4)
    s = make(clock, affinity_slack=0.5)
    first = job([b1, b2], affinity="conv-1")
    s.submit(first)
    home = first.backend
    s.release(first)
    other = job([b1, b2], affinity="conv-2")
    s.submit(other)  # the other replica is now less loaded...
    again = job([b1, b2], affinity="conv-1")
    s.submit(again)
    assert again.backend is home  # ...but the conversation stays home (within the slack)
    # once home is much busier than the other replica, load wins
    fillers = [job([home]) for _ in range(3)]
    for f in fillers:
        s.submit(f)
    later = job([b1, b2], affinity="conv-1")
    s.submit(later)
    assert later.backend is not home


async def test_round_robin_policy_alternates(clock):
    b1, b2 = FakeBackend("b1", capacity=8), FakeBackend("b2", capacity=8)
    s = make(clock, policy="round_robin")
    got = []
    for _ in range(4):
        j = job([b1, b2], affinity="same")
        s.submit(j)
        got.append(j.backend.name)
        s.release(j)
    assert got in (["b1", "b2", "b1", "b2"], ["b2", "b1", "b2", "b1"])


def fail(b, clock, times=1):
    for _ in range(times):
        b.breaker.record(Outcome.FAILURE, probe=False, now=clock())


async def test_ejected_replica_gets_no_requests_then_one_probe(clock):
    b1, b2 = FakeBackend("b1", capacity=8), FakeBackend("b2", capacity=8)
    s = make(clock)
    fail(b1, clock, 3)
    assert not b1.routable(clock())
    jobs = [job([b1, b2]) for _ in range(4)]
    for j in jobs:
        s.submit(j)
    assert all(j.backend is b2 for j in jobs)
    clock.now += 6  # past the ejection: half-open, exactly one probe
    probe, after = job([b1, b2]), job([b1, b2])
    s.submit(probe)
    s.submit(after)
    assert probe.backend is b1 and probe.probe and b1.breaker.probe_out and after.backend is b2
    assert not after.probe
    b1.breaker.record(Outcome.SUCCESS, probe=probe.probe, now=clock())
    assert b1.routable(clock()) and b1.breaker.failures == 0 and b1.breaker.state is BreakerState.CLOSED


@pytest.mark.parametrize("outcome", [Outcome.NEUTRAL, Outcome.FAILURE])
async def test_a_probe_that_ends_without_success_never_leaves_the_replica_waiting_forever(clock, outcome):
    # The regression: a probe ended by a client disconnect, a timeout, a 4xx or a disallowed retry
    # left the replica `probing`, and no request was ever routed to it again.
    b = FakeBackend("b1", capacity=8)
    s = make(clock)
    fail(b, clock, 3)
    clock.now += 6
    probe = job([b])
    s.submit(probe)
    assert probe.probe
    s.release(probe)
    b.breaker.record(outcome, probe=True, now=clock())
    if outcome is Outcome.FAILURE:  # open again, for longer; then half-open again
        assert not b.routable(clock())
        clock.now += 11
    nxt = job([b])
    s.submit(nxt)
    assert nxt.backend is b and nxt.probe


async def test_requests_queued_behind_an_open_breaker_go_when_it_lets_a_probe_through():
    b1, b2 = FakeBackend("b1", capacity=2), FakeBackend("b2", capacity=1)
    s = scheduler()
    for _ in range(3):
        b1.breaker.record(Outcome.FAILURE, probe=False, now=s.clock())
    b1.breaker.open_until = s.clock() + 0.05  # (a short backoff, so the test is quick)
    busy = job([b2])
    s.submit(busy)
    j = job([b1, b2])
    s.submit(j)
    assert busy.backend is b2 and j.backend is None  # b2 is full, b1 held back by its breaker
    async with asyncio.timeout(5):  # nothing else happens: only the scheduler's own timer can start it
        assert await j.future is b1
    assert j.probe


async def test_a_model_whose_replicas_are_all_held_back_is_still_served(clock):
    # The breaker chooses among replicas: a lone runtime that failed three times still gets the next
    # request (its own error then reaches the client at once, not a queue timeout a minute later).
    b = FakeBackend("b1", capacity=2)
    s = make(clock)
    fail(b, clock, 3)
    assert not b.routable(clock())
    j = job([b])
    s.submit(j)
    assert j.backend is b and not j.probe
    b2 = FakeBackend("b2", capacity=2)
    fail(b2, clock, 3)
    k = job([b, b2])
    s.submit(k)
    assert k.backend in (b, b2)


async def test_a_full_queue_for_one_model_does_not_refuse_another_model(clock):
    one = ClassConfig("standard", 1, max_queue=2)
    busy, idle = FakeBackend("busy", capacity=1), FakeBackend("idle", capacity=64)
    s = make(clock)
    s.submit(job([busy], cls=one, model="a"))
    for _ in range(2):
        s.submit(job([busy], cls=one, model="a"))
    with pytest.raises(QueueFull, match="model 'a'"):
        s.submit(job([busy], cls=one, model="a"))
    other = job([idle], cls=one, model="b")
    s.submit(other)  # the regression: 429 queue_full although 'b' has 64 idle slots
    assert other.backend is idle


async def test_a_retried_request_is_charged_once_in_fair_share(clock):
    b1, b2 = FakeBackend("b1", capacity=8), FakeBackend("b2", capacity=8)
    s = make(clock)
    j = job([b1, b2], tenant="t", est_prompt_tokens=10, est_output_tokens=20)
    s.submit(j)
    first = s.tenants["t"].counter
    assert first == j.estimate
    j.exclude.add(j.backend.name)  # what the gateway does before a retry
    s.release(j)
    j.future = asyncio.get_running_loop().create_future()  # (acquire() makes a new one per wait)
    s.submit(j)
    assert j.backend is not None and s.tenants["t"].counter == first == s.served_tokens["t"]
    s.release(j, prompt_tokens=10, completion_tokens=5)
    assert s.tenants["t"].counter == 10 + 2 * 5


async def test_excluded_replica_is_skipped_on_retry(clock):
    b1, b2 = FakeBackend("b1", capacity=8), FakeBackend("b2", capacity=8)
    s = make(clock)
    j = job([b1, b2], exclude={"b1"})
    s.submit(j)
    assert j.backend is b2


def _second_turn_with_home_full(clock, *, other_busy: int):
    """A conversation's first turn ran on ``home`` (2 slots); home is full again when its second
    turn comes, the other replica has ``other_busy`` of its 2 slots busy."""
    b1, b2 = FakeBackend("b1", capacity=2), FakeBackend("b2", capacity=2)
    s = make(clock)
    first = job([b1, b2], affinity="conv")
    s.submit(first)
    home = first.backend
    other = b2 if home is b1 else b1
    on_home = [job([home]), job([home])]
    s.submit(on_home[0])
    for _ in range(other_busy):
        s.submit(job([other]))
    s.release(first)
    s.submit(on_home[1])
    turn2 = job([b1, b2], affinity="conv")
    s.submit(turn2)
    return s, home, other, turn2, on_home


async def test_conversation_waits_for_its_full_home_replica_when_the_other_is_nearly_as_busy(clock):
    s, home, other, turn2, on_home = _second_turn_with_home_full(clock, other_busy=1)
    assert turn2.backend is None and other.in_flight == 1  # waits for home: 1.0 <= 0.5 + 1.0
    s.release(on_home[0])  # a slot frees on home: the conversation goes there, not to the other
    assert turn2.backend is home


async def test_conversation_waits_for_its_full_home_even_when_the_other_replica_is_idle(clock):
    # Recomputing a long prompt elsewhere costs more than waiting for one of home's slots.
    s, home, other, turn2, on_home = _second_turn_with_home_full(clock, other_busy=0)
    assert turn2.backend is None and other.in_flight == 0  # 1.0 <= 0 + 1.0
    s.release(on_home[0])
    assert turn2.backend is home


async def test_conversation_spills_when_home_is_much_busier(clock):
    b1, b2 = FakeBackend("b1", capacity=2), FakeBackend("b2", capacity=2)
    s = make(clock)
    first = job([b1, b2], affinity="conv")
    s.submit(first)
    home = first.backend
    other = b2 if home is b1 else b1
    s.submit(job([home]))
    s.submit(job([home]))  # one more queued for home
    turn2 = job([b1, b2], affinity="conv")
    s.submit(turn2)
    assert turn2.backend is other  # home full with one queued (1.5) > idle other (0) + slack 1.0


def shares_with_slow_clients(s: Scheduler, clock: Clock, loop, conc: dict[str, int], *, units: int = 60,
                             client_delay: float = 0.005) -> dict[str, int]:
    """Closed-loop clients as they really are: each answer takes 1 s and answers started together
    end together (the runtime batches them), and a client sends its next request ``client_delay``
    after an answer ends. Returns the tokens each tenant was served in ``units`` seconds."""
    backend = FakeBackend(capacity=4)  # batch may hold 3 of 4
    served = dict.fromkeys(conc, 0)
    ends: list[tuple[float, Job]] = []  # dispatched jobs and when they end
    sends: list[tuple[float, str]] = [(clock.now, t) for t, n in conc.items() for _ in range(n)]
    pending: list[Job] = []
    stop = clock.now + units
    while clock.now < stop:
        candidates = [t for t, _ in ends] + [t for t, _ in sends] + [h.until for h in s.holds]
        clock.now = min(candidates)
        s.expire_due()
        for t, tenant in [x for x in sends if x[0] <= clock.now]:
            sends.remove((t, tenant))
            j = job([backend], "batch", tenant=tenant, loop=loop, est_prompt_tokens=10,
                    est_output_tokens=100)
            pending.append(j)
            s.submit(j)
        for t, j in sorted([x for x in ends if x[0] <= clock.now], key=lambda x: x[1].seq):
            ends.remove((t, j))
            served[j.tenant] += 100
            s.release(j, prompt_tokens=10, completion_tokens=100)
            sends.append((clock.now + client_delay, j.tenant))
        for j in [j for j in pending if j.backend is not None]:
            pending.remove(j)
            ends.append((clock.now + 1.0, j))
    return served


async def test_held_slot_gives_a_tenant_with_few_slow_streams_its_share(clock):
    loop = asyncio.get_running_loop()
    with_hold = shares_with_slow_clients(make(clock, hold_s=0.05), clock, loop, {"a": 8, "b": 2})
    without = shares_with_slow_clients(make(clock, hold_s=0.0), clock, loop, {"a": 8, "b": 2})
    share = {k: v["b"] / (v["a"] + v["b"]) for k, v in (("hold", with_hold), ("none", without))}
    # Without the hold, each of b's answers ends in the same instant as a's, a's queued requests
    # take every freed slot before b's client has sent its next one, and b gets one slot of three.
    assert share["none"] < 0.4, share
    assert 0.45 <= share["hold"] <= 0.55, share


def _underserved_b_releasing(clock: Clock, **kw) -> tuple[Scheduler, FakeBackend, Job, list[Job]]:
    """b (light) and a (heavy, two queued) share a 2-slot backend; b's request ends, under-served."""
    b = FakeBackend(capacity=2)
    s = make(clock, **kw)
    b1 = job([b], tenant="b")
    s.submit(b1)
    a_jobs = [job([b], tenant="a") for _ in range(3)]
    for j in a_jobs:
        s.submit(j)
    assert b1.backend is b and a_jobs[0].backend is b and a_jobs[1].backend is None
    clock.now += 1
    s.release(b1, prompt_tokens=1, completion_tokens=1)
    return s, b, b1, a_jobs


async def test_slot_freed_by_an_underserved_tenant_is_held_for_its_next_request(clock):
    s, b, _, a_jobs = _underserved_b_releasing(clock, hold_s=0.05)
    assert a_jobs[1].backend is None and len(s.holds) == 1  # held, though a is queued
    clock.now += 0.004
    b2 = job([b], tenant="b")
    s.submit(b2)
    assert b2.backend is b and not s.holds


async def test_hold_ends_when_the_tenant_does_not_come_back_and_is_not_repeated(clock):
    s, b, _, a_jobs = _underserved_b_releasing(clock, hold_s=0.05)
    clock.now += 0.049
    s.expire_due()
    assert a_jobs[1].backend is None
    clock.now += 0.002
    s.expire_due()
    assert a_jobs[1].backend is b and not s.holds and not s.tenants["b"].anticipate
    clock.now += 5  # b comes back late: no hold at its next release
    b2, a4 = job([b], tenant="b"), job([b], tenant="a")
    s.submit(b2)
    s.release(a_jobs[0])
    s.release(a_jobs[1])
    assert b2.backend is b and a_jobs[2].backend is b
    s.submit(a4)
    s.release(b2, prompt_tokens=1, completion_tokens=1)
    assert not s.holds and a4.backend is b


async def test_hold_is_off_with_zero_and_never_blocks_a_better_class(clock):
    s, b, _, a_jobs = _underserved_b_releasing(clock, hold_s=0.0)
    assert a_jobs[1].backend is b and not s.holds
    s, b, _, a_jobs = _underserved_b_releasing(clock, hold_s=0.05)
    chat = job([b], "interactive", tenant="c")
    s.submit(chat)
    assert chat.backend is b  # the hold is for standard-class work; interactive goes first


async def test_no_hold_for_a_tenant_with_its_own_queued_request(clock):
    b = FakeBackend(capacity=1)
    s = make(clock, hold_s=0.05)
    mine = [job([b], tenant="b") for _ in range(2)]
    for j in mine:
        s.submit(j)
    other = job([b], tenant="a")
    s.submit(other)
    s.release(mine[0], prompt_tokens=1, completion_tokens=1)
    assert not s.holds and mine[1].backend is b


async def test_hold_never_stops_a_less_served_tenant(clock):
    b = FakeBackend(capacity=1)
    s = make(clock, hold_s=0.05)
    a1 = job([b], tenant="a")
    s.submit(a1)
    lo, hi = job([b], tenant="lo"), job([b], tenant="hi")
    s.submit(lo)
    s.submit(hi)
    s.tenants["a"].counter, s.tenants["lo"].counter, s.tenants["hi"].counter = 100, 50, 200
    s.release(a1)  # held against "hi", who has received more than "a"...
    assert lo.backend is b and hi.backend is None  # ...but "lo" has received less: the order stands
    assert not s.holds  # and with that slot taken, the hold stood for nothing


async def test_leftover_hold_lapsing_keeps_holds_for_a_tenant_that_came_back(clock):
    b = FakeBackend(capacity=3)
    s = make(clock, hold_s=0.05)
    mine = [job([b], tenant="b") for _ in range(2)]
    for j in mine:
        s.submit(j)
    theirs = [job([b], tenant="a") for _ in range(4)]
    for j in theirs:
        s.submit(j)
    s.tenants["b"].counter = 0.0  # b is the under-served one
    s.release(mine[0])
    s.release(mine[1])
    assert len(s.holds) == 2 and theirs[1].backend is None
    clock.now += 0.01
    again = job([b], tenant="b")  # b comes back with one request for its two freed slots
    s.submit(again)
    assert again.backend is b and len(s.holds) == 1
    clock.now += 0.05
    s.expire_due()
    assert not s.holds and theirs[1].backend is b
    assert s.tenants["b"].anticipate  # it did come back: the lapsed leftover does not count
