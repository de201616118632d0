"""Per-key limits (requests/minute, tokens/minute, concurrency) and failed-login throttling.

Windows slide over the last 60 seconds. Tokens are reserved at admission (prompt estimate plus
``max_tokens``) and corrected with the real usage when the request ends. Past a limit the request
ends with ``rate_limited`` and a ``Retry-After`` saying when the window will have room.

Example::

    limiter = KeyLimiter(clock=time.monotonic)
    grant = limiter.admit(key, tokens=300)   # raises RateLimited
    ...
    limiter.finish(grant, tokens=120)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from passerelle.errors import RateLimited
from passerelle.tenants.keys import ApiKey

WINDOW_S = 60.0


@dataclass
class _Usage:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[list[float]] = field(default_factory=deque)  # [time, tokens], mutable for correction
    token_sum: float = 0.0
    running: int = 0

    def trim(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]


@dataclass
class Grant:
    key_id: str
    entry: list[float]


class KeyLimiter:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._usage: dict[str, _Usage] = {}

    def admit(self, key: ApiKey, tokens: float) -> Grant:
        now = self.clock()
        u = self._usage.setdefault(key.id, _Usage())
        u.trim(now)
        if key.max_concurrency and u.running >= key.max_concurrency:
            raise RateLimited(f"This key may run {key.max_concurrency} requests at once.", retry_after=1.0)
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
        u.running += 1
        return Grant(key.id, entry)

    def finish(self, grant: Grant, tokens: float | None) -> None:
        """The request ended: free its concurrency slot, replace the reservation by the real count."""
        u = self._usage[grant.key_id]
        u.running -= 1
        if tokens is not None and grant.entry[0] > self.clock() - WINDOW_S:
            u.token_sum += tokens - grant.entry[1]
            grant.entry[1] = float(tokens)


class FailedAuthThrottle:
    """At most ``per_minute`` failed key checks per client address."""

    def __init__(self, per_minute: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self.clock = clock
        self._fails: dict[str, deque[float]] = {}

    def check(self, client: str) -> None:
        q = self._fails.get(client)
        if not q:
            return
        now = self.clock()
        while q and q[0] <= now - WINDOW_S:
            q.popleft()
        if len(q) >= self.per_minute:
            raise RateLimited("Too many failed authentication attempts from this address.",
                              retry_after=q[0] + WINDOW_S - now)

    def failed(self, client: str) -> None:
        q = self._fails.setdefault(client, deque())
        q.append(self.clock())
        if len(self._fails) > 10000:  # bound memory under a spray of addresses
            self._fails.pop(next(iter(self._fails)))
