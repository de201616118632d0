"""One request as the scheduler sees it: waiting for a backend slot, holding one, or suspended.

A job's life: queued (``waiting``) → started on a backend (``backend`` set, ``slot`` on runtimes
whose slots passerelle names) → released. A job of a preemptible class whose stream can be
continued may also be suspended while it runs: its slot is freed at once, and it queues again,
keeping its place in its tenant's order (``seq``) and the time it already waited (``waited_s``,
for aging), until it resumes as a continuation.

Example::

    job = Job(pool=[backend], cls=classes["batch"], tenant="nightly", est_output_tokens=512)
    backend = await scheduler.acquire(job)
    scheduler.allow_suspend(job, splice.suspend)   # while its stream may be cut and continued
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from passerelle.config import ClassConfig
from passerelle.runtimes.kinds import Backend

# Weights of the service charged to a tenant: generating a token costs more than reading one.
PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


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
    exclude: set[str] = field(default_factory=set)  # replicas that already failed this request
    slotted: bool = False  # occupies a generation slot (chat, completions): may be given a slot id
    seq: int = 0
    enqueued_at: float = 0.0  # for aging: when it was queued, less what it waited before a suspension
    backend: Backend | None = None
    slot: int | None = None  # the runtime's slot it was given (llama-server's id_slot), where named
    charged: float = 0.0
    probe: bool = False  # dispatched as its replica's half-open probe (breaker.py)
    max_wait_s: float | None = None  # longest wait in the queue; None: the class's max_queue_wait_s
    future: asyncio.Future[Backend] | None = None
    timer: asyncio.TimerHandle | None = None
    # -- preemption ---------------------------------------------------------------------------
    starts: int = 0  # times started: the first, then one per resume
    started_at: float = 0.0  # when it last started (or resumed)
    queued_at: float = 0.0  # when it last joined the queue (arrival or suspension)
    waited_s: float = 0.0  # time spent queued before its last suspension
    suspend: Callable[[], bool] | None = None  # set while its stream may be cut; False: not now
    progress: Callable[[], int] | None = None  # tokens its stream has sent (what resuming costs)
    suspended_at: float = -math.inf
    suspensions: int = 0
    resume_slot: int | None = None  # the slot it held when suspended: its prompt cache is there
    resuming: bool = False  # queued again after a suspension, not resumed yet

    @property
    def estimate(self) -> float:
        return PROMPT_WEIGHT * self.est_prompt_tokens + OUTPUT_WEIGHT * self.est_output_tokens
