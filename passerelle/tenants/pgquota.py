"""Quotas counted in PostgreSQL (``[store] url``): one counter row per key, period and window, so
that several gateways never let a key past its quota.

A reservation is one transaction on this gateway's connection: the window's row is created if
missing, then ``UPDATE quota_use SET tokens = tokens + n, requests = requests + 1 WHERE ... AND
tokens + n <= quota AND requests + 1 <= quota RETURNING`` for each period the key has a quota on;
a row not returned (a limit would be passed) rolls the whole reservation back. PostgreSQL's row
lock makes two gateways' reservations on one key take turns, so the counts are exact.

Settling (the runtime's count replacing the estimate) and releasing (a request refused after its
reservation) never wait: they are queued (at most :data:`MAX_PENDING`) and applied by a thread,
as upserts. While the database is out of reach, reservations raise :class:`SharedDown` at once
(one reconnection attempt per ``retry_s``): the gateway counts in its own memory, and what it
admitted is queued as adjustments, applied when the database is back.

Example::

    quotas = PgQuotas(url); quotas.start()
    book = QuotaBook(quotas.load, shared=quotas)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from typing import Any

from passerelle.tenants.pgstore import connect, first_line
from passerelle.tenants.quota import PERIODS, Limit, SharedDown

log = logging.getLogger("passerelle.tenants.pgquota")

MAX_PENDING = 100_000  # adjustments waiting for the database; past it the oldest are dropped, said in the log


class _Refused(Exception):
    pass


class PgQuotas:
    """The :class:`~passerelle.tenants.quota.SharedCounter` in PostgreSQL."""

    def __init__(self, url: str, *, timeout_s: float = 5.0, retry_s: float = 1.0) -> None:
        self.url, self.timeout_s, self.retry_s = url, timeout_s, retry_s
        self._conn: Any = None
        self._lock = threading.Lock()  # the reservations' connection
        self._retry_at = 0.0
        self._pending: deque[tuple[str, str, float, float, int]] = deque()
        self._pending_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0

    # -- the connection ------------------------------------------------------------------------
    def _connection(self) -> Any:
        if self._conn is None:
            if time.monotonic() < self._retry_at:
                raise SharedDown("the quota store is out of reach")
            try:
                self._conn = connect(self.url, self.timeout_s)
            except Exception as exc:
                self._retry_at = time.monotonic() + self.retry_s
                raise SharedDown(first_line(exc)) from None
        return self._conn

    def _lost(self, exc: BaseException) -> SharedDown:
        if self._conn is not None:
            log.warning("quota store lost (%s): each gateway counts alone until it is back", first_line(exc))
            with contextlib.suppress(Exception):  # a broken connection: closing it says nothing more
                self._conn.close()
        self._conn = None
        self._retry_at = time.monotonic() + self.retry_s
        return SharedDown(first_line(exc))

    # -- SharedCounter -------------------------------------------------------------------------
    def _reserve(self, key_id: str, limits: list[Limit], tokens: float) -> dict[str, tuple[float, int]] | None:
        import psycopg

        with self._lock:
            conn = self._connection()
            try:
                out = {}
                with conn.transaction():
                    for lim in limits:
                        conn.execute("INSERT INTO quota_use (key_id, period, start) VALUES (%s, %s, %s) "
                                     "ON CONFLICT DO NOTHING", (key_id, lim.period, lim.start))
                    for lim in sorted(limits, key=lambda lim: PERIODS.index(lim.period)):  # one lock order
                        row = conn.execute(
                            "UPDATE quota_use SET tokens = tokens + %s, requests = requests + 1 "
                            "WHERE key_id = %s AND period = %s AND start = %s "
                            "AND (%s::float8 IS NULL OR (tokens < %s AND tokens + %s <= %s)) "
                            "AND (%s::bigint IS NULL OR requests + 1 <= %s) RETURNING tokens, requests",
                            (tokens, key_id, lim.period, lim.start, lim.tokens, lim.tokens, tokens, lim.tokens,
                             lim.requests, lim.requests)).fetchone()
                        if row is None:
                            raise _Refused
                        out[lim.period] = (float(row[0]), int(row[1]))
                return out
            except _Refused:
                return None
            except psycopg.Error as exc:
                raise self._lost(exc) from None

    async def reserve(self, key_id: str, limits: list[Limit], tokens: float) -> dict[str, tuple[float, int]] | None:
        return await asyncio.to_thread(self._reserve, key_id, limits, tokens)

    def _counts(self, key_id: str, periods: list[tuple[str, float]]) -> dict[str, tuple[float, int]]:
        import psycopg

        with self._lock:
            conn = self._connection()
            try:
                out = {}
                for period, start in periods:
                    row = conn.execute("SELECT tokens, requests FROM quota_use WHERE key_id = %s AND period = %s "
                                       "AND start = %s", (key_id, period, start)).fetchone()
                    out[period] = (float(row[0]), int(row[1])) if row else (0.0, 0)
                return out
            except psycopg.Error as exc:
                raise self._lost(exc) from None

    async def counts(self, key_id: str, limits: list[Limit]) -> dict[str, tuple[float, int]]:
        return await asyncio.to_thread(self._counts, key_id, [(lim.period, lim.start) for lim in limits])

    async def load(self, key_id: str, starts: list[float]) -> list[tuple[int, int]]:
        """The QuotaBook's loader: the counters of the windows starting at ``starts`` (one per
        period, in PERIODS order); zeros while the database is away (this gateway counts alone)."""
        try:
            got = await asyncio.to_thread(self._counts, key_id, list(zip(PERIODS, starts, strict=True)))
        except SharedDown:
            return [(0, 0)] * len(starts)
        return [(int(got[p][0]), got[p][1]) for p in PERIODS]

    def adjust(self, key_id: str, starts: dict[str, float], tokens: float, requests: int) -> None:
        if tokens == 0 and requests == 0:
            return
        with self._pending_lock:
            for period, start in starts.items():
                if len(self._pending) >= MAX_PENDING:
                    self._pending.popleft()
                    self.dropped += 1
                    if self.dropped == 1:
                        log.error("quota adjustments: more than %d wait for the database; the oldest are dropped",
                                  MAX_PENDING)
                self._pending.append((key_id, period, start, tokens, requests))
        self._wake.set()

    # -- the thread that applies adjustments ---------------------------------------------------
    def apply_pending(self) -> bool:
        """Apply the queued adjustments in one transaction; False when the database is away."""
        import psycopg

        with self._pending_lock:
            batch = list(self._pending)
        if not batch:
            return True
        sums: dict[tuple[str, str, float], tuple[float, int]] = {}
        for key_id, period, start, tokens, requests in batch:
            t, r = sums.get((key_id, period, start), (0.0, 0))
            sums[(key_id, period, start)] = (t + tokens, r + requests)
        with self._lock:
            try:
                conn = self._connection()
                with conn.transaction():
                    for (key_id, period, start), (tokens, requests) in sorted(sums.items()):
                        conn.execute(
                            "INSERT INTO quota_use (key_id, period, start, tokens, requests) "
                            "VALUES (%s, %s, %s, GREATEST(%s, 0), GREATEST(%s, 0)) "
                            "ON CONFLICT (key_id, period, start) DO UPDATE SET "
                            "tokens = GREATEST(quota_use.tokens + %s, 0), "
                            "requests = GREATEST(quota_use.requests + %s, 0)",
                            (key_id, period, start, tokens, int(requests), tokens, int(requests)))
            except SharedDown:
                return False
            except psycopg.Error as exc:
                self._lost(exc)
                return False
        with self._pending_lock:
            for _ in range(min(len(batch), len(self._pending))):
                self._pending.popleft()
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.retry_s)
            self._wake.clear()
            if not self.apply_pending():
                self._stop.wait(self.retry_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="passerelle-pg-quotas", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + self.retry_s + 1)
        self.apply_pending()
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
