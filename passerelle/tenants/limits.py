"""Per-key limits (requests/minute, tokens/minute, requests at once) and failed-key throttling.

Windows slide over the last 60 seconds. Tokens are reserved at admission (prompt estimate plus
``max_tokens``) and corrected with the real usage when the request ends. Past ``rpm`` or ``tpm``
the request ends with ``rate_limited`` and a ``Retry-After`` saying when the window will have room.

Past ``max_concurrency`` a request is not refused: it waits in the key's own queue (most urgent
class first, then arrival) until one of the key's requests ends, for at most its class's
``max_queue_wait_s`` and what the request's ``total_s`` leaves (then 429 ``queue_timeout``: a
request out of time is never sent) and behind at most ``max_queue`` others (429
``queue_full``). Twenty streams on a key allowed four at once all complete, four at a time.

A key that trusts a front-end's forwarded user (``trust_forwarded_user``) has these three limits
per person: each user it names gets the key's rpm, tpm and max_concurrency, in windows and a queue
of their own (``who``), so one person of thirty cannot spend the front-end's minute or its slots;
the key's quotas stay the key's. User entries are bounded: past :data:`MAX_ENTRIES` the least
recently admitted idle one is forgotten (its window starts afresh if that person comes back).

Example::

    limiter = KeyLimiter(clock=time.monotonic)
    grant = limiter.admit(key, tokens=300)        # raises RateLimited
    await limiter.wait_turn(grant, key, cls)      # the key's queue; raises QueueTimeout / QueueFull
    ...
    limiter.finish(grant, tokens=120)             # frees the key's slot for the next in its queue
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from passerelle.config import ClassConfig
from passerelle.errors import QueueFull, QueueTimeout, RateLimited
from passerelle.tenants.keys import ApiKey

WINDOW_S = 60.0
MAX_ENTRIES = 10_000  # windows and queues kept (keys, and the users of trusting keys)


@dataclass
class _Usage:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[list[float]] = field(default_factory=deque)  # [time, tokens], mutable for correction
    token_sum: float = 0.0
    running: int = 0  # requests holding one of the key's concurrency slots
    limit: int = 0  # the key's max_concurrency as last seen (0: unlimited)
    waiters: list[tuple[int, int, asyncio.Future[None]]] = field(default_factory=list)  # heap: (rank, seq, fut)

    def trim(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]

    def has_room(self) -> bool:
        return not self.limit or self.running < self.limit


@dataclass
class Grant:
    key_id: str
    entry: list[float]
    holding: bool = False  # holds one of the key's concurrency slots


class KeyLimiter:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._usage: OrderedDict[str, _Usage] = OrderedDict()  # least recently admitted first
        self._seq = itertools.count()
        self.max_entries = MAX_ENTRIES

    def admit(self, key: ApiKey, tokens: float, who: str = "") -> Grant:
        """Count the request against the key's per-minute limits (``who``'s own, for a person
        behind a trusting key), or raise RateLimited."""
        now = self.clock()
        entry_id = f"{key.id}/{who}" if who else key.id
        u = self._usage.get(entry_id)
        if u is None:
            u = self._usage[entry_id] = _Usage()
            if len(self._usage) > self.max_entries:
                self._forget_idle()
        else:
            self._usage.move_to_end(entry_id)
        u.trim(now)
        if key.rpm and len(u.requests) >= key.rpm:
            raise RateLimited(f"This key may send {key.rpm} requests per minute.",
                              retry_after=u.requests[0] + WINDOW_S - now)
        if key.tpm:
            if tokens > key.tpm:
                raise RateLimited(f"This request needs about {int(tokens)} tokens; the key allows {key.tpm} "
                                  "per minute. Lower max_tokens.")
            if u.token_sum + tokens > key.tpm:
                # when enough reserved tokens leave the window for this request to fit
                need, freed, wait = u.token_sum + tokens - key.tpm, 0.0, WINDOW_S
                for t, n in u.tokens:
                    freed += n
                    if freed >= need:
                        wait = t + WINDOW_S - now
                        break
                raise RateLimited(f"This key may use {key.tpm} tokens per minute.", retry_after=wait)
        u.requests.append(now)
        entry = [now, float(tokens)]
        u.tokens.append(entry)
        u.token_sum += tokens
        return Grant(entry_id, entry)

    def _forget_idle(self) -> None:
        """Drop the least recently admitted entries that hold and await nothing, down to the bound."""
        excess, idle = len(self._usage) - self.max_entries, list[str]()
        for name, u in self._usage.items():  # oldest first: usually the first one will do
            if len(idle) >= excess:
                break
            if not u.running and not u.waiters:
                idle.append(name)
        for name in idle:
            del self._usage[name]

    async def wait_turn(self, grant: Grant, key: ApiKey, cls: ClassConfig, max_wait_s: float | None = None) -> None:
        """Take one of the key's ``max_concurrency`` slots, waiting in the key's queue for it at most
        the class's ``max_queue_wait_s`` or ``max_wait_s`` (what the request's total time leaves)."""
        u = self._usage[grant.key_id]
        if max_wait_s is not None and max_wait_s <= 0:
            raise QueueTimeout("The request's total timeout ran out before it could be queued.", retry_after=1.0)
        u.limit = key.max_concurrency
        if u.has_room() and not u.waiters:
            u.running += 1
            grant.holding = True
            return
        if len(u.waiters) >= cls.max_queue:
            raise QueueFull(f"{len(u.waiters)} requests of this key are already waiting for one of its "
                            f"{key.max_concurrency} concurrent slots.", retry_after=1.0)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        item = (cls.rank, next(self._seq), fut)
        heapq.heappush(u.waiters, item)
        wait, why = cls.max_queue_wait_s, ""
        if max_wait_s is not None and max_wait_s < wait:
            wait, why = max_wait_s, " (the request's total timeout ran out)"
        timer = loop.call_later(wait, _expire, fut, QueueTimeout(
            f"Waited {wait:.3g} s (class {cls.name}) for one of this key's {key.max_concurrency} "
            f"concurrent slots{why}.", retry_after=1.0))
        try:
            await fut
            grant.holding = True  # the slot was handed over by _hand_on, already counted
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                grant.holding = True  # handed a slot just as the client went away: give it back
                self.finish(grant, None)
            elif item in u.waiters:
                u.waiters.remove(item)
                heapq.heapify(u.waiters)
            raise
        finally:
            timer.cancel()

    def finish(self, grant: Grant, tokens: float | None) -> None:
        """The request ended: free its concurrency slot, replace the reservation by the real count."""
        u = self._usage.get(grant.key_id)
        if u is None:  # (forgotten: it held nothing)
            return
        if grant.holding:
            grant.holding = False
            u.running -= 1
            self._hand_on(u)
        if tokens is not None and grant.entry[0] > self.clock() - WINDOW_S:
            u.token_sum += tokens - grant.entry[1]
            grant.entry[1] = float(tokens)

    @staticmethod
    def _hand_on(u: _Usage) -> None:
        """Give free slots to the first waiters still waiting."""
        while u.waiters and u.has_room():
            _, _, fut = heapq.heappop(u.waiters)
            if not fut.done():
                u.running += 1
                fut.set_result(None)

    def state(self, key_id: str) -> dict[str, int]:
        """The key's requests holding a slot, and waiting for one (its people's too, for a key
        that trusts a front-end's forwarded user)."""
        mine = [u for name, u in self._usage.items() if name == key_id or name.startswith(key_id + "/")]
        return {"running": sum(u.running for u in mine), "queued": sum(len(u.waiters) for u in mine)}


def _expire(fut: asyncio.Future[None], err: Exception) -> None:
    if not fut.done():
        fut.set_exception(err)


class FailedAuthThrottle:
    """At most ``per_minute`` failed key checks per (client address, presented key prefix).

    Only failures are throttled, and only for the pair that failed: a client with a stale key
    behind the same reverse proxy as everyone else slows down itself, nobody else, and a valid key
    is never refused by the throttle (it is checked first). Guessing a key's secret is hopeless
    anyway (256 random bits); the throttle keeps a broken client from flooding the log and the
    hash checks.
    """

    MAX_PAIRS = 10_000  # bounds memory under a spray of addresses and prefixes

    def __init__(self, per_minute: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._fails: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()
        self.refused = 0  # requests answered 429 by the throttle since start
        self.failures = 0  # failed key checks since start

    def _recent(self, pair: tuple[str, str], now: float) -> deque[float] | None:
        q = self._fails.get(pair)
        if q is None:
            return None
        while q and q[0] <= now - WINDOW_S:
            q.popleft()
        if not q:
            del self._fails[pair]
            return None
        return q

    def check(self, client: str, prefix: str) -> None:
        """Raise RateLimited when ``(client, prefix)`` failed ``per_minute`` times in the last minute."""
        now = self.clock()
        q = self._recent((client, prefix), now)
        if q is not None and len(q) >= self.per_minute:
            self.refused += 1
            raise RateLimited(f"Too many failed attempts with the key {prefix}… from this address; "
                              "check the key your client sends.", retry_after=q[0] + WINDOW_S - now)

    def failed(self, client: str, prefix: str) -> None:
        self.failures += 1
        pair = (client, prefix)
        q = self._fails.get(pair)
        if q is None:
            q = self._fails[pair] = deque(maxlen=self.per_minute)
            if len(self._fails) > self.MAX_PAIRS:
                self._fails.popitem(last=False)
        else:
            self._fails.move_to_end(pair)
        q.append(self.clock())

    def snapshot(self) -> dict[str, Any]:
        """For /admin/stats: the pairs blocked now (and for how long), counts since start."""
        now = self.clock()
        blocked = []
        for pair in list(self._fails):
            q = self._recent(pair, now)
            if q is not None and len(q) >= self.per_minute:
                blocked.append({"client": pair[0], "key_prefix": pair[1], "failures": len(q),
                                "retry_after_s": round(q[0] + WINDOW_S - now, 1)})
        return {"per_minute": self.per_minute, "tracked": len(self._fails), "blocked": blocked,
                "failures_total": self.failures, "refused_total": self.refused}
