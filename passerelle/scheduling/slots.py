"""Which of a runtime's slots a request gets, where passerelle names it (llama-server's ``id_slot``).

With preemption on, a suspended stream should resume on the slot it left: llama-server keeps that
slot's tokens (or, when another request used the slot meanwhile, saves them to its host-memory
prompt cache and loads them back when the continuation asks for that slot), so the continuation's
prompt (the original prompt plus the text so far) costs next to nothing to process again. For
that passerelle must know which slot every request holds, so it names the slot of every request
it sends such a runtime, choosing as llama-server would:

1. a resuming stream: the slot it left, when free;
2. the free slot that last served the same conversation or session (``Job.affinity``), whose
   prompt cache holds its opening (what llama-server's prompt-similarity choice achieves);
3. the free slot used least recently.

The scheduler never sends a backend more requests than its capacity, so a free slot exists
whenever a request starts.

Example::

    slots = SlotMap(4)
    job.slot = slots.take(job, now)    # 0..3
    slots.give(job)
"""

from __future__ import annotations

import math

from passerelle.scheduling.job import Job


class SlotMap:
    def __init__(self, size: int) -> None:
        self.holder: list[Job | None] = []
        self.key: list[str] = []  # affinity of the request each slot served last
        self.used: list[float] = []  # when each slot was last taken
        self.grow(size)

    def grow(self, size: int) -> None:
        """Room for ``size`` slots (a runtime that reported more; never shrinks: ids stay valid)."""
        while len(self.holder) < size:
            self.holder.append(None)
            self.key.append("")
            self.used.append(-math.inf)

    def take(self, job: Job, now: float) -> int:
        free = [i for i, h in enumerate(self.holder) if h is None]
        if not free:  # more in flight than slots named: the runtime queues it (it should not happen)
            self.grow(len(self.holder) + 1)
            free = [len(self.holder) - 1]
        if job.resume_slot in free:
            slot = job.resume_slot
        else:
            same = [i for i in free if job.affinity and self.key[i] == job.affinity]
            slot = min(same or free, key=lambda i: self.used[i])
        self.holder[slot], self.key[slot], self.used[slot] = job, job.affinity, now
        return slot

    def give(self, job: Job) -> None:
        if job.slot is not None and job.slot < len(self.holder) and self.holder[job.slot] is job:
            self.holder[job.slot] = None
