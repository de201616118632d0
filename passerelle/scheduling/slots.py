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

Sessions (scheduling/session_kv.py, ``[sessions] keep_kv``) add three things per slot: the session
whose KV it holds (``kv``), whether that KV is saved already (``saved``: a request waiting for a held
slot has it saved ahead, while it waits; where most holds end taken, ``save_on_release``, it is saved
as the turn ends), and a *hold*: after a session's turn its slot is kept for
the session's next turn until ``until`` (session_hold.py). A free slot held for another session is
taken only when no other is free (the scheduler starts a request then only once that slot's KV is
saved, or it waited its class's ``session_wait_s``), a saved one first, then the hold ending first.
Among the rest a session's request prefers its held slot, then a slot with its KV, then one holding
no session's KV, then the least recently used.

Example::

    slots = SlotMap(4)
    job.slot = slots.take(job, now)    # 0..3
    slots.give(job)
"""

from __future__ import annotations

import math
from collections.abc import Container

from passerelle.scheduling.job import Job

TAKEN_WEIGHT = 0.25  # of the latest hold's outcome in ``taken_share``
SAVE_ON_RELEASE = 0.5  # ``taken_share`` from which a session's KV is saved as its turn ends


class SlotMap:
    def __init__(self, size: int, counts: dict[str, int] | None = None) -> None:
        # holds kept (by their session), taken (by another request), lapsed (ended unused)
        self.counts = counts if counts is not None else {"kept": 0, "taken": 0, "lapsed": 0}
        self.holder: list[Job | None] = []
        self.key: list[str] = []  # affinity (or session) of the request each slot served last
        self.used: list[float] = []  # when each slot was last taken
        self.kv: list[str] = []  # the session whose KV the slot holds ("": none)
        self.saved: list[bool] = []  # ...and that KV is saved (the slot may go without a save)
        self.held: list[str] = []  # the session the free slot is held for ("": none)
        self.until: list[float] = []  # ...until then
        self.holds = 0  # slots with a hold (possibly expired): none, and take() is as without sessions
        # A moving share of the holds whose slot another request took before their session came
        # back: where most are, a session's KV is saved as its turn ends (``save_on_release``).
        self.taken_share = 0.0
        self.grow(size)

    def grow(self, size: int) -> None:
        """Room for ``size`` slots (a runtime that reported more; never shrinks: ids stay valid)."""
        while len(self.holder) < size:
            self.holder.append(None)
            self.key.append("")
            self.used.append(-math.inf)
            self.kv.append("")
            self.saved.append(False)
            self.held.append("")
            self.until.append(-math.inf)

    def held_against(self, session: str, now: float) -> tuple[int, float]:
        """Free slots held for sessions other than ``session`` at ``now`` whose KV is not saved yet,
        and when the first of those holds ends (inf: none)."""
        n, first = 0, math.inf
        if self.holds:
            for i in range(len(self.held)):
                if self._held_unsaved(i, session, now):
                    n += 1
                    first = min(first, self.until[i])
        return n, first

    def _held_unsaved(self, i: int, session: str, now: float) -> bool:
        """Is slot ``i`` free, held for a session other than ``session`` at ``now``, its KV not saved?"""
        h = self.held[i]
        return bool(h) and h != session and self.holder[i] is None and self.until[i] > now and not self.saved[i]

    def to_save(self, session: str, now: float, saving: Container[int] = ()) -> tuple[int, str] | None:
        """The held slot a request of ``session`` waits for (the hold ending first, among those
        with a session's KV not saved yet, nor being saved: ``saving``), and that KV's session:
        what to save ahead."""
        best = None
        for i in range(len(self.held)):
            if (self._held_unsaved(i, session, now) and self.kv[i] and i not in saving
                    and (best is None or self.until[i] < self.until[best])):
                best = i
        return None if best is None else (best, self.kv[best])

    def mark_saved(self, slot: int, session: str) -> bool:
        """``session``'s KV on ``slot`` was saved; False when the slot has moved on meanwhile."""
        if slot < len(self.kv) and self.kv[slot] == session and self.holder[slot] is None:
            self.saved[slot] = True
            return True
        return False

    def take(self, job: Job, now: float) -> int:
        """A free slot for ``job`` (no session: see :meth:`take_for`)."""
        return self.take_for(job, now)[0]

    def take_for(self, job: Job, now: float, session: str = "") -> tuple[int, str, bool]:
        """A free slot for ``job`` (of ``session``, "" for none); the session whose KV the slot
        held ("" for none, or ``session`` itself), and whether that KV is saved already (if not,
        the caller saves it before use)."""
        free = [i for i, h in enumerate(self.holder) if h is None]
        if not free:  # more in flight than slots named: the runtime queues it (it should not happen)
            self.grow(len(self.holder) + 1)
            free = [len(self.holder) - 1]
        key = session or job.affinity
        if job.resume_slot in free:
            slot = job.resume_slot
        elif not self.holds:
            same = [i for i in free if key and self.key[i] == key]
            slot = min(same or free, key=lambda i: (self.kv[i] != "", self.used[i]) if session else self.used[i])
        else:
            mine = [i for i in free if session and self.held[i] == session]
            open_ = [i for i in free if not self.held[i] or self.until[i] <= now]
            if mine:
                slot = mine[0]
            elif open_:
                same = [i for i in open_ if key and (self.kv[i] == key or self.key[i] == key)]
                slot = min(same or open_, key=lambda i: (self.kv[i] != "", self.used[i]))
            else:  # only held slots are free: the scheduler let it take one (saved, or it waited long enough)
                slot = min(free, key=lambda i: (not self.saved[i], self.until[i]))
        if self.held[slot]:
            outcome = "lapsed" if self.until[slot] <= now else "kept" if self.held[slot] == session else "taken"
            self.counts[outcome] += 1
            went = self.held[slot] != session  # (taken, or lapsed and then taken: its KV goes either way)
            self.taken_share += TAKEN_WEIGHT * (float(went) - self.taken_share)
            self.held[slot], self.until[slot] = "", -math.inf
            self.holds -= 1
        before, saved = self.kv[slot], self.saved[slot]
        self.holder[slot], self.key[slot], self.used[slot], self.kv[slot] = job, key, now, ""
        self.saved[slot] = False
        return slot, before, saved

    def give(self, job: Job, session: str = "", until: float = -math.inf) -> None:
        """``job``'s slot is free again; with ``session``, it holds the session's KV now, and is
        held for its next turn until ``until``."""
        slot = job.slot
        if slot is not None and slot < len(self.holder) and self.holder[slot] is job:
            self.holder[slot] = None
            if session:
                self.kv[slot], self.saved[slot] = session, False
                if until > -math.inf:
                    if not self.held[slot]:
                        self.holds += 1
                    self.held[slot], self.until[slot] = session, until

    @property
    def save_on_release(self) -> bool:
        """Do most holds here end with their slot taken by another request? Then a session's KV
        is saved as its turn ends, while its slot idles, not later while a request waits for the
        slot (at most twice the saves there would be anyway, none of them waited for)."""
        return self.taken_share >= SAVE_ON_RELEASE

    def forget(self, session: str) -> None:
        """``session``'s KV on a slot is no longer to be saved (the slot was erased, or lost)."""
        for i, k in enumerate(self.kv):
            if k == session:
                self.kv[i], self.saved[i] = "", False

    def clear(self) -> None:
        """The runtime restarted: no slot holds anything any more."""
        for i in range(len(self.holder)):
            self.kv[i], self.held[i], self.until[i], self.key[i] = "", "", -math.inf, ""
            self.saved[i] = False
        self.holds = 0
