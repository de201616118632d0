"""When to suspend a running stream for a waiting request of a better class, and which one.

llama-server (like most runtimes) cannot preempt: a slot stays busy until its request ends. A
batch flood therefore either holds every slot, and an interactive request waits seconds for one,
or is kept off some slots "just in case", and batch loses their throughput all the time. The
gateway can do better, because it owns the client's stream: it cuts one lower-class stream
upstream (the slot frees at once), keeps the client's connection open, and later resumes the
stream as a continuation (proxy/resume.py), the client seeing one unbroken stream.

The rules, applied by the scheduler with its own clock:

* a waiting request is **due** once it has waited ``after_s`` (``preempt_after_ms``): a slot
  that frees on its own within that time costs nothing;
* on a backend where it cannot start only because every slot is busy (not because its own
  class already holds its share), a **victim** is a stream running there whose class is
  preemptible and worse than the request's (aging included), whose stream can be suspended now,
  and that was not suspended within ``min_run_s`` (churn is bounded: every stream makes progress);
* among victims, the worst class first, then the stream that has sent the fewest tokens: its
  continuation's prompt grows by what it sent, and the runtime may have to compute that part
  again (llama-server with a sliding-window model does); then the one that (re)started last.

A suspended stream queues again with its place in its tenant's order and the time it already
waited, so it ages like any queued request and cannot starve.

The rules are the functions below; :class:`Preempting` applies them with the scheduler's books
(the scheduler is one): which streams may be suspended now, a timer for the next due request, the
suspension itself. The gateway marks a stream suspendable while its relay runs
(``allow_suspend(job, splice.suspend)``), and ``splice.suspend`` cuts it upstream.

Example::

    policy = PreemptionPolicy(after_s=0.05, min_run_s=2.0)
    victim = pick_victim(running_on_backend, rank=0, now=clock(), policy=policy)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from passerelle.config import ClassConfig
from passerelle.runtimes.kinds import Backend
from passerelle.scheduling.job import Job


@dataclass(frozen=True)
class PreemptionPolicy:
    after_s: float = 0.05
    min_run_s: float = 2.0


def is_due(job: Job, now: float, policy: PreemptionPolicy) -> bool:
    """Has ``job`` waited long enough (since it last joined the queue) to preempt for?"""
    return now - job.queued_at >= policy.after_s


def may_suspend(victim: Job, rank: float, now: float, policy: PreemptionPolicy) -> bool:
    """May ``victim`` be suspended now for a request of effective rank ``rank``?"""
    return (victim.cls.preemptible and victim.cls.rank > rank and victim.suspend is not None
            and now - victim.suspended_at >= policy.min_run_s)


def pick_victim(running: Iterable[Job], rank: float, now: float, policy: PreemptionPolicy) -> Job | None:
    """The stream to suspend among ``running`` (one backend's), or None."""
    def order(v: Job) -> tuple[int, int, float]:
        return (v.cls.rank, -(v.progress() if v.progress is not None else 0), v.started_at)

    eligible = [v for v in running if may_suspend(v, rank, now, policy)]
    return max(eligible, key=order) if eligible else None


def next_eligible(running: Iterable[Job], policy: PreemptionPolicy) -> float:
    """The earliest time one of ``running`` that was suspended recently may be suspended again."""
    return min((v.suspended_at + policy.min_run_s for v in running if v.suspend is not None
                and v.suspended_at > -math.inf), default=math.inf)


class Preempting:
    """Preemption's side of the scheduler (a base of ``Scheduler``, which provides the books)."""

    clock: Callable[[], float]
    waiting: list[Job]
    running: dict[tuple[str, str], int]
    on_change: Callable[[], None] | None
    preemption: PreemptionPolicy | None
    suspendable: set[Job]  # running jobs whose stream may be suspended now
    preempt_counts: dict[str, int]
    _preempt_timer: asyncio.Handle | None
    _preempt_at: float  # when it fires, on the loop's clock (uvloop's call_at with a time already
    # past gives a plain Handle, without when())

    # -- the scheduler's ----------------------------------------------------------------------
    def _key(self, job: Job, now: float) -> tuple[float, float, int]:
        raise NotImplementedError

    def _limit(self, backend: Backend, cls: ClassConfig) -> int:
        raise NotImplementedError

    def _free(self, job: Job, b: Backend) -> None:
        raise NotImplementedError

    def _requeue(self, job: Job, now: float) -> None:
        raise NotImplementedError

    def dispatch(self) -> None:
        raise NotImplementedError

    # -- preemption ---------------------------------------------------------------------------
    def allow_suspend(self, job: Job, suspend: Callable[[], bool],
                      progress: Callable[[], int] | None = None) -> None:
        """From now on ``job``'s stream may be suspended by calling ``suspend`` (which says
        False when it cannot be after all): its relay runs and its request can be continued.
        ``progress``: the tokens it has sent, what resuming it costs."""
        if self.preemption is None or job.backend is None or not job.cls.preemptible:
            return
        job.suspend, job.progress = suspend, progress
        self.suspendable.add(job)
        self._arm_preemption()

    def forbid_suspend(self, job: Job) -> None:
        job.suspend = None
        self.suspendable.discard(job)

    def _arm_preemption(self) -> None:
        """Check again when the earliest waiting request that could preempt becomes due."""
        policy = self.preemption
        if policy is None or not self.suspendable:
            return
        worst = max(v.cls.rank for v in self.suspendable)
        due = min((j.queued_at + policy.after_s for j in self.waiting if j.cls.rank < worst), default=math.inf)
        if due == math.inf:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): preempt_due() does it
            return
        when = loop.time() + max(0.0, due - self.clock())
        if self._preempt_timer is not None:
            if self._preempt_at <= when + 1e-4:
                return
            self._preempt_timer.cancel()
        self._preempt_timer, self._preempt_at = loop.call_at(when, self._preempt_fired), when

    def _preempt_fired(self) -> None:
        self._preempt_timer = None
        self.preempt_due()

    def preempt_due(self) -> None:
        """Suspend a stream for every due waiting request that can only start that way."""
        policy = self.preemption
        if policy is None:
            return
        now = self.clock()
        retry = math.inf
        for job in sorted(self.waiting, key=lambda j: self._key(j, now)):
            if not self.suspendable:
                break
            rank = self._key(job, now)[0]
            if ((job.future is not None and job.future.done()) or job.backend is not None
                    or rank >= max(v.cls.rank for v in self.suspendable)):
                continue  # (no stream it could preempt)
            if not is_due(job, now, policy):
                # (a timer may fire a little early on the loop's coarser clock: come back then)
                retry = min(retry, job.queued_at + policy.after_s)
                continue
            for b in job.pool:
                if (b.name in job.exclude or not b.routable(now) or b.in_flight < b.capacity
                        or self.running.get((b.name, job.cls.name), 0) >= self._limit(b, job.cls)):
                    continue  # a slot is free, or its own class's share is what stops it
                on_b = [v for v in self.suspendable if v.backend is b]
                victim = pick_victim(on_b, rank, now, policy)
                while victim is not None and not (victim.suspend is not None and victim.suspend()):
                    self.forbid_suspend(victim)  # it cannot after all (finishing, unsafe output)
                    on_b.remove(victim)
                    victim = pick_victim(on_b, rank, now, policy)
                if victim is not None:
                    self._suspend(victim, b, now)
                    break
                retry = min(retry, next_eligible(on_b, policy))
        if retry < math.inf:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
                if self._preempt_timer is None:
                    when = loop.time() + max(0.001, retry - now)
                    self._preempt_timer, self._preempt_at = loop.call_at(when, self._preempt_fired), when

    def _suspend(self, job: Job, b: Backend, now: float) -> None:
        """Free ``job``'s slot now and queue it again (its stream is being cut upstream)."""
        job.resume_slot = job.slot
        job.resuming = True
        self._free(job, b)
        job.suspensions += 1
        job.suspended_at = now
        self._requeue(job, now)
        self.preempt_counts["suspended"] += 1
        self.dispatch()
        if self.on_change:
            self.on_change()
