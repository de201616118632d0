"""Batch lines only in the idle capacity: a line goes to the gateway when the replicas that would
serve it have a slot for it beyond what every other class needs now.

Preemption alone does not keep a batch out of interactive traffic's way: it suspends a batch
stream once a better request waits, the runtime frees its slot only a decode step or two after
the cut, and it never cuts one near its end (short lines always are), so with every slot full of
batch lines an interactive request waits for one of them to finish. So the runner holds its
lines back before they reach the scheduler. For the replicas of a line's model that take
requests (up, not draining), with C slots in all:

    lines in flight  <  C  -  max(R, slots other classes use)  -  other classes' requests waiting

``R`` is ``[batches] reserve_slots`` per replica (at most its slots less one, so that a one-slot
runtime still runs batch lines while idle): slots kept free for a request that arrives. When other
classes use more than the reserve, the batch leaves them those slots too, and it backs off by one
line for each of their requests waiting. Nothing running is cut: the batch shrinks as its lines
end, and grows again when the others leave (looked at every ``POLL_S``; no event says so).

Lines held back wait here, not in the scheduler's queue; a freed place goes to the waiting line of
the owner with the fewest lines in flight (fair share between keys' batches), then the oldest.

    gate = IdleGate(service, reserve=1)
    if await gate.enter(pool, owner, lambda: run.ending != ""):
        try: ...
        finally: gate.leave(pool, owner)
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from passerelle.batches.parts import Parts, batch_class
from passerelle.runtimes.kinds import Backend

POLL_S = 0.02  # how often held-back lines look again at what other classes use

Pool = tuple[Backend, ...]


@dataclass(eq=False)
class _Waiter:
    pool: Pool
    owner: str
    ending: Callable[[], bool]
    seq: int
    future: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class IdleGate:
    def __init__(self, parts: Parts, reserve: int, poll_s: float = POLL_S) -> None:
        self.parts, self.reserve, self.poll_s = parts, reserve, poll_s
        self._in: Counter[tuple[str, ...]] = Counter()  # lines let through, by the names of their pool
        self._owners: Counter[str] = Counter()
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self.held_back = 0  # lines that had to wait here, since start (for the dashboard and tests)

    def pool_of(self, model: object, endpoint: str) -> Pool:
        """The replicas a line for ``model`` on ``endpoint`` would go to; () when none is known (the
        gateway then answers the line itself: unknown model, no backend)."""
        if not isinstance(model, str):
            return ()
        catalogue = self.parts.catalogue
        entry = catalogue.lookup(model)
        pool = catalogue.pool(entry, endpoint) if entry is not None else None
        return tuple(pool or ())

    def room(self, pool: Pool) -> int:
        """Lines more that may go to ``pool`` now (the module docstring's rule); 1 when none of its
        replicas takes requests (the gateway waits for one, or answers)."""
        up = [b for b in pool if b.stats.up and not b.draining and not b.fenced]
        if not up:
            return 1
        sched = self.parts.scheduler
        slots = sum(b.capacity for b in up)
        reserve = sum(min(self.reserve, max(b.capacity - 1, 0)) for b in up)
        cls = batch_class(self.parts)
        batch = sum(sched.running.get((b.name, cls), 0) for b in up)
        others = max(0, sum(b.in_flight for b in up) - batch)
        waiting = sum(1 for j in sched.waiting if j.cls.name != cls and any(b in j.pool for b in up))
        return slots - max(reserve, others) - waiting - self._mine(up)

    def _mine(self, up: list[Backend]) -> int:
        names = {b.name for b in up}
        return sum(n for key, n in self._in.items() if names.intersection(key))

    async def enter(self, pool: Pool, owner: str, ending: Callable[[], bool]) -> bool:
        """Wait until a line of ``owner`` may go to ``pool``: True, counted until :meth:`leave`;
        False when ``ending()`` became true first (call :meth:`pump` to tell at once)."""
        waiter = _Waiter(pool, owner, ending, next(self._seq))
        self._waiters.append(waiter)
        self.pump()
        if not waiter.future.done():
            self.held_back += 1
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled() and waiter.future.result():
                self.leave(pool, owner)
            raise

    def leave(self, pool: Pool, owner: str) -> None:
        key = _key(pool)
        self._in[key] -= 1
        if self._in[key] <= 0:
            del self._in[key]
        self._owners[owner] -= 1
        if self._owners[owner] <= 0:
            del self._owners[owner]
        self.pump()

    def pump(self) -> None:
        """Let through every waiting line that may go now, fewest-in-flight owner first."""
        admitted = True
        while admitted:  # (each admission changes the owners' order: sort again)
            admitted = False
            for w in sorted(self._waiters, key=lambda w: (self._owners[w.owner], w.seq)):
                if w.future.done() or w.ending():
                    self._waiters.remove(w)
                    if not w.future.done():
                        w.future.set_result(False)
                elif self.room(w.pool) > 0:
                    self._waiters.remove(w)
                    self._in[_key(w.pool)] += 1
                    self._owners[w.owner] += 1
                    w.future.set_result(True)
                    admitted = True
                    break
        if self._waiters and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.poll_s, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.pump()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _key(pool: Pool) -> tuple[str, ...]:
    return tuple(b.name for b in pool)
