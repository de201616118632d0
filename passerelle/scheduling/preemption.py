"""When to suspend a running stream for a waiting request of a better class, and which one.

llama-server (like most runtimes) cannot preempt: a slot stays busy until its request ends. A
batch flood therefore either holds every slot, and an interactive request waits seconds for one,
or is kept off some slots "just in case", and batch loses their throughput all the time. The
gateway can do better, because it owns the client's stream: it cuts one lower-class stream
upstream (the slot frees at once), keeps the client's connection open, and later resumes the
stream as a continuation (proxy/resume.py), the client seeing one unbroken stream.

The rules, applied by the scheduler with its own clock:

* a waiting request is **due** at once, unless a stream on the backend is expected to end by
  itself within ``after_s`` (``preempt_after_ms``): its tokens left at its own pace
  (``Suspendable.left_s``). Then the request waits for that slot, at most ``after_s`` from when
  it joined the queue: a slot that frees on its own costs nothing, a cut costs the victim the
  tokens generated after it and a re-prefill. Waiting without such a stream in sight only
  delayed the request (under a batch flood a slot frees on its own within 50 ms one time in
  twenty, and the runtime takes another decode step or two to notice the cut);
* on a backend where it cannot start only because every slot is busy (not because its own
  class already holds its share), a **victim** is a stream running there whose class is
  preemptible and worse than the request's (aging included), whose stream can be suspended now,
  and that was not suspended within ``min_run_s`` (churn is bounded: every stream makes progress);
* among victims, the worst class first, then the stream that has sent the fewest tokens: its
  continuation's prompt grows by what it sent, and the runtime may have to compute that part
  again (llama-server with a sliding-window model does); then the one that (re)started last.

A suspended stream queues again with its place in its tenant's order and the time it already
waited, so it ages like any queued request and cannot starve.

The rules are the functions below; :class:`Preemptor` applies them beside the scheduler, which it
sees through the narrow :class:`Books` protocol (the queue, a request's rank, whether a backend is
full, and ``suspend``). The gateway hands it each stream that may be cut now, a
:class:`~passerelle.scheduling.job.Suspendable` (``scheduler.allow_suspend(job, splice)``), and
takes it back when the stream ends. A suspension, top to bottom:

    Preemptor.check()                   a due waiting request, a full backend, a victim (pick_victim)
      └► stream.suspend()               the gateway's splice cuts the upstream stream (resume.py)
      └► Books.suspend(job)             the scheduler frees the slot, queues the job SUSPENDED, dispatches
    Gateway._dispatch                   the cut attempt ends; the job waits to resume; the next attempt
                                        continues the stream (proxy/gateway.py)

Example::

    policy = PreemptionPolicy(after_s=0.05, min_run_s=2.0)   # or PreemptionPolicy.of(cfg.scheduler)
    victim = pick_victim({job: stream}, rank=0, now=clock(), policy=policy)
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from passerelle.config import SchedulerConfig
from passerelle.runtimes.kinds import Backend
from passerelle.scheduling.job import Job, JobState, Suspendable


@dataclass(frozen=True)
class PreemptionPolicy:
    """``[scheduler] preempt_after_ms`` (in seconds) and ``min_run_s``: :meth:`of` reads them."""

    after_s: float
    min_run_s: float

    @classmethod
    def of(cls, sc: SchedulerConfig) -> PreemptionPolicy | None:
        """The policy ``[scheduler]`` asks for; None when preemption is off."""
        return cls(sc.preempt_after_ms / 1000, sc.min_run_s) if sc.preemption else None


@dataclass
class PreemptionCounts:
    """Streams suspended and resumed since start, whatever preemptor (a reload builds a new one) did it."""

    suspensions: int = 0
    resumes: int = 0


def is_due(job: Job, now: float, policy: PreemptionPolicy, streams: Iterable[Suspendable] = ()) -> bool:
    """May a stream be cut for ``job`` now? Yes once it has waited ``after_s`` (since it last
    joined the queue); before that, unless one of ``streams`` (the backend's) is expected to end
    by itself within the rest of that wait."""
    rest = job.queued_at + policy.after_s - now
    return rest <= 0 or all(s.left_s > rest for s in streams)


def may_suspend(victim: Job, rank: float, now: float, policy: PreemptionPolicy) -> bool:
    """May ``victim`` (a stream that may be cut) be suspended now for a request of effective rank ``rank``?"""
    return (victim.cls.preemptible and victim.cls.rank > rank
            and now - victim.suspended_at >= policy.min_run_s)


def pick_victim(streams: Mapping[Job, Suspendable], rank: float, now: float,
                policy: PreemptionPolicy) -> Job | None:
    """The stream to suspend among ``streams`` (one backend's, that may be cut), or None."""
    def order(v: Job) -> tuple[int, int, float]:
        return (v.cls.rank, -streams[v].tokens, v.started_at)

    eligible = [v for v in streams if may_suspend(v, rank, now, policy)]
    return max(eligible, key=order) if eligible else None


def next_eligible(streams: Mapping[Job, Suspendable], policy: PreemptionPolicy) -> float:
    """The earliest time one of ``streams`` that was suspended recently may be suspended again."""
    return min((v.suspended_at + policy.min_run_s for v in streams if v.suspended_at > -math.inf),
               default=math.inf)


class Books(Protocol):
    """What the preemptor reads of the scheduler, and the one thing it asks of it."""

    clock: Callable[[], float]
    waiting: list[Job]

    def place(self, job: Job, now: float) -> tuple[float, float, int]:
        """``job``'s place in the order now: (effective rank, tenant's counter, arrival)."""
        ...

    def only_slots_busy(self, backend: Backend, job: Job, now: float) -> bool:
        """Could ``job`` start on ``backend`` but for every slot being busy (not its class's share)?"""
        ...

    def suspend(self, job: Job) -> None:
        """Free ``job``'s slot now and queue it again, suspended (its stream is being cut)."""
        ...


class Preemptor:
    """Suspends a stream for every due waiting request that can only start that way."""

    def __init__(self, books: Books, policy: PreemptionPolicy, counts: PreemptionCounts | None = None) -> None:
        self.books = books
        self.policy = policy
        self.suspendable: dict[Job, Suspendable] = {}  # running jobs whose stream may be cut now
        self.counts = counts if counts is not None else PreemptionCounts()  # (/metrics, /admin/stats)
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0  # when it fires, on the loop's clock (uvloop's call_at with a time already
        # past gives a plain Handle, without when())

    @property
    def suspensions(self) -> int:
        """Streams suspended since start."""
        return self.counts.suspensions

    @property
    def resumes(self) -> int:
        """Suspended jobs started again since start."""
        return self.counts.resumes

    def take_over(self, old: Preemptor) -> None:
        """Replace ``old`` (a reload changed the policy): its streams that may be cut are this
        one's now, its timer is cancelled, and the waiting requests are checked again under the
        new policy. Streams already suspended are queued jobs: they resume as before."""
        old.close()
        self.suspendable = old.suspendable
        old.suspendable = {}
        self.arm()

    def close(self) -> None:
        """Stop checking (preemption turned off, or a new policy's preemptor took over)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def allow(self, job: Job, stream: Suspendable) -> None:
        """From now on ``job``'s stream may be cut: its relay runs and its request can be continued."""
        if job.state is not JobState.RUNNING or not job.cls.preemptible:
            return
        self.suspendable[job] = stream
        self.arm()

    def forbid(self, job: Job) -> None:
        self.suspendable.pop(job, None)

    def arm(self) -> None:
        """Check soon when a waiting request could preempt (it may be due at once: is_due)."""
        if not self.suspendable:
            return
        worst = max(v.cls.rank for v in self.suspendable)
        due = min((j.queued_at for j in self.books.waiting if j.cls.rank < worst), default=math.inf)
        if due < math.inf:
            self._call_at(due, replace=True)

    def check(self) -> None:
        """Suspend a stream for every due waiting request that can only start that way."""
        books, policy = self.books, self.policy
        now = books.clock()
        retry = math.inf
        for job in sorted(books.waiting, key=lambda j: books.place(j, now)):
            if not self.suspendable:
                break
            rank = books.place(job, now)[0]
            if ((job.future is not None and job.future.done()) or job.backend is not None
                    or rank >= max(v.cls.rank for v in self.suspendable)):
                continue  # (no stream it could preempt)
            for b in job.pool:
                if not books.only_slots_busy(b, job, now):
                    continue  # a slot is free, or its own class's share is what stops it
                on_b = {v: s for v, s in self.suspendable.items() if v.backend is b}
                if not is_due(job, now, policy, on_b.values()):
                    # a stream there ends soon: wait for its slot (a timer may also fire a little
                    # early on the loop's coarser clock: come back then)
                    retry = min(retry, job.queued_at + policy.after_s)
                    continue
                victim = self._cut(on_b, rank, now)
                if victim is not None:
                    self.counts.suspensions += 1
                    books.suspend(victim)
                    break
                retry = min(retry, next_eligible(on_b, policy))
        if retry < math.inf:
            self._call_at(max(retry, now + 0.001), replace=False)

    def _cut(self, on_b: dict[Job, Suspendable], rank: float, now: float) -> Job | None:
        """Cut the best victim's stream among ``on_b``; the job whose stream was cut, or None."""
        while (victim := pick_victim(on_b, rank, now, self.policy)) is not None:
            if on_b.pop(victim).suspend():
                return victim
            self.forbid(victim)  # it cannot after all (finishing, unsafe output)
        return None

    def _call_at(self, due: float, *, replace: bool) -> None:
        """Run :meth:`check` at ``due`` (the scheduler's clock); an earlier pending check stays."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): it calls check() itself
            return
        when = loop.time() + max(0.0, due - self.books.clock())
        if self._timer is not None:
            if not replace or self._timer_at <= when + 1e-4:
                return
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(when, self._fired), when

    def _fired(self) -> None:
        self._timer = None
        self.check()
