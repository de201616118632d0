"""Usage per request (time, tenant, key, user, session, class, model, cause, tokens) in SQLite, and reports on it.

Rows are buffered and written by a background task every half second in one transaction, so the
event loop never waits on the disk and a ``kill -9`` loses at most the last half second. The same
task prunes the table (at start, then every ten minutes): a refused request (no token billed, a
cause other than ``ok``: a wrong key, a rate limit, a full queue) leaves a row that only counts in
reports, deleted after ``refused_retention_s``; past ``max_rows`` the oldest rows go, refused ones
first, so that a spray of refused requests cannot grow the file without end. Reports
(``passerelle usage``, ``GET /v1/me/usage``, quotas after a restart) read the same table.

A request's tokens are the runtime's counts; when the runtime gave none (the client left
mid-stream, the runtime broke), the completion is the content chunks relayed, one token each,
so that leaving early is not free. Quotas charge exactly what is written here.

Example::

    recorder = UsageRecorder(connect(path)); recorder.start()
    gateway.listeners.append(recorder.record)
    ...
    report(conn, since=time.time() - 7 * 86400, by=("key",))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, Protocol

from passerelle.observe.record import RequestRecord, clip
from passerelle.tenants.db import connect
from passerelle.tenants.workers import TaskWorker

log = logging.getLogger("passerelle.tenants.usage")

# --by dimensions and the columns they group on
# ("user" quoted: PostgreSQL's shared usage table reads a bare `user` as the connected role)
DIMENSIONS = {"key": "key_id", "tenant": "tenant", "model": "model", "class": "class", "user": '"user"',
              "session": "session"}

MAX_HELD = 100_000  # rows kept while commits fail (a full disk), about 20 MB; past it the oldest are dropped

# A buffered row: (ts, tenant, key_id, class, model, cause, prompt_tokens, completion_tokens, user, session)
_Row = tuple[float, str, str, str, str, str, int, int, str, str]


def billed_tokens(rec: RequestRecord) -> tuple[int, int]:
    """(prompt, completion) tokens a finished request is charged."""
    completion = rec.completion_tokens if rec.completion_tokens is not None else rec.content_chunks
    return rec.prompt_tokens or 0, completion or 0


# A row that billed nothing for a request that was not served: it only counts in reports.
_REFUSED = "prompt_tokens = 0 AND completion_tokens = 0 AND cause != 'ok'"


class UsageSink(Protocol):
    """Where finished requests' usage rows go: this module's SQLite recorder, or PostgreSQL's
    (tenants/pgusage.py). ``record`` is on the request path and never waits on the store."""

    def record(self, rec: RequestRecord) -> None: ...

    async def flush(self) -> None: ...

    async def prune(self) -> int: ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def close(self) -> None: ...


class UsageReports(Protocol):
    """Reports on the usage rows, off the event loop (:class:`UsageReader`, or PostgreSQL's)."""

    async def report(self, **kw: Any) -> list[dict[str, Any]]: ...

    async def tokens_since(self, key_id: str, starts: Sequence[float]) -> list[int]: ...

    async def used_since(self, key_id: str, starts: Sequence[float]) -> list[tuple[int, int]]: ...

    def close(self) -> None: ...


class UsageRecorder:
    """The usage sink in the instance's SQLite file (see the module's notes)."""

    def __init__(self, conn: sqlite3.Connection, *, flush_s: float = 0.5,
                 clock: Callable[[], float] = time.time, refused_retention_s: float = 7 * 86400.0,
                 max_rows: int = 5_000_000, prune_every_s: float = 600.0, max_held: int = MAX_HELD) -> None:
        self.conn = conn
        self.flush_s = flush_s
        self.clock = clock  # a row's time: when its request ended
        self.refused_retention_s = refused_retention_s  # 0: kept
        self.max_rows = max_rows  # 0: no cap
        self.prune_every_s = prune_every_s
        self.max_held = max_held
        self._rows: deque[_Row] = deque()  # rows not yet committed: new ones, and those a failed commit gave back
        self.failing = False  # the last commit failed (a full disk); its rows wait here and are tried again
        self.dropped = 0  # rows lost past max_held while commits fail
        self._popped = 0  # rows taken off the queue's head past max_held, ever
        self._write_lock = threading.Lock()  # a flush and a prune may overlap
        self._flushing = asyncio.Lock()  # flushes may overlap (the timer, a report asking for one)
        self.worker = TaskWorker("usage-writer", self._run)

    @property
    def held(self) -> int:
        """Rows waiting to be committed."""
        return len(self._rows)

    def record(self, rec: RequestRecord) -> None:
        if rec.cause is None:
            return
        prompt, completion = billed_tokens(rec)
        self._rows.append((self.clock(), rec.tenant, rec.key_id, rec.priority, clip(rec.model), rec.cause.value,
                           prompt, completion, rec.user, rec.session))
        if len(self._rows) > self.max_held:  # (only while commits fail: the writer empties it every flush_s)
            self._rows.popleft()
            self._popped += 1
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10_000 == 0:
                log.error("usage: more than %d rows wait for a commit that fails; the oldest are dropped "
                          "(%d so far)", self.max_held, self.dropped)

    def _write(self, rows: list[_Row]) -> None:
        with self._write_lock:
            self.conn.execute("BEGIN")
            try:
                self.conn.executemany("INSERT INTO usage (ts, tenant, key_id, class, model, cause, prompt_tokens, "
                                      "completion_tokens, user, session) VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:  # (SQLite ends it itself on some errors: a full disk)
                    self.conn.execute("ROLLBACK")
                raise

    async def flush(self) -> None:
        """Commit the rows waiting; on failure they stay, in order, and the next flush tries again."""
        async with self._flushing:  # (one at a time: two would write the same rows)
            if not self._rows:
                return
            rows, popped = list(self._rows), self._popped
            try:
                await asyncio.to_thread(self._write, rows)
            except sqlite3.Error as exc:
                if not self.failing:
                    log.error("could not record usage of %d requests (%s): kept (at most %d) and tried again "
                              "every %g s", len(rows), exc, self.max_held, self.flush_s)
                self.failing = True
                return
            # the rows written leave the queue; rows recorded meanwhile stay (the oldest written may have
            # been dropped meanwhile, past max_held: those are gone already)
            for _ in range(min(max(0, len(rows) - (self._popped - popped)), len(self._rows))):
                self._rows.popleft()
        if self.failing:
            log.warning("usage recorded again: %d rows written after failed commits", len(rows))
            self.failing = False

    def _prune(self) -> int:
        deleted = 0
        with self._write_lock:
            if self.refused_retention_s > 0:
                deleted += self.conn.execute(f"DELETE FROM usage WHERE ts < ? AND {_REFUSED}",
                                             (self.clock() - self.refused_retention_s,)).rowcount
            if self.max_rows > 0:
                over = self.conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0] - self.max_rows
                for which in (_REFUSED, "1"):  # refused rows first, then any, oldest first
                    if over <= 0:
                        break
                    n = self.conn.execute(f"DELETE FROM usage WHERE rowid IN (SELECT rowid FROM usage WHERE {which} "
                                          "ORDER BY ts LIMIT ?)", (over,)).rowcount
                    deleted, over = deleted + n, over - n
        return deleted

    async def prune(self) -> int:
        """Apply the retention of refused rows and the cap on the table now; rows deleted."""
        try:
            deleted = await asyncio.to_thread(self._prune)
        except sqlite3.Error:
            log.exception("could not prune the usage table")
            return 0
        if deleted:
            log.info("usage table: %d old rows deleted (retention of refused requests, row cap)", deleted)
        return deleted

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_prune = loop.time()
        while True:
            if loop.time() >= next_prune:
                await self.prune()
                next_prune = loop.time() + self.prune_every_s
            await asyncio.sleep(self.flush_s)
            await self.flush()

    def start(self) -> None:
        self.worker.start()

    async def stop(self) -> None:
        if self.worker.task is not None:
            self.worker.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.worker.task
        await self.flush()
        if self._rows:
            log.error("usage of %d requests could not be recorded before stopping: lost", len(self._rows))

    def close(self) -> None:
        self.conn.close()


def report(conn: sqlite3.Connection, *, since: float = 0.0, until: float | None = None,
           by: Sequence[str] = ("tenant", "class"), key_id: str | None = None,
           limit: int | None = None, after: str | None = None) -> list[dict[str, Any]]:
    """Requests and tokens grouped ``by`` any of key, tenant, model, class, user, session, largest first.

    Each row: the dimensions, ``requests``, ``prompt_tokens``, ``completion_tokens``,
    ``total_tokens``, ``not_ok`` (requests that ended with another cause than ``ok``),
    ``limited`` (refused by a key's limits: rate_limited, quota_exceeded), ``last_seen`` (Unix time).

    ``limit``: at most this many rows (in SQL). ``after``: a page of a report grouped by one
    dimension, in that dimension's order (not the largest first), starting after this value: the
    cursor of a paged list (``after=""`` leaves out the rows without a value).
    """
    unknown = [d for d in by if d not in DIMENSIONS]
    if unknown or not by:
        raise ValueError(f"cannot group by {', '.join(unknown) or 'nothing'}; expected some of "
                         f"{', '.join(DIMENSIONS)}")
    if after is not None and len(by) != 1:
        raise ValueError("a paged report ('after') groups by one dimension")
    cols = [DIMENSIONS[d] for d in by]
    where: list[str] = ["ts >= ?"]
    args: list[Any] = [since]
    if until is not None:
        where.append("ts < ?")
        args.append(until)
    if key_id is not None:
        where.append("key_id = ?")
        args.append(key_id)
    group = ", ".join(cols)
    order = f"SUM(prompt_tokens + completion_tokens) DESC, COUNT(*) DESC, {group}"
    if after is not None:
        where.append(f"{group} > ?")
        args.append(after)
        order = group
    bound = ""
    if limit is not None:
        bound = " LIMIT ?"
        args.append(limit)
    rows = conn.execute(
        f"SELECT {group}, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), "
        "SUM(CASE WHEN cause = 'ok' THEN 0 ELSE 1 END), "
        "SUM(CASE WHEN cause IN ('rate_limited', 'quota_exceeded') THEN 1 ELSE 0 END), MAX(ts) "
        f"FROM usage WHERE {' AND '.join(where)} GROUP BY {group} ORDER BY {order}{bound}", args).fetchall()
    out = []
    for r in rows:
        n = len(cols)
        p, c = r[n + 1] or 0, r[n + 2] or 0
        out.append({**dict(zip(by, r[:n], strict=True)), "requests": r[n], "prompt_tokens": p,
                    "completion_tokens": c, "total_tokens": p + c, "not_ok": r[n + 3] or 0,
                    "limited": r[n + 4] or 0, "last_seen": r[n + 5]})
    return out


def tokens_since(conn: sqlite3.Connection, key_id: str, starts: Sequence[float]) -> list[int]:
    """Tokens the key used since each of ``starts`` (one indexed range scan from the earliest)."""
    cases = ", ".join("COALESCE(SUM(CASE WHEN ts >= ? THEN prompt_tokens + completion_tokens END), 0)"
                      for _ in starts)
    row = conn.execute(f"SELECT {cases} FROM usage WHERE key_id = ? AND ts >= ?",
                       (*starts, key_id, min(starts))).fetchone()
    return [int(v) for v in row]


def used_since(conn: Any, key_id: str, starts: Sequence[float]) -> list[tuple[int, int]]:
    """(tokens, requests) the key used since each of ``starts``, for its quotas: a request counts
    unless it was refused before being served (no token billed, a cause other than ``ok``)."""
    cases = ", ".join("COALESCE(SUM(CASE WHEN ts >= ? THEN prompt_tokens + completion_tokens END), 0), "
                      f"COALESCE(SUM(CASE WHEN ts >= ? AND NOT ({_REFUSED}) THEN 1 END), 0)" for _ in starts)
    row = conn.execute(f"SELECT {cases} FROM usage WHERE key_id = ? AND ts >= ?",
                       (*(s for s in starts for _ in (0, 1)), key_id, min(starts))).fetchone()
    return [(int(row[2 * i]), int(row[2 * i + 1])) for i in range(len(starts))]


def summarize(conn: sqlite3.Connection, since: float = 0.0) -> list[tuple[str, str, int, int, int, int]]:
    """(tenant, class, requests, prompt tokens, completion tokens, requests not ok) since ``since``."""
    return [(r["tenant"], r["class"], r["requests"], r["prompt_tokens"], r["completion_tokens"], r["not_ok"])
            for r in sorted(report(conn, since=since, by=("tenant", "class")),
                            key=lambda r: (r["tenant"], r["class"]))]


def parse_since(text: str | None, now: float | None = None) -> float:
    """``2026-11-30``, ``2026-11-30T12:00``, or back from now: ``90m``, ``24h``, ``7d``, ``2w``
    (None or empty: the beginning). Raises ValueError."""
    if not text:
        return 0.0
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    text = text.strip()
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return (time.time() if now is None else now) - float(text[:-1]) * units[text[-1]]
    return datetime.fromisoformat(text).timestamp()


class ThreadedReports:
    """The reports, each run in a worker thread by ``_run`` (the reader's own connection, under its
    lock): the event loop never waits on a scan of the usage table. SQLite's reader and
    PostgreSQL's (pgusage.py) differ only in ``_run``."""

    def _run(self, fn: Any, *args: Any, **kw: Any) -> Any:
        raise NotImplementedError

    async def report(self, **kw: Any) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._run, report, **kw)

    async def tokens_since(self, key_id: str, starts: Sequence[float]) -> list[int]:
        return await asyncio.to_thread(self._run, tokens_since, key_id, starts)

    async def used_since(self, key_id: str, starts: Sequence[float]) -> list[tuple[int, int]]:
        return await asyncio.to_thread(self._run, used_since, key_id, starts)


class UsageReader(ThreadedReports):
    """Reports for the running gateway, on a connection of their own, in a worker thread (the
    event loop never waits on a scan of the usage table)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.conn = connect(path)
        self._lock = threading.Lock()

    def _run(self, fn: Any, *args: Any, **kw: Any) -> Any:
        with self._lock:
            return fn(self.conn, *args, **kw)

    def close(self) -> None:
        with self._lock:
            self.conn.close()
