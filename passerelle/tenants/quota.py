"""Token and request quotas over a day, a week, a month, and the calendar they follow.

A quota is written ``2M/day``, ``500k/week`` or ``30000000/month``: prompt plus completion tokens
a key may use in one window; or ``1000 requests/day`` (also ``1000req/day``): requests admitted.
Windows follow the gateway's local calendar: a day starts at midnight, a week on Monday at
midnight, a month on the 1st at midnight. A request that would go past the quota is refused
with ``quota_exceeded`` and a ``Retry-After`` to the window's end.

Usage in a window is counted from the usage store when a key is first seen (so a restart forgets
nothing but the last half second before a ``kill -9``), then kept in memory: reserved at admission
(the estimate) and replaced by the runtime's count when the request ends. With a shared counter
(:class:`SharedCounter`, PostgreSQL's in tenants/pgquota.py) the reservation is made atomically in
the database, so several gateways never let a key past its quota; the memory then only mirrors it.

Example::

    >>> q = parse_quota("2M/day"); (q.tokens, q.period, str(q))
    (2000000, 'day', '2M/day')
    >>> import datetime as dt
    >>> start, end = window("week", dt.datetime(2026, 12, 2, 15, 30).timestamp())
    >>> dt.datetime.fromtimestamp(start).isoformat(), dt.datetime.fromtimestamp(end).isoformat()
    ('2026-11-30T00:00:00', '2026-12-07T00:00:00')
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from passerelle.errors import QuotaExceeded

PERIODS = ("day", "week", "month")
_SUFFIX = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000, "b": 1_000_000_000}
_QUOTA = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGbB]?)\s*(tokens?|requests?|req)?\s*/\s*(day|week|month)\s*$",
                    re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Quota:
    tokens: int  # how many: tokens, or requests when ``unit`` says so
    period: str  # "day", "week" or "month"
    unit: str = "tokens"  # or "requests"

    def __str__(self) -> str:
        return f"{human_tokens(self.tokens)}{'req' if self.requests else ''}/{self.period}"

    @property
    def requests(self) -> bool:
        return self.unit == "requests"

    def words(self) -> str:
        """``2M tokens a day``: for messages people read."""
        return f"{human_tokens(self.tokens)} {self.unit} a {self.period}"


def human_tokens(n: int) -> str:
    """``2000000`` → ``2M``, ``1500`` → ``1.5k``, ``1234`` → ``1234`` (exact, or the plain number)."""
    for suffix, factor in (("G", 1_000_000_000), ("M", 1_000_000), ("k", 1_000)):
        if n >= factor and (n * 10) % factor == 0:
            value = n / factor
            return f"{value:g}{suffix}"
    return str(n)


def parse_quota(text: str) -> Quota:
    """``"2M/day"`` → ``Quota(2000000, "day")``; raises ValueError with what is expected.

    >>> parse_quota("60 requests/day")
    Quota(tokens=60, period='day', unit='requests')
    """
    m = _QUOTA.match(text)
    if not m:
        raise ValueError(f"cannot read the quota {text!r}; expected TOKENS/PERIOD like 2M/day, 500k/week "
                         "or 30000000/month, or REQUESTS requests/PERIOD like 1000 requests/day")
    amount = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    unit = "requests" if (m.group(3) or "t").lower().startswith("r") else "tokens"
    if amount < 1 or amount != int(amount):
        raise ValueError(f"the quota {text!r} must be a whole positive number of {unit}")
    return Quota(int(amount), m.group(4).lower(), unit)


def format_quotas(quotas: tuple[Quota, ...]) -> str:
    """How quotas are stored: ``"2000000/day,10000000/month,1000req/day"``."""
    return ",".join(f"{q.tokens}{'req' if q.requests else ''}/{q.period}" for q in quotas)


def read_quotas(text: str) -> tuple[Quota, ...]:
    return tuple(parse_quota(part) for part in text.split(",") if part.strip())


def window(period: str, now: float) -> tuple[float, float]:
    """The (start, end) Unix times of the local-calendar ``period`` that contains ``now``.

    Midnights are built in local time and converted back, so a day with a daylight-saving change
    is 23 or 25 hours long, as on the wall clock.
    """
    t = datetime.fromtimestamp(now)
    day = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        start, end = day, day + timedelta(days=1)
    elif period == "week":
        start = day - timedelta(days=day.weekday())
        end = start + timedelta(days=7)
    elif period == "month":
        start = day.replace(day=1)
        end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    else:
        raise ValueError(f"unknown quota period {period!r}; expected one of {', '.join(PERIODS)}")
    return start.timestamp(), end.timestamp()


def local_time(ts: float) -> str:
    """``2026-12-01 00:00 +01:00``: a time as people read it, in the gateway's time zone."""
    t = datetime.fromtimestamp(ts).astimezone()
    return t.strftime("%Y-%m-%d %H:%M ") + t.isoformat()[-6:]


def iso_time(ts: float | None) -> str | None:
    """A Unix time as ISO 8601 with the local offset, for the JSON APIs."""
    return None if ts is None else datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


# -- usage against quotas ------------------------------------------------------------------------
@dataclass(slots=True)
class _Window:
    start: float
    end: float
    used: float = 0.0  # finished requests' real tokens plus the estimates of those in flight
    requests: int = 0  # requests admitted in the window


@dataclass(slots=True)
class Charge:
    """One request's reservation against a key's windows, settled when it ends."""

    key_id: str
    tokens: float
    starts: dict[str, float]  # period -> start of the window the estimate went into
    shared: bool = False  # reserved in the shared counter too (settled there as well)


# (tokens, requests) the usage store holds for a key since each start
Loader = Callable[[str, list[float]], Awaitable[list[tuple[int, int]]]]


class SharedDown(Exception):
    """The shared counter cannot be reached: each gateway counts alone until it is back."""


@dataclass(frozen=True, slots=True)
class Limit:
    """What one window of a key may hold, for a shared counter's reservation."""

    period: str
    start: float
    end: float
    tokens: float | None  # None: no token quota on this period
    requests: int | None  # None: no request quota on this period


class SharedCounter(Protocol):
    """Quotas counted in a store several gateways share (tenants/pgquota.py)."""

    async def reserve(self, key_id: str, limits: list[Limit], tokens: float) -> dict[str, tuple[float, int]] | None:
        """Add ``tokens`` and one request to each window if every limit holds, atomically; the
        windows' counts after it, or None (nothing added) when a limit would be passed. Raises
        SharedDown."""
        ...

    def adjust(self, key_id: str, starts: dict[str, float], tokens: float, requests: int) -> None:
        """Add ``tokens`` (may be negative) and ``requests`` to windows, later (never waits)."""
        ...

    async def counts(self, key_id: str, limits: list[Limit]) -> dict[str, tuple[float, int]]:
        """The windows' counts now (zero for a window not yet counted). Raises SharedDown."""
        ...

    def counting_alone(self, key_id: str, why: str) -> None:
        """A reservation is being made without the counter (it raised SharedDown): log and count it."""
        ...


class QuotaBook:
    """Tokens and requests each key used in its current day, week and month.

    ``load(key_id, starts)`` returns the (tokens, requests) the usage store holds for the key since
    each of ``starts``; it is awaited once per key (when a key with a quota is first seen), after
    which the book counts in memory. A request is charged to the window it *ends* in, as its usage
    row is. With a ``shared`` counter, :meth:`take` reserves there first (see the module's notes).

    Example::

        book = QuotaBook(load)
        await book.ensure(key.id, key.quotas)
        charge = book.reserve(key.id, key.quotas, 900)     # raises QuotaExceeded
        book.settle(charge, 412)
    """

    def __init__(self, load: Loader | None = None, *, clock: Callable[[], float] = time.time,
                 shared: SharedCounter | None = None) -> None:
        self.load = load
        self.clock = clock
        self.shared = shared
        self._keys: dict[str, dict[str, _Window]] = {}
        self._loading: dict[str, asyncio.Future[None]] = {}

    async def ensure(self, key_id: str, quotas: tuple[Quota, ...]) -> None:
        """Load the key's usage in its current windows from the store, once (requests that come
        while it loads wait for that load rather than start their own)."""
        if not quotas:
            return
        while key_id not in self._keys:
            pending = self._loading.get(key_id)
            if pending is None:
                await self._load(key_id)
                return
            await asyncio.wait([pending])  # its outcome is the loader's; then look again

    async def _load(self, key_id: str) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._loading[key_id] = fut
        try:
            now = self.clock()
            bounds = {p: window(p, now) for p in PERIODS}
            used = (await self.load(key_id, [b[0] for b in bounds.values()]) if self.load
                    else [(0, 0)] * len(PERIODS))
            self._keys[key_id] = {p: _Window(b[0], b[1], float(u[0]), int(u[1]))
                                  for (p, b), u in zip(bounds.items(), used, strict=True)}
        finally:
            del self._loading[key_id]
            fut.set_result(None)

    def _windows(self, key_id: str, now: float) -> dict[str, _Window] | None:
        wins = self._keys.get(key_id)
        if wins is not None:
            for period, w in wins.items():
                if now >= w.end:  # a new day (week, month): its usage starts from nothing
                    start, end = window(period, now)
                    wins[period] = _Window(start, end)
        return wins

    def usage(self, key_id: str, quotas: tuple[Quota, ...]) -> list[dict[str, Any]]:
        """Each quota with what is used and left, and when it renews (for /v1/me and the dashboard)."""
        wins = self._windows(key_id, self.clock())
        out = []
        for q in quotas:
            w = wins[q.period] if wins else None
            used = None if w is None else (w.requests if q.requests else int(w.used))
            out.append({"quota": str(q), "tokens": q.tokens, "period": q.period, "unit": q.unit, "used": used,
                        "remaining": None if used is None else max(0, q.tokens - used),
                        "resets_at": iso_time(w.end if w else window(q.period, self.clock())[1])})
        return out

    def reserve(self, key_id: str, quotas: tuple[Quota, ...], tokens: float) -> Charge | None:
        """Charge ``tokens`` (an estimate) and one request to the key's windows, or raise QuotaExceeded."""
        now = self.clock()
        wins = self._windows(key_id, now)
        if not quotas or wins is None:
            return None
        self._check(quotas, wins, tokens, now)
        for w in wins.values():
            w.used += tokens
            w.requests += 1
        return Charge(key_id, tokens, {p: w.start for p, w in wins.items()})

    @staticmethod
    def _check(quotas: tuple[Quota, ...], wins: dict[str, _Window], tokens: float, now: float) -> None:
        for q in quotas:
            w = wins[q.period]
            if q.requests:
                if w.requests + 1 > q.tokens:
                    raise QuotaExceeded(f"This API key's quota of {q.words()} is used up ({w.requests:,} made); "
                                        f"it renews at {local_time(w.end)}.", retry_after=w.end - now)
                continue
            left = q.tokens - w.used
            if left <= 0:
                raise QuotaExceeded(f"This API key's quota of {q.words()} is used up ({int(w.used):,} used); "
                                    f"it renews at {local_time(w.end)}.", retry_after=w.end - now)
            if tokens > left:
                raise QuotaExceeded(f"This request needs about {int(tokens):,} tokens, and {int(left):,} are left "
                                    f"of this API key's quota of {q.words()} until {local_time(w.end)}. "
                                    "Lower max_tokens, or wait until then.", retry_after=w.end - now)

    async def take(self, key_id: str, quotas: tuple[Quota, ...], tokens: float) -> Charge | None:
        """:meth:`ensure` then :meth:`reserve`, through the shared counter when there is one (its
        counts then replace the memory's); while it is down, this gateway counts alone."""
        if not quotas:
            return None
        await self.ensure(key_id, quotas)
        if self.shared is None:
            return self.reserve(key_id, quotas, tokens)
        now = self.clock()
        wins = self._windows(key_id, now)
        assert wins is not None
        limits = []
        for period in {q.period for q in quotas}:
            w = wins[period]
            tq = [q.tokens for q in quotas if q.period == period and not q.requests]
            rq = [q.tokens for q in quotas if q.period == period and q.requests]
            limits.append(Limit(period, w.start, w.end, float(tq[0]) if tq else None, rq[0] if rq else None))
        try:
            counts = await self.shared.reserve(key_id, limits, tokens)
        except SharedDown as exc:  # (transient errors were tried again first) counted here, and in the store later
            self.shared.counting_alone(key_id, str(exc))
            charge = self.reserve(key_id, quotas, tokens)
            if charge is not None:
                charge.starts = {lim.period: lim.start for lim in limits}
                charge.shared = True
                self.shared.adjust(key_id, charge.starts, tokens, 1)
            return charge
        wins = self._windows(key_id, self.clock())
        assert wins is not None
        if counts is None:  # refused: the memory learns the counts, and says which quota is used up
            with contextlib.suppress(SharedDown):
                self._learn(wins, limits, await self.shared.counts(key_id, limits))
            self._check(quotas, wins, tokens, now)
            raise QuotaExceeded("This API key's quota is used up.", retry_after=min(w.end for w in limits) - now)
        self._learn(wins, limits, counts)
        return Charge(key_id, tokens, {lim.period: lim.start for lim in limits}, shared=True)

    @staticmethod
    def _learn(wins: dict[str, _Window], limits: list[Limit], counts: dict[str, tuple[float, int]]) -> None:
        for lim in limits:
            w = wins[lim.period]
            if lim.period in counts and w.start == lim.start:
                w.used, w.requests = counts[lim.period]

    def settle(self, charge: Charge | None, tokens: float | None) -> None:
        """The request ended: its real count (``None``: keep the estimate) replaces the estimate
        in the windows it went into; a window that has rolled over since gets the real count."""
        if charge is None:
            return
        real = charge.tokens if tokens is None else tokens
        if charge.shared and self.shared is not None:
            self.shared.adjust(charge.key_id, charge.starts, real - charge.tokens, 0)
        wins = self._windows(charge.key_id, self.clock())
        if wins is None:
            return
        for period, w in wins.items():
            if period not in charge.starts:
                continue
            w.used += real - charge.tokens if charge.starts.get(period) == w.start else real
            w.used = max(w.used, 0.0)

    def release(self, charge: Charge | None) -> None:
        """The request was refused after its reservation (a rate limit, its queue): nothing of it counts."""
        if charge is None:
            return
        if charge.shared and self.shared is not None:
            self.shared.adjust(charge.key_id, charge.starts, -charge.tokens, -1)
        wins = self._windows(charge.key_id, self.clock())
        for period, w in (wins or {}).items():
            if charge.starts.get(period) == w.start:
                w.used = max(w.used - charge.tokens, 0.0)
                w.requests = max(w.requests - 1, 0)

    def forget(self, key_id: str) -> None:
        self._keys.pop(key_id, None)
