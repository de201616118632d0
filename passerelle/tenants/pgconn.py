"""PostgreSQL connections with a client-side deadline on everything: connecting, each statement, the wire.

A database that is stopped refuses connections and is noticed at once. One that stops answering
but keeps its connections open (a hung host, a partition that sends no reset, a frozen server)
is noticed by nothing the server does: its ``statement_timeout`` cannot fire. So every
connection here has

- ``connect_timeout``: connecting, the start-up exchange included, at most ``timeout_s``;
- TCP keepalives (after 2 s idle, every 1 s, 3 probes) and ``tcp_user_timeout``: a peer whose host
  is gone is noticed by the kernel within about ``timeout_s``;
- :func:`deadline`: a block of statements that has not finished after ``timeout_s`` has its socket
  shut down by a watchdog thread, so that the thread waiting in it gets an error at once. The
  connection is then broken and the caller treats the store as gone (it reconnects later).

The server's ``statement_timeout`` is kept as well: a slow query on a live server is ended
server-side, and the connection stays usable.

Example::

    conn = connect(url, 5.0)
    with deadline(conn, 5.0):
        conn.execute("SELECT 1")   # psycopg.OperationalError after 5 s of silence
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any


def redacted(url: str) -> str:
    """``url`` without its password, for logs and the start-up lines."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", url)


def first_line(exc: BaseException) -> str:
    """An error's first line, for a log line that says why the database is out of reach."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def connect(url: str, timeout_s: float, **kw: Any) -> Any:
    """A psycopg connection in autocommit mode, with ``timeout_s`` for connecting and each statement
    (server-side) and TCP keepalives; wrap its use in :func:`deadline` for the client-side bound."""
    import psycopg

    params: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 2, "keepalives_interval": 1,
                              "keepalives_count": 3, "tcp_user_timeout": int(timeout_s * 1000)}
    params.update(kw)
    return psycopg.connect(url, autocommit=True, connect_timeout=max(1, round(timeout_s)),
                           options=f"-c statement_timeout={int(timeout_s * 1000)}", **params)


class DeadlinePassed(Exception):
    """The database did not answer within the deadline; the connection was cut."""


def db_errors() -> tuple[type[BaseException], ...]:
    """What a call to the database raises when the database fails or is out of reach."""
    import psycopg

    return (psycopg.Error, DeadlinePassed)


def transient(exc: BaseException) -> bool:
    """An error worth one more try on a fresh transaction: a deadlock, a serialization failure, a
    lock or statement timeout, a connection the server ended (it restarted, a pooler cut it)."""
    import psycopg

    state = getattr(exc, "sqlstate", None) or ""
    return state.startswith(("40", "55P03", "57014", "57P01", "08")) or (
        isinstance(exc, psycopg.OperationalError) and not state)


class _Watchdog:
    """One daemon thread that shuts down the sockets of blocks past their deadline."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, int] = {}  # entry id -> the connection's socket
        self._fired: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, fd: int, at: float) -> int:
        with self._cond:
            entry = next(self._ids)
            self._armed[entry] = fd
            heapq.heappush(self._heap, (at, entry))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="passerelle-pg-deadline", daemon=True)
                self._thread.start()
            if self._heap[0][1] == entry:  # (the earliest now: the thread waits for a later one)
                self._cond.notify()
            return entry

    def disarm(self, entry: int) -> bool:
        """Remove the entry; True when it had fired (its socket was shut down)."""
        with self._cond:
            self._armed.pop(entry, None)
            if entry in self._fired:
                self._fired.discard(entry)
                return True
            return False

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] not in self._armed:
                    heapq.heappop(self._heap)  # (disarmed in time)
                if not self._heap:
                    self._cond.wait()
                    continue
                at, entry = self._heap[0]
                now = time.monotonic()
                if now < at:
                    self._cond.wait(at - now)
                    continue
                heapq.heappop(self._heap)
                fd = self._armed.pop(entry)
                self._fired.add(entry)
                # (under the lock: the block that owns the socket is still inside deadline(), so the
                # descriptor is still its connection's)
                with contextlib.suppress(OSError):
                    sock = socket.socket(fileno=os.dup(fd))
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    finally:
                        sock.close()


_WATCHDOG = _Watchdog()


@contextlib.contextmanager
def deadline(conn: Any, seconds: float) -> Iterator[None]:
    """Run the block's statements on ``conn`` within ``seconds``, or cut the connection: the block
    then raises :class:`DeadlinePassed` (from the driver's error)."""
    entry = _WATCHDOG.arm(conn.fileno(), time.monotonic() + seconds)
    try:
        yield
    except Exception as exc:
        if _WATCHDOG.disarm(entry):
            raise DeadlinePassed(f"no answer within {seconds:g} s ([store] timeout_s)") from exc
        raise
    else:
        if _WATCHDOG.disarm(entry):
            raise DeadlinePassed(f"no answer within {seconds:g} s ([store] timeout_s)")
