"""One request as the scheduler sees it: its state, and what the scheduler knows of it.

A job's life is a small state machine, validated on every change (as ``ProcState`` is for a
runtime process, runtimes/supervisor.py)::

    NEW ──submit──► WAITING ──start──► RUNNING ──release──► DONE ──retry elsewhere──► WAITING
                       │                │     ▲
                       │           suspend   start (resume)
                       │                ▼     │
                       │             SUSPENDED ──expire / client left──► DONE
                       └──expire / client left / displaced / its runtime failed──► DONE

* WAITING: queued for its first start (or a retry's); RUNNING: holds a slot on ``backend``;
* SUSPENDED: a preemptible stream cut for a better class (preemption.py): its slot was freed at
  once and it is queued again, keeping its place in its tenant's order (``seq``) and the time it
  already waited (``waited_s``, for aging), until it resumes as a continuation (proxy/resume.py);
* DONE: holds nothing and is not queued; a retry on another replica queues the same job again.

Example::

    job = Job(pool=[backend], cls=classes["batch"], tenant="nightly", est_output_tokens=512)
    backend = await scheduler.acquire(job)          # WAITING, then RUNNING
    scheduler.allow_suspend(job, splice)            # its stream may be cut and continued now
"""

from __future__ import annotations

import asyncio
import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from passerelle.config import ClassConfig
from passerelle.runtimes.kinds import Backend

if TYPE_CHECKING:
    from passerelle.scheduling.kv_store import KvPlan

# Weights of the service charged to a tenant: generating a token costs more than reading one.
PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class JobState(enum.Enum):
    NEW = "new"
    WAITING = "waiting"
    RUNNING = "running"
    SUSPENDED = "suspended"
    DONE = "done"

    # Members are singletons compared by identity: hashed by identity too (Enum's own hash is a
    # Python function hashing the name, run on every transition check of every request).
    __hash__ = object.__hash__


_ALLOWED = {
    JobState.NEW: {JobState.WAITING},
    JobState.WAITING: {JobState.RUNNING, JobState.DONE},
    JobState.RUNNING: {JobState.SUSPENDED, JobState.DONE},
    JobState.SUSPENDED: {JobState.RUNNING, JobState.DONE},
    JobState.DONE: {JobState.WAITING},  # a retry on another replica (proxy/retry.py)
}


class Suspendable(Protocol):
    """A running stream the scheduler may cut for a better class (the gateway's attempt)."""

    def suspend(self) -> bool:
        """Cut the stream upstream now; False when it cannot be continued after all."""
        ...

    @property
    def tokens(self) -> int:
        """Tokens it has sent so far: what resuming it costs."""
        ...

    @property
    def left_s(self) -> float:
        """Seconds until it ends by itself, at its own pace (its tokens left); inf when unknown."""
        ...


@dataclass(eq=False)
class Job:
    """One request waiting for, or holding, a backend slot."""

    pool: list[Backend]
    cls: ClassConfig
    tenant: str
    model: str = ""
    weight: float = 1.0
    est_prompt_tokens: int = 0
    est_output_tokens: int = 256
    can_wait_for_start: bool = False  # a supervised backend of the pool may come up
    affinity: str = ""  # conversation or session: prefer the replica that served it before
    session: str = ""  # its session's tenant-scoped key (session_kv.py session_key), "" for none
    exclude: set[str] = field(default_factory=set)  # replicas that already failed this request
    slotted: bool = False  # occupies a generation slot (chat, completions): may be given a slot id
    state: JobState = JobState.NEW
    seq: int = 0
    enqueued_at: float = 0.0  # for aging: when it was queued, less what it waited before a suspension
    queued_at: float = 0.0  # when it last joined the queue (arrival or suspension)
    backend: Backend | None = None
    slot: int | None = None  # the runtime's slot it was given (llama-server's id_slot), where named
    charged: float = 0.0
    probe: bool = False  # dispatched as its replica's half-open probe (breaker.py)
    max_wait_s: float | None = None  # longest wait in the queue; None: the class's max_queue_wait_s
    future: asyncio.Future[Backend] | None = None
    timer: asyncio.TimerHandle | None = None
    starts: int = 0  # times started: the first, then one per retry or resume
    started_at: float = 0.0  # when it last started (or resumed)
    waited_s: float = 0.0  # time spent queued before its last suspension
    suspended_at: float = -math.inf  # when it was last suspended (churn: preemption's min_run_s)
    resume_slot: int | None = None  # the slot it held when suspended: its prompt cache is there
    kv: KvPlan | None = None  # a session's KV to save/restore on its slot before it is sent (session_kv.py)
    prefill_s: float = 0.0  # its prompt's expected compute time where it would run best (prefill.py), at submit

    def to(self, state: JobState) -> None:
        """Move to ``state``; a transition the diagram above does not have is a bug."""
        if state not in _ALLOWED[self.state]:
            raise RuntimeError(f"job of tenant {self.tenant!r}: illegal transition {self.state.name} -> {state.name}")
        self.state = state

    @property
    def estimate(self) -> float:
        return PROMPT_WEIGHT * self.est_prompt_tokens + OUTPUT_WEIGHT * self.est_output_tokens
