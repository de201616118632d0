"""Token buckets for failed attempts at a secret: one per client address, one for the whole gateway.

A failed attempt takes a token from its address's bucket and from the global one; buckets refill
at a steady rate up to their size. :meth:`AttemptThrottle.check` runs *before* the secret is
compared: while either bucket is empty the attempt is refused (``RateLimited``, with the wait in
``Retry-After``) and the secret is never looked at, so a refusal tells a guesser nothing, not even
"wrong". That also refuses the right secret while the throttle holds; the global bucket bounds
what many addresses together may try.

Memory is bounded whatever the number of addresses: an address gets an entry only when one of its
attempts was compared and failed (so the global bucket bounds how fast entries appear), and past
``max_addresses`` the entry unused longest goes (by then its bucket has refilled: forgetting it
changes nothing). An IPv6 client counts per /64, the block one host is usually given.

Example::

    throttle = AttemptThrottle(per_address_per_minute=10, global_per_minute=60)
    throttle.check("192.0.2.7")          # raises RateLimited while throttled
    if not hmac.compare_digest(given, secret):
        throttle.failed("192.0.2.7")
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from passerelle.errors import RateLimited

MAX_ADDRESSES = 4096  # entries kept; ~0.5 MB at most


def address_key(client: str) -> str:
    """The unit an address is counted in: itself for IPv4, its /64 for IPv6."""
    if ":" not in client:  # IPv4 (or a Unix socket's "local"): as the server wrote it, no parsing
        return client[:64]
    try:
        ip = ipaddress.ip_address(client)
    except ValueError:
        return client[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class _Bucket:
    __slots__ = ("at", "rate", "size", "tokens")

    def __init__(self, size: float, rate: float, now: float) -> None:
        self.size, self.rate = size, rate  # tokens, tokens per second
        self.tokens, self.at = size, now

    def level(self, now: float) -> float:
        self.tokens = min(self.size, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        return self.tokens

    def wait(self, now: float) -> float:
        """Seconds until one token is back (0: there is one now)."""
        return max(0.0, (1.0 - self.level(now)) / self.rate)


class AttemptThrottle:
    """Failed attempts per address and in all: at most ``per_address_per_minute`` (the bucket's
    size, so a burst of that many) and ``global_per_minute`` a minute."""

    def __init__(self, *, per_address_per_minute: int, global_per_minute: int,
                 max_addresses: int = MAX_ADDRESSES, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_address, self.per_gateway = per_address_per_minute, global_per_minute
        self.max_addresses = max_addresses
        self.clock = clock
        self._global = _Bucket(global_per_minute, global_per_minute / 60.0, clock())
        self._addresses: OrderedDict[str, _Bucket] = OrderedDict()  # least recently failed first
        self.failures = 0  # attempts compared and wrong, since start
        self.refused = 0  # attempts refused by the throttle (never compared), since start

    def check(self, client: str) -> None:
        """Raise RateLimited when ``client``'s bucket or the global one is empty."""
        now = self.clock()
        mine = self._addresses.get(address_key(client))
        own = mine.wait(now) if mine is not None else 0.0
        if own > 0:
            self.refused += 1
            raise RateLimited(f"Too many failed attempts from this address ({self.per_address} a minute); "
                              f"try again in {own:.0f} s.", retry_after=own)
        everyone = self._global.wait(now)
        if everyone > 0:
            self.refused += 1
            raise RateLimited(f"Too many failed attempts on this gateway ({self.per_gateway} a minute from all "
                              f"addresses); try again in {everyone:.0f} s.", retry_after=everyone)

    def failed(self, client: str) -> None:
        """An attempt from ``client`` was compared and was wrong: one token from each bucket."""
        now = self.clock()
        self.failures += 1
        name = address_key(client)
        mine = self._addresses.get(name)
        if mine is None:
            mine = self._addresses[name] = _Bucket(self.per_address, self.per_address / 60.0, now)
            while len(self._addresses) > self.max_addresses:
                self._addresses.popitem(last=False)
        else:
            self._addresses.move_to_end(name)
        for bucket in (mine, self._global):
            bucket.tokens = max(0.0, bucket.level(now) - 1.0)

    def __len__(self) -> int:
        return len(self._addresses)

    def snapshot(self) -> dict[str, Any]:
        """For /admin/stats: the addresses refused now (and for how long), counts since start."""
        now = self.clock()
        blocked = [{"client": name, "retry_after_s": round(b.wait(now), 1)}
                   for name, b in reversed(self._addresses.items()) if b.wait(now) > 0][:100]
        return {"per_address_per_minute": self.per_address, "global_per_minute": self.per_gateway,
                "tracked": len(self._addresses), "blocked": blocked,
                "global_retry_after_s": round(self._global.wait(now), 1),
                "failures_total": self.failures, "refused_total": self.refused}
