"""Quotas counted in PostgreSQL (``[store] url``): one counter row per key, period and window, so
that several gateways never let a key past its quota.

A reservation is one transaction on this gateway's connection: the window's row is created if
missing, then ``UPDATE quota_use SET tokens = tokens + n, requests = requests + 1 WHERE ... AND
tokens + n <= quota AND requests + 1 <= quota RETURNING`` for each period the key has a quota on;
a row not returned (a limit would be passed) rolls the whole reservation back. PostgreSQL's row
lock makes two gateways' reservations on one key take turns, so the counts are exact.

Settling (the runtime's count replacing the estimate) and releasing (a request refused after its
reservation) never wait: they are queued (at most :data:`MAX_PENDING`) and applied by a thread,
as upserts. Each transaction has a client-side deadline of ``timeout_s`` (tenants/pgconn.py). A
transient error (a deadlock, a serialization failure, a connection the server ended) is tried
again, up to :data:`TRIES` times within ``timeout_s``. Past that, or while the database is out of
reach or silent, reservations raise :class:`SharedDown` at once (the thread, not a request,
reconnects every ``retry_s``): the gateway counts in its own memory, logged and counted
(:meth:`PgQuotas.counting_alone`), and what it admitted is queued as adjustments, applied when the
database is back.

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

from passerelle.tenants.pgconn import DeadlinePassed, connect, db_errors, deadline, first_line, transient
from passerelle.tenants.quota import PERIODS, Limit, SharedDown
from passerelle.tenants.workers import Worker

log = logging.getLogger("passerelle.tenants.pgquota")

MAX_PENDING = 100_000  # adjustments waiting for the database; past it the oldest are dropped, said in the log
TRIES = 3  # a reservation's tries on a transient error, before this gateway counts alone
LOCK_BACKSTOP = 6  # x timeout_s: the longest wait for the connection (its holder's tries are bounded by timeout_s)


class _Refused(Exception):
    pass


class PgQuotas:
    """The :class:`~passerelle.tenants.quota.SharedCounter` in PostgreSQL."""

    def __init__(self, url: str, *, timeout_s: float = 5.0, retry_s: float = 1.0) -> None:
        self.url, self.timeout_s, self.retry_s = url, timeout_s, retry_s
        self._conn: Any = None
        self._lock = threading.Lock()  # the reservations' connection
        self._pending: deque[tuple[str, str, float, float, int]] = deque()
        self._pending_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.worker = Worker("pg-quotas", self._run, self._stop)
        self.dropped = 0  # adjustments dropped past MAX_PENDING
        self.down = False  # the database out of reach: reservations count alone at once, the thread reconnects
        self.retried = 0  # reservations tried again after a transient error
        self.counted_alone = 0  # reservations made without the shared counter

    # -- the connection ------------------------------------------------------------------------
    def _connection(self) -> Any:
        """This gateway's connection; while the database is away only the thread reconnects
        (:meth:`_reconnect`), so that requests never wait on a connection attempt."""
        if self._conn is None:
            if self.down:
                raise SharedDown("the quota store is out of reach")
            try:
                self._conn = connect(self.url, self.timeout_s)
            except Exception as exc:
                self._mark_down(exc)
                raise SharedDown(first_line(exc)) from None
        return self._conn

    def _reconnect(self) -> bool:
        """The thread's attempt to reach the database again, outside the connection's lock (a
        database that does not answer holds only this thread, never a request)."""
        try:
            conn = connect(self.url, self.timeout_s)
        except Exception:
            return False
        with self._lock:
            if self._conn is None:
                self._conn = conn
                log.warning("quota store reachable again: reservations are shared again")
                self.down = False
            else:
                conn.close()
        return True

    def _mark_down(self, exc: BaseException) -> None:
        if not self.down:
            log.warning("quota store lost (%s): each gateway counts alone until it is back", first_line(exc))
        self.down = True
        self._wake.set()  # (the thread reconnects)

    def _lost(self, exc: BaseException) -> SharedDown:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # a broken connection: closing it says nothing more
                self._conn.close()
        self._conn = None
        self._mark_down(exc)
        return SharedDown(first_line(exc))

    def _locked(self) -> None:
        """Take the connection's lock. Its holder is bounded by the deadline (a database that stops
        answering is cut after ``timeout_s`` and marked down, and the reservations queued behind it
        then fail at once), so this wait is too; the backstop only guards against a bug. Reservations
        queued on a busy but live database wait their turn rather than count alone."""
        if not self._lock.acquire(timeout=LOCK_BACKSTOP * self.timeout_s):
            raise SharedDown(f"the quota store's connection was held past {LOCK_BACKSTOP} x [store] timeout_s")

    # -- SharedCounter -------------------------------------------------------------------------
    def _reserve_once(self, key_id: str, limits: list[Limit], tokens: float) -> dict[str, tuple[float, int]] | None:
        conn = self._connection()
        out = {}
        try:
            with deadline(conn, self.timeout_s), conn.transaction():
                ordered = sorted(limits, key=lambda lim: PERIODS.index(lim.period))  # one lock order everywhere
                for lim in ordered:
                    conn.execute("INSERT INTO quota_use (key_id, period, start) VALUES (%s, %s, %s) "
                                 "ON CONFLICT DO NOTHING", (key_id, lim.period, lim.start))
                for lim in ordered:
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
        except _Refused:
            return None
        return out

    def _reserve(self, key_id: str, limits: list[Limit], tokens: float) -> dict[str, tuple[float, int]] | None:
        """One reservation; a transient error (a deadlock, a serialization failure, a connection the
        server ended) is tried again, up to :data:`TRIES` times within ``timeout_s``, before the
        caller counts alone."""
        self._locked()
        try:
            give_up = time.monotonic() + self.timeout_s
            for attempt in range(1, TRIES + 1):
                try:
                    return self._reserve_once(key_id, limits, tokens)
                except db_errors() as exc:
                    broken = self._broken(exc)
                    if attempt == TRIES or not transient(exc) or time.monotonic() > give_up:
                        raise (self._lost(exc) if broken else SharedDown(first_line(exc))) from None
                    self.retried += 1
                    log.info("quota reservation for key %s: %s; trying again", key_id, first_line(exc))
                    if broken:
                        self._drop()  # (the next try connects again, within the deadline's budget)
            raise AssertionError("unreachable")
        finally:
            self._lock.release()

    def _broken(self, exc: BaseException) -> bool:
        """The connection is lost (not only the transaction failed)."""
        return self._conn is None or bool(self._conn.broken) or isinstance(exc, DeadlinePassed)

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None

    def counting_alone(self, key_id: str, why: str) -> None:
        """A reservation this gateway made alone (the shared counter out of reach): counted and logged."""
        self.counted_alone += 1
        if self.counted_alone == 1 or self.counted_alone % 1000 == 0:
            log.warning("quota for key %s counted by this gateway alone (%s): %d reservations so far "
                        "(passerelle_quota_counted_alone_total)", key_id, why, self.counted_alone)

    async def reserve(self, key_id: str, limits: list[Limit], tokens: float) -> dict[str, tuple[float, int]] | None:
        return await asyncio.to_thread(self._reserve, key_id, limits, tokens)

    def _counts(self, key_id: str, periods: list[tuple[str, float]]) -> dict[str, tuple[float, int]]:
        self._locked()
        try:
            conn = self._connection()
            out = {}
            with deadline(conn, self.timeout_s):
                for period, start in periods:
                    row = conn.execute("SELECT tokens, requests FROM quota_use WHERE key_id = %s AND period = %s "
                                       "AND start = %s", (key_id, period, start)).fetchone()
                    out[period] = (float(row[0]), int(row[1])) if row else (0.0, 0)
            return out
        except db_errors() as exc:
            raise (self._lost(exc) if self._broken(exc) else SharedDown(first_line(exc))) from None
        finally:
            self._lock.release()

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
        """Apply the queued adjustments in one transaction; False when the database is away
        (reconnecting first if it was: this thread is what notices its return)."""
        with self._pending_lock:
            batch = list(self._pending)
        if self.down and not self._reconnect():
            return False
        if not batch:
            return True
        sums: dict[tuple[str, str, float], tuple[float, int]] = {}
        for key_id, period, start, tokens, requests in batch:
            t, r = sums.get((key_id, period, start), (0.0, 0))
            sums[(key_id, period, start)] = (t + tokens, r + requests)
        with self._lock:
            try:
                conn = self._connection()
                with deadline(conn, self.timeout_s), conn.transaction():
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
            except db_errors() as exc:
                if self._broken(exc):
                    self._lost(exc)
                else:  # (an error of this transaction only: the connection stays, the queue is tried again)
                    log.info("quota adjustments: %s; tried again", first_line(exc))
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
        self.worker.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self.worker.join(self.timeout_s + self.retry_s + 1)
        self.apply_pending()
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
