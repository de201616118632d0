"""Who the people behind a front-end's key are: their name and email beside the id it forwards,
so that ``passerelle usage --by user`` reads as people, not as UUIDs.

One row per (key, user) in its own table, ``people``, created here when missing, in the instance's
SQLite file or in the shared PostgreSQL store (the same SQL, ``?`` placeholders: the PostgreSQL
connection translates them, tenants/pgstore.py). The usage table is not touched: a person's name
is written once, not once per request.

Bounded: a finished request is remembered in memory only until the next flush (at most
:data:`MAX_PENDING` distinct people; past it, new ones wait for a later request), and the last
:data:`MAX_KNOWN` people written are kept so that an unchanged name is not written again. A million
distinct people cost a million rows on disk, and never more than these two maps in memory.

Example::

    book = PeopleBook(conn)                      # conn: tenants/db.py connect() or a pgstore _Conn
    book.observe(rec)                            # a listener of finished requests
    await book.flush()
    names(conn, "key123", ["8f1c…"])             # {"8f1c…": ("Alice", "alice@example.org")}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from passerelle.config import Config
from passerelle.observe.record import RequestRecord
from passerelle.tenants.db import connect

log = logging.getLogger("passerelle.tenants.people")

MAX_PENDING = 10_000  # people waiting to be written (one flush every half second)
MAX_KNOWN = 4096  # people written recently, not written again while their name stays the same
MAX_LOOKUP = 500  # ids asked at once by names()

_CREATE = ('CREATE TABLE IF NOT EXISTS people (key_id TEXT NOT NULL, "user" TEXT NOT NULL, '
           'name TEXT NOT NULL, email TEXT NOT NULL, seen REAL NOT NULL, PRIMARY KEY (key_id, "user"))')
_UPSERT = ('INSERT INTO people (key_id, "user", name, email, seen) VALUES (?, ?, ?, ?, ?) '
           'ON CONFLICT (key_id, "user") DO UPDATE SET name = excluded.name, email = excluded.email, '
           'seen = excluded.seen')

_Who = tuple[str, str]  # (key id, user)


def create_table(conn: Any) -> None:
    conn.execute(_CREATE)


class PeopleBook:
    """Writes the names and emails a trusted front-end forwards (see the module's notes)."""

    def __init__(self, conn: Any, *, flush_s: float = 0.5) -> None:
        self.conn = conn
        self.flush_s = flush_s
        self._pending: dict[_Who, tuple[str, str, float]] = {}
        self._known: OrderedDict[_Who, tuple[str, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None
        self._ready = False

    def observe(self, rec: RequestRecord) -> None:
        """A finished request: its person's name and email, when it named someone new or changed."""
        if not rec.user or not (rec.user_name or rec.user_email):
            return
        who, what = (rec.key_id, rec.user), (rec.user_name, rec.user_email)
        if self._known.get(who) == what:
            self._known.move_to_end(who)
            return
        if who in self._pending or len(self._pending) < MAX_PENDING:
            self._pending[who] = (*what, time.time())

    def _write(self, rows: list[tuple[str, str, str, str, float]]) -> None:
        with self._lock:
            if not self._ready:
                create_table(self.conn)
                self._ready = True
            self.conn.execute("BEGIN")
            try:
                for row in rows:
                    self.conn.execute(_UPSERT, row)
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise

    async def flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        try:
            await asyncio.to_thread(self._write, [(k, u, n, e, t) for (k, u), (n, e, t) in pending.items()])
        except Exception:  # (the database's own errors, SQLite's or psycopg's: names wait for a later request)
            log.exception("could not record the names of %d people", len(pending))
            return
        for who, (name, email, _) in pending.items():
            self._known[who] = (name, email)
            self._known.move_to_end(who)
        while len(self._known) > MAX_KNOWN:
            self._known.popitem(last=False)

    def _names(self, key_id: str, users: list[str]) -> dict[str, tuple[str, str]]:
        with self._lock:
            return names(self.conn, key_id, users)

    async def lookup(self, key_id: str, users: list[str]) -> dict[str, tuple[str, str]]:
        """The names and emails of ``users`` of ``key_id`` (those just seen included); {} when the
        store cannot answer now (a report still shows the ids)."""
        await self.flush()
        try:
            return await asyncio.to_thread(self._names, key_id, users)
        except Exception:  # (the database's own errors, SQLite's or psycopg's)
            log.exception("could not read the names of %d people", len(users))
            return {}

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="passerelle-people")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


def open_book(cfg: Config) -> PeopleBook:
    """The book in the store the usage goes to: ``[store] url``'s PostgreSQL, or the SQLite file."""
    if cfg.store.url:
        from passerelle.tenants.pgconn import connect as pg_connect
        from passerelle.tenants.pgstore import _Conn

        st = cfg.store  # (each statement within timeout_s, as every other database call: tenants/pgconn.py)
        return PeopleBook(_LazyPg(lambda: _Conn(pg_connect(st.url, st.timeout_s), st.timeout_s)))
    return PeopleBook(connect(cfg.db_path()))


class _LazyPg:
    """A PostgreSQL connection made at the first write (in the writer's thread, never at start-up:
    a store out of reach must not hold the gateway's start), and made again after an error."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make: Callable[[], Any] = make
        self.conn: Any = None

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> Any:
        if self.conn is None:
            self.conn = self.make()
        try:
            return self.conn.execute(sql, args)
        except Exception:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None
            raise

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def names(conn: Any, key_id: str | None, users: Sequence[str]) -> dict[str, tuple[str, str]]:
    """The name and email of each of ``users`` (of ``key_id``, or of any key: the latest seen);
    users never named are left out."""
    create_table(conn)
    out: dict[str, tuple[str, str, float]] = {}
    wanted = [u for u in dict.fromkeys(users) if u]
    for i in range(0, len(wanted), MAX_LOOKUP):
        batch = wanted[i:i + MAX_LOOKUP]
        marks = ", ".join("?" * len(batch))
        sql = f'SELECT "user", name, email, seen FROM people WHERE "user" IN ({marks})'
        args: tuple[Any, ...] = tuple(batch)
        if key_id is not None:
            sql += " AND key_id = ?"
            args += (key_id,)
        for user, name, email, seen in conn.execute(sql, args).fetchall():
            if user not in out or seen > out[user][2]:
                out[user] = (name, email, seen)
    return {u: (n, e) for u, (n, e, _) in out.items()}
