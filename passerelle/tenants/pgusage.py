"""Usage rows in PostgreSQL (``[store] url``), through a spool file so that none is lost.

Each finished request's row, with an id of its own, is appended to a spool file in the
instance's state directory (``usage-spool.jsonl``: one write, so a ``kill -9`` of the gateway
loses nothing written) and a thread copies the spool to the ``usage`` table every ``flush_s``, in
one transaction, ``ON CONFLICT (id) DO NOTHING``: a row copied twice (a crash between the insert
and the spool's truncation, a restart that replays the spool) is kept once. The request path only
appends a line.

While the database is away the spool grows, up to ``[store] spool_max_mib`` (past it new rows are
dropped and counted, said in the log), and is written back when the database returns. The spool
is truncated once everything in it is in the database.

On a full disk a line is written whole or not at all (a write cut short is truncated back); the
rows the disk refuses wait in memory (at most :data:`MAX_HELD`) and the thread appends them again
once there is room. A line that cannot be read (cut by a crash of an older passerelle) is
skipped, logged and counted (``damaged``); the thread never stops on one, and it is supervised
(tenants/workers.py) against anything else.

Example::

    usage = PgUsage(url, state / "usage-spool.jsonl"); usage.start()
    gateway.listeners.append(usage.record)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from passerelle.errors import StoreUnavailable
from passerelle.observe.record import RequestRecord, clip
from passerelle.tenants.pgconn import connect, db_errors, deadline, first_line, redacted
from passerelle.tenants.pgstore import _Conn
from passerelle.tenants.usage import ThreadedReports, billed_tokens
from passerelle.tenants.workers import Worker

log = logging.getLogger("passerelle.tenants.pgusage")

_INSERT = ("INSERT INTO usage (id, ts, tenant, key_id, class, model, cause, prompt_tokens, completion_tokens, "
           "\"user\", session) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING")
_FIELDS = 11  # a spool line's fields (lines spooled before user and session were written have 9)
_READ_CHUNK = 4 << 20  # bytes of spool read and written back per transaction
MAX_HELD = 100_000  # rows kept in memory while the disk refuses the spool (about 20 MB); past it the oldest go


class Spool:
    """An append-only file of JSON lines, at most ``max_bytes``; read back from an offset."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path, self.max_bytes = path, max_bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:  # two gateways on one spool would truncate each other's rows away
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise RuntimeError(f"{path} is in use by another gateway: give each gateway its own [server] "
                               "state_dir") from None
        self.size = os.fstat(self._fd).st_size
        self._lock = threading.Lock()
        self.cut_tail = self._cut_partial_tail()

    def _cut_partial_tail(self) -> int:
        """A line left half written (a crash of an older passerelle mid-write) is cut off, so that the
        next line does not glue onto it; the bytes cut."""
        if self.size == 0:
            return 0
        with open(self.path, "rb") as f:
            f.seek(max(0, self.size - _READ_CHUNK))
            tail = f.read()
        keep = self.size - len(tail) + tail.rfind(b"\n") + 1
        if keep == self.size:
            return 0
        os.ftruncate(self._fd, keep)
        cut, self.size = self.size - keep, keep
        log.error("usage spool %s ended in a partial line: %d bytes cut off", self.path, cut)
        return cut

    def append(self, line: bytes) -> bool:
        """Write ``line`` whole, or nothing: False past ``max_bytes``; OSError (a full disk) with the
        file as it was before."""
        with self._lock:
            if self.size + len(line) > self.max_bytes:
                return False
            try:
                written = os.write(self._fd, line)
            except OSError:
                self._cut_back()
                raise
            if written != len(line):  # a full disk takes part of a write and refuses the rest
                self._cut_back()
                raise OSError(errno.ENOSPC, f"only {written} of {len(line)} bytes written")
            self.size += len(line)
            return True

    def _cut_back(self) -> None:
        with contextlib.suppress(OSError):  # (freeing blocks works on a full disk)
            os.ftruncate(self._fd, self.size)

    def read(self, offset: int) -> tuple[list[bytes], int]:
        """The whole lines from ``offset`` (at most about :data:`_READ_CHUNK`), and where they end."""
        with open(self.path, "rb") as f:
            f.seek(offset)
            data = f.read(_READ_CHUNK)
        end = data.rfind(b"\n") + 1
        return data[:end].splitlines(), offset + end

    def truncate_if(self, offset: int) -> bool:
        """Empty the file if everything up to its end was written back (``offset`` is its size)."""
        with self._lock:
            if offset != self.size:
                return False
            os.ftruncate(self._fd, 0)
            self.size = 0
            return True

    def close(self) -> None:
        os.close(self._fd)


class PgUsage:
    """The usage sink for PostgreSQL: ``record`` (the request path), a writer thread, ``flush``."""

    def __init__(self, url: str, spool_path: Path, *, flush_s: float = 0.5, timeout_s: float = 5.0,
                 retry_s: float = 1.0, spool_max_bytes: int = 256 << 20, max_held: int = MAX_HELD,
                 clock: Callable[[], float] = time.time) -> None:
        self.url, self.flush_s, self.timeout_s, self.retry_s, self.clock = url, flush_s, timeout_s, retry_s, clock
        self.spool = Spool(spool_path, spool_max_bytes)
        self.offset = 0  # spool bytes known written back (0 at start: a spool left by a crash is replayed)
        self.up = True
        self.dropped = 0  # rows lost: a full spool ([store] spool_max_mib), or more than max_held on a full disk
        self.damaged = 1 if self.spool.cut_tail else 0  # spool lines that could not be read (skipped)
        self.written = 0
        self.max_held = max_held
        self._held: deque[bytes] = deque()  # lines the disk refused (full): appended again by the thread
        self._held_lock = threading.Lock()
        self._conn: Any = None
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.worker = Worker("pg-usage", self._run, self._stop)

    @property
    def pending_bytes(self) -> int:
        return self.spool.size - self.offset

    @property
    def held(self) -> int:
        """Rows in memory, waiting for room on the disk."""
        return len(self._held)

    def record(self, rec: RequestRecord) -> None:
        if rec.cause is None:
            return
        prompt, completion = billed_tokens(rec)
        line = orjson.dumps([uuid.uuid4().hex, self.clock(), rec.tenant, rec.key_id, rec.priority, clip(rec.model),
                             rec.cause.value, prompt, completion, rec.user, rec.session]) + b"\n"
        if self._held:  # (rows wait already: this one goes after them, in order)
            self._hold(line)
            return
        try:
            kept = self.spool.append(line)
        except OSError as exc:
            log.error("usage spool %s: %s; usage rows kept in memory (at most %d) until there is room",
                      self.spool.path, exc, self.max_held)
            self._hold(line)
            return
        if not kept:
            self._lose(1, "the usage spool is full ([store] spool_max_mib)")

    def _hold(self, line: bytes) -> None:
        with self._held_lock:
            if len(self._held) >= self.max_held:
                self._held.popleft()
                self._lose(1, f"more than {self.max_held} usage rows wait for room on the disk")
            self._held.append(line)

    def _lose(self, n: int, why: str) -> None:
        before, self.dropped = self.dropped, self.dropped + n
        if before == 0 or before // 10_000 != self.dropped // 10_000:
            log.error("%s (%s): %d usage rows lost so far", why, self.spool.path, self.dropped)

    def _unhold(self) -> None:
        """Append the rows the disk refused, in order, while it takes them."""
        with self._held_lock:
            while self._held:
                try:
                    if not self.spool.append(self._held[0]):
                        self._held.popleft()
                        self._lose(1, "the usage spool is full ([store] spool_max_mib)")
                        continue
                except OSError:
                    return
                self._held.popleft()
            log.warning("usage spool %s: room on the disk again", self.spool.path)

    def _rows(self, lines: list[bytes]) -> list[list[Any]]:
        """The rows of spool lines; a damaged line (not a row) is skipped, counted and logged."""
        rows = []
        for line in lines:
            try:
                row = orjson.loads(line)
                if not isinstance(row, list) or not 9 <= len(row) <= _FIELDS:
                    raise ValueError(f"{len(row) if isinstance(row, list) else type(row).__name__} fields")
                uuid.UUID(row[0])
            except (ValueError, TypeError, AttributeError) as exc:  # (orjson.JSONDecodeError is a ValueError)
                self.damaged += 1
                log.error("usage spool %s: a damaged line skipped (%s): %r", self.spool.path, exc, line[:120])
                continue
            rows.append(row + [""] * (_FIELDS - len(row)))
        return rows

    def drain(self) -> bool:
        """Write the spool back to the database; False when the database is away."""
        if self._held:
            self._unhold()
        errors: tuple[type[BaseException], ...] = (*db_errors(), OSError)
        with self._lock:
            try:
                while True:
                    lines, end = self.spool.read(self.offset)
                    if not lines:
                        break
                    rows = self._rows(lines)
                    if rows:
                        if self._conn is None:
                            if time.monotonic() < self._retry_at:
                                return False
                            self._conn = connect(self.url, self.timeout_s)
                        with deadline(self._conn, self.timeout_s), self._conn.transaction(), \
                                self._conn.cursor() as cur:
                            cur.executemany(_INSERT, rows)
                    self.offset = end
                    self.written += len(rows)
                    if not self.up:
                        log.warning("usage store %s reachable again: %d usage rows written back so far",
                                    self._redacted, self.written)
                        self.up = True
                if self.spool.truncate_if(self.offset):
                    self.offset = 0
                return True
            except errors as exc:
                if self.up:
                    log.error("usage store %s unreachable (%s): usage rows kept in %s until it is back",
                              self._redacted, first_line(exc), self.spool.path)
                self.up = False
                if self._conn is not None:
                    with contextlib.suppress(Exception):  # a broken connection: closing it says nothing more
                        self._conn.close()
                self._conn = None
                self._retry_at = time.monotonic() + self.retry_s
                return False

    @property
    def _redacted(self) -> str:
        return redacted(self.url)

    async def flush(self) -> None:
        await asyncio.to_thread(self.drain)

    async def prune(self) -> int:
        return 0  # (the shared table is kept whole; see docs/limits.md)

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            self.drain()

    def start(self) -> None:
        self.worker.start()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self.worker.join, self.timeout_s + self.flush_s + 1)
        try:
            await self.flush()
        except Exception:  # (what stays in the spool is written back at the next start)
            log.exception("usage spool %s: the last write-back failed", self.spool.path)
        if self._held:
            log.error("usage spool %s: %d usage rows still wait for room on the disk and are lost",
                      self.spool.path, len(self._held))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        self.spool.close()


class PgUsageReader(ThreadedReports):
    """Reports on the shared usage table, in a worker thread, on a connection of their own
    (reconnected on the next report after a failure)."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        self.url, self.timeout_s = url, timeout_s
        self._conn: _Conn | None = None
        self._lock = threading.Lock()

    def _run(self, fn: Any, *args: Any, **kw: Any) -> Any:
        errors: tuple[type[BaseException], ...] = (*db_errors(), StoreUnavailable)
        with self._lock:
            try:
                if self._conn is None:
                    self._conn = _Conn(connect(self.url, self.timeout_s), self.timeout_s)
                return fn(self._conn, *args, **kw)
            except errors as exc:
                if self._conn is not None:
                    with contextlib.suppress(Exception):
                        self._conn.close()
                self._conn = None
                why = first_line(exc.__cause__ or exc if isinstance(exc, StoreUnavailable) else exc)
                raise StoreUnavailable(f"The usage store is out of reach ({why}); try again later.",
                                       retry_after=5) from None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
