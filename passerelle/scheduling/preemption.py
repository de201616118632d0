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
* among victims, the worst class first, then the stream that (re)started last: it has the
  least to lose and older streams get to finish.

A suspended stream queues again with its place in its tenant's order and the time it already
waited, so it ages like any queued request and cannot starve.

Example::

    policy = PreemptionPolicy(after_s=0.05, min_run_s=2.0)
    victim = pick_victim(running_on_backend, rank=0, now=clock(), policy=policy)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

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
    best: Job | None = None
    for v in running:
        if may_suspend(v, rank, now, policy) and (
                best is None or (v.cls.rank, v.started_at) > (best.cls.rank, best.started_at)):
            best = v
    return best


def next_eligible(running: Iterable[Job], policy: PreemptionPolicy) -> float:
    """The earliest time one of ``running`` that was suspended recently may be suspended again."""
    return min((v.suspended_at + policy.min_run_s for v in running if v.suspend is not None
                and v.suspended_at > -math.inf), default=math.inf)
