"""Preemption, decided with an injected clock: when a stream is suspended, which one, how often,
and how a suspended stream queues again (scheduling/preemption.py, the scheduler's books)."""

from __future__ import annotations

import asyncio
import math

import pytest

from passerelle.config import DEFAULT_CLASSES, ClassConfig
from passerelle.scheduling.job import Job, JobState
from passerelle.scheduling.scheduler import PreemptionPolicy, Scheduler
from tests.unit.test_scheduler import Clock, FakeBackend, scheduler
from tests.waiting import until

CLS = {c.name: c for c in DEFAULT_CLASSES}
POLICY = PreemptionPolicy(after_s=0.05, min_run_s=2.0)


@pytest.fixture
def clock():
    return Clock()


def make(clock, **kw) -> Scheduler:
    return scheduler(clock=clock, preemption=kw.pop("preemption", POLICY), hold_s=0, **kw)


def job(pool, cls="batch", tenant="t", **kw) -> Job:
    j = Job(pool=pool, cls=CLS[cls] if isinstance(cls, str) else cls, tenant=tenant, **kw)
    j.future = asyncio.get_running_loop().create_future()
    return j


class Stream:
    """A running stream's side of a suspension (a Suspendable): counts the calls, may refuse."""

    def __init__(self, ok: bool = True, tokens: int = 0, *, ends_at: float = math.inf,
                 clock: Clock | None = None) -> None:
        self.ok = ok
        self.calls = 0
        self.tokens = tokens
        self.ends_at, self.clock = ends_at, clock  # when it would end by itself (inf: not in sight)

    @property
    def left_s(self) -> float:
        return self.ends_at - self.clock.now if self.clock is not None else math.inf

    def suspend(self) -> bool:
        self.calls += 1
        return self.ok


def running_batch(s: Scheduler, b, n: int, clock, tenant="bulk") -> list[tuple[Job, Stream]]:
    out = []
    for _ in range(n):
        j = job([b], "batch", tenant=tenant)
        s.submit(j)
        assert j.backend is b
        stream = Stream()
        s.allow_suspend(j, stream)
        out.append((j, stream))
        clock.now += 0.1  # started one after the other
    return out


async def test_a_waiting_interactive_request_suspends_a_batch_stream_at_once(clock):
    """No stream is about to end by itself: waiting preempt_after_ms would only delay the
    request, so a stream is cut the moment it is queued and its slot is the request's."""
    b = FakeBackend(capacity=2)
    s = make(clock)
    (_older, s1), (newer, s2) = running_batch(s, b, 2, clock)
    chat = job([b], "interactive")
    s.submit(chat)
    assert chat.backend is None  # every slot is busy (batch may hold them all with preemption on)
    s.preemptor.check()  # (the timer's call, due at once)
    # the stream that started last is cut; its slot goes to the interactive request at once
    assert (s2.calls, s1.calls) == (1, 0)
    assert chat.backend is b and b.in_flight == 2
    assert newer.backend is None and newer in s.waiting and newer.state is JobState.SUSPENDED
    assert (s.preemptor.suspensions, s.preemptor.resumes) == (1, 0)
    # it resumes when a slot frees, before batch work that came after it
    later = job([b], "batch", tenant="bulk")
    s.submit(later)
    s.release(chat)
    assert newer.backend is b and later.backend is None
    assert (s.preemptor.suspensions, s.preemptor.resumes) == (1, 1)


async def test_a_stream_about_to_end_is_waited_for_at_most_preempt_after(clock):
    """A stream expected to end by itself within preempt_after_ms frees a slot for nothing: the
    request waits for it; if it has not ended by then, a stream is cut after all."""
    b = FakeBackend(capacity=2)
    s = make(clock)
    (ending, s1), (_other, s2) = running_batch(s, b, 2, clock)
    s1.ends_at, s1.clock = clock.now + 0.03, clock  # 3 tokens left at 10 ms each
    chat = job([b], "interactive")
    s.submit(chat)
    s.preemptor.check()
    assert chat.backend is None and s1.calls == s2.calls == 0
    clock.now += 0.02
    s.preemptor.check()
    assert chat.backend is None
    s.release(ending)  # it ended by itself: its slot, and nothing was cut
    assert chat.backend is b and s2.calls == 0 and s.preemptor.suspensions == 0

    s = make(clock)
    (slow, s1), (_other, s2) = running_batch(s, b := FakeBackend(capacity=2), 2, clock)
    s1.ends_at, s1.clock = clock.now + 0.045, clock  # expected within the wait, but it runs late
    chat = job([b], "interactive")
    s.submit(chat)
    clock.now += 0.012
    s.preemptor.check()
    assert chat.backend is None and s1.calls == s2.calls == 0  # it might still end within the wait
    clock.now += 0.039
    s.preemptor.check()
    assert chat.backend is b and s.preemptor.suspensions == 1  # 51 ms: one was cut after all
    assert slow.backend is b  # (not the one about to end: it may still free its slot by itself)


async def test_nothing_is_suspended_while_a_slot_is_free_or_for_the_same_class(clock):
    b = FakeBackend(capacity=3)
    s = make(clock)
    streams = running_batch(s, b, 2, clock)
    more = job([b], "batch")
    s.submit(more)  # takes the free slot
    s.allow_suspend(more, Stream())
    again = job([b], "batch", tenant="other")
    s.submit(again)
    clock.now += 1.0
    s.preemptor.check()
    assert again.backend is None and all(st.calls == 0 for _, st in streams)


async def test_a_stream_is_not_suspended_twice_within_min_run_s(clock):
    b = FakeBackend(capacity=1)
    s = make(clock)
    ((bulk, stream),) = running_batch(s, b, 1, clock)
    first = job([b], "interactive")
    s.submit(first)
    clock.now += 0.06
    s.preemptor.check()
    assert first.backend is b and stream.calls == 1
    s.release(first)
    assert bulk.backend is b  # resumed
    s.allow_suspend(bulk, stream)
    second = job([b], "interactive")
    s.submit(second)
    clock.now += 1.0
    s.preemptor.check()
    assert second.backend is None and stream.calls == 1  # 1.06 s after its suspension: not yet
    clock.now += 1.0
    s.preemptor.check()
    assert second.backend is b and stream.calls == 2


async def test_the_worst_class_is_cut_first_and_a_stream_that_cannot_be_is_passed_over(clock):
    b = FakeBackend(capacity=3)
    low = ClassConfig("bulk", 3, preemptible=True)
    s = make(clock, classes=(*DEFAULT_CLASSES, low))
    a = job([b], "batch")
    s.submit(a)
    s.allow_suspend(a, sa := Stream())
    clock.now += 1
    c = job([b], low)
    s.submit(c)
    s.allow_suspend(c, sc := Stream(ok=False))  # e.g. it is about to end by itself
    clock.now += 1
    d = job([b], "batch")
    s.submit(d)
    s.allow_suspend(d, sd := Stream())
    chat = job([b], "interactive")
    s.submit(chat)
    clock.now += 0.1
    s.preemptor.check()
    # the worst class (bulk) was asked first and refused; then the batch stream started last
    assert (sc.calls, sd.calls, sa.calls) == (1, 1, 0)
    assert chat.backend is b and d.backend is None and c.backend is b


async def test_classes_that_are_not_preemptible_and_streams_not_marked_suspendable_are_never_cut(clock):
    b = FakeBackend(capacity=2)
    s = make(clock)
    std = job([b], "standard")
    s.submit(std)
    s.allow_suspend(std, st := Stream())  # standard is not preemptible: ignored
    unsafe = job([b], "batch")
    s.submit(unsafe)  # a batch request with tools: the gateway never allows it
    chat = job([b], "interactive")
    s.submit(chat)
    clock.now += 10
    s.preemptor.check()
    assert chat.backend is None and st.calls == 0 and not s.preemptor.suspendable


async def test_preemption_off_suspends_nothing(clock):
    b = FakeBackend(capacity=1)
    s = make(clock, preemption=None)
    bulk = job([b], "batch")
    s.submit(bulk)
    s.allow_suspend(bulk, stream := Stream())
    chat = job([b], "interactive")
    s.submit(chat)
    clock.now += 10
    assert s.preemptor is None
    s.expire_due()  # (the synchronous callers' check of everything due)
    assert chat.backend is None and stream.calls == 0


async def test_a_class_over_its_own_share_does_not_preempt(clock):
    b = FakeBackend(capacity=2)
    narrow = ClassConfig("interactive", 0, slot_share=0.5)
    s = make(clock, classes=(narrow, CLS["standard"], CLS["batch"]))
    first = job([b], narrow)
    s.submit(first)
    ((_bulk, stream),) = running_batch(s, b, 1, clock)
    second = job([b], narrow)
    s.submit(second)
    clock.now += 1
    s.preemptor.check()
    assert second.backend is None and stream.calls == 0  # a free slot would not be its to take


async def test_a_suspended_stream_ages_like_a_queued_request_and_keeps_its_place(clock):
    b = FakeBackend(capacity=1)
    s = make(clock, aging_s=30)
    first = job([b], "batch", tenant="bulk")
    queued_before = job([b], "batch", tenant="bulk")
    s.submit(first)
    s.allow_suspend(first, Stream())
    s.submit(queued_before)
    clock.now += 20  # queued_before has waited 20 s; first ran 20 s
    chat = job([b], "interactive")
    s.submit(chat)
    clock.now += 0.1
    s.preemptor.check()
    assert first.state is JobState.SUSPENDED and first.waited_s == 0.0
    # first is ahead of queued_before in its tenant's order (it arrived first)...
    assert s.place(first, clock.now) < s.place(queued_before, clock.now)
    # ...and its aging counts only the time it waited, not the 20 s it ran
    clock.now += 15
    assert s.place(first, clock.now)[0] == 2 and s.place(queued_before, clock.now)[0] == 1


async def test_a_suspended_job_whose_client_leaves_is_removed(clock):
    b = FakeBackend(capacity=1)
    s = make(clock)
    ((bulk, _),) = running_batch(s, b, 1, clock)
    chat = job([b], "interactive")
    s.submit(chat)
    clock.now += 0.1
    s.preemptor.check()
    assert bulk in s.waiting
    s.release(bulk, prompt_tokens=10, completion_tokens=5)  # the gateway's finally, after the client left
    assert bulk not in s.waiting and s.tenants["bulk"].waiting == 0 and b.in_flight == 1


async def test_the_timer_fires_by_itself(clock):
    """In the event loop the scheduler arms its own timer (the real clock here)."""
    b = FakeBackend(capacity=1)
    s = scheduler(preemption=PreemptionPolicy(after_s=0.02, min_run_s=2.0), hold_s=0)
    bulk = job([b], "batch")
    s.submit(bulk)
    s.allow_suspend(bulk, stream := Stream())
    chat = job([b], "interactive")
    got = await asyncio.wait_for(s.acquire(chat), timeout=5)
    assert got is b and stream.calls == 1


async def test_a_suspended_stream_resumes_in_the_slot_it_left(clock):
    b = FakeBackend(capacity=3)
    b.slot_ids = True
    s = make(clock)
    streams = []
    for _ in range(3):
        j = job([b], "batch", slotted=True)
        s.submit(j)
        s.allow_suspend(j, Stream())
        streams.append(j)
        clock.now += 0.1
    assert sorted(j.slot for j in streams) == [0, 1, 2]
    victim = streams[-1]
    left = victim.slot
    chat = job([b], "interactive", slotted=True)
    s.submit(chat)
    clock.now += 0.1
    s.preemptor.check()
    assert chat.slot == left  # the freed slot, the only one
    s.release(chat)
    assert victim.backend is b and victim.slot == left  # back where its prompt cache is


def test_slot_choice_prefers_the_conversations_slot_then_the_least_recently_used():
    from passerelle.scheduling.slots import SlotMap

    slots = SlotMap(3)
    a, b, c = (Job(pool=[], cls=CLS["standard"], tenant="t", affinity=k) for k in ("chat-a", "chat-b", "chat-c"))
    for t, j in enumerate((a, b, c)):
        j.slot = slots.take(j, float(t))
    assert (a.slot, b.slot, c.slot) == (0, 1, 2)
    for j in (c, a, b):
        slots.give(j)
    again_b = Job(pool=[], cls=CLS["standard"], tenant="t", affinity="chat-b")
    assert slots.take(again_b, 10.0) == 1  # its conversation's slot
    new = Job(pool=[], cls=CLS["standard"], tenant="t")
    assert slots.take(new, 11.0) == 0  # least recently used of the free ones


async def test_a_check_that_comes_a_little_early_comes_back(clock):
    """The loop's timers run on a coarser clock than the scheduler's: one that fires a hair before
    the request is due must not leave it waiting for a slot to free by itself."""
    b = FakeBackend(capacity=1)
    s = make(clock)
    ((_bulk, stream),) = running_batch(s, b, 1, clock)
    stream.ends_at, stream.clock = clock.now + 0.0499, clock  # about to end: waited for, up to preempt_after_ms
    chat = job([b], "interactive")
    s.submit(chat)
    clock.now += 0.0497
    s.preemptor.check()
    assert chat.backend is None and s.preemptor._timer is not None
    s.preemptor._timer.cancel()
    clock.now += 0.001
    s.preemptor._fired()
    assert chat.backend is b


def test_arming_again_under_uvloop_when_the_first_timer_was_already_due():
    """uvloop's call_at with a time already past gives a plain Handle (no when()): arming the
    check again must not depend on it."""
    import uvloop

    async def run() -> None:
        clock = Clock()
        b = FakeBackend(capacity=1)
        s = make(clock)
        bulk = job([b], "batch")
        s.submit(bulk)
        chat = job([b], "interactive")
        s.submit(chat)  # nothing suspendable yet: no timer
        clock.now += 1.0  # the interactive request is long due when the stream becomes suspendable
        s.allow_suspend(bulk, stream := Stream())
        s.submit(job([b], "interactive"))  # arms again while the first (already due) timer is pending
        await until(lambda: stream.calls and chat.backend is b, what="the due timer suspending the stream for chat")
        assert stream.calls == 1

    uvloop.run(run())


async def test_of_one_class_the_stream_that_sent_least_is_cut(clock):
    """Its continuation's prompt grows by what it sent, which the runtime may compute again."""
    b = FakeBackend(capacity=2)
    s = make(clock)
    long_ago = job([b], "batch")
    s.submit(long_ago)
    s.allow_suspend(long_ago, few := Stream(tokens=3))
    clock.now += 1
    recent = job([b], "batch")
    s.submit(recent)
    s.allow_suspend(recent, many := Stream(tokens=40))
    chat = job([b], "interactive")
    s.submit(chat)
    clock.now += 0.1
    s.preemptor.check()
    assert (few.calls, many.calls) == (1, 0) and chat.backend is b


def test_a_job_moves_only_along_its_diagram():
    """waiting → running → suspended → running → done; a retry queues a done job again; any other
    move is a bug caught where it happens."""
    j = Job(pool=[], cls=CLS["batch"], tenant="t")
    for state in (JobState.WAITING, JobState.RUNNING, JobState.SUSPENDED, JobState.RUNNING, JobState.DONE,
                  JobState.WAITING, JobState.DONE):
        j.to(state)
        assert j.state is state
    with pytest.raises(RuntimeError, match="illegal transition DONE -> SUSPENDED"):
        j.to(JobState.SUSPENDED)
    with pytest.raises(RuntimeError, match="WAITING -> SUSPENDED"):
        Job(pool=[], cls=CLS["batch"], tenant="t", state=JobState.WAITING).to(JobState.SUSPENDED)


async def test_a_suspended_job_the_client_left_is_done_and_gone_from_the_queue(clock):
    b = FakeBackend(capacity=1)
    s = make(clock)
    (bulk, _), = running_batch(s, b, 1, clock)
    s.submit(chat := job([b], "interactive"))
    clock.now += 0.1
    s.preemptor.check()
    assert bulk.state is JobState.SUSPENDED and chat.state is JobState.RUNNING
    s.release(bulk)  # its client left while it waited to resume
    assert bulk.state is JobState.DONE and bulk not in s.waiting and s.tenants["bulk"].waiting == 0
