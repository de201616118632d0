"""The Batch API's state on disk: files and batches in SQLite, each file's content in a file of
its own, every write durable before it is acknowledged.

    <state>/batches.db            files, batches, and one row per answered line (results)
    <state>/batch-files/<id>      a file's content (an upload, or an output assembled at the end)

Durability: SQLite runs in WAL mode with ``synchronous=FULL`` (a commit is fsynced); a content
file is written beside its name, fsynced, renamed into place and its folder fsynced, and only then
is its row committed. A content file without a row (a crash between the two) is removed at start.

Exactly once: a line's answer is one row keyed by (batch, line), inserted with ``OR IGNORE`` and
committed before the line counts as done; the output file is assembled from these rows at the end,
so a line run twice (its answer lost in a crash before its commit) still appears once.

A content file is written as ``<id>.part`` first: while it exists it counts in the bytes kept
(``[batches] max_total_bytes``), a failed write removes it, and those a killed process left are
removed when the store opens (its folder is this gateway's own: one process opens ``batches.db``).

Every call goes to one thread (the store's executor), so SQLite is used from one thread and the
event loop never waits on a disk. Answers are committed in groups (one fsync for all the lines
that finished while the previous commit ran).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson

from passerelle.batches.status import ACTIVE

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, lines INTEGER NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, doc BLOB NOT NULL, status TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, record BLOB NOT NULL,
    prompt_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, line));
"""

# A store's fault: the disk (full, gone read-only) or the database. The line or batch that meets
# one waits and tries again; a client's request gets a JSON 507 or 503 (api.py).
STORE_ERRORS = (OSError, sqlite3.Error)


@dataclass(frozen=True, slots=True)
class FileRow:
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    lines: int
    created_at: float

    def describe(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at),
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "status_details": None, "expires_at": None}


@dataclass(frozen=True, slots=True)
class Result:
    """One answered line: ``record`` is its line of the output (ok) or error file."""

    batch_id: str
    line: int
    ok: bool
    record: bytes
    prompt_tokens: int = 0
    completion_tokens: int = 0


def write_durably(path: Path, chunks: Iterator[bytes] | list[bytes] | list[memoryview]) -> int:
    """Write ``path`` so that, once this returns, it is on disk under its name; its size. On an
    error (a full disk) nothing is left: neither the ``.part`` file nor a half-written ``path``."""
    tmp = path.with_name(path.name + ".part")
    size = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return size


class BatchStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.content_dir = root / "batch-files"
        self.content_dir.mkdir(parents=True, exist_ok=True)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-store")
        self.conn = sqlite3.connect(root / "batches.db", check_same_thread=False, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.executescript(_SCHEMA)
        self._pending: list[tuple[Result, asyncio.Future[None]]] = []
        self._flushing: asyncio.Task[None] | None = None
        self.remove_orphans()
        for p in self.content_dir.glob("*.part"):  # a write a killed process left
            with contextlib.suppress(OSError):
                p.unlink()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.conn.close()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the store's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def content_path(self, file_id: str) -> Path:
        return self.content_dir / file_id

    def remove_orphans(self, min_age_s: float = 600.0) -> None:
        """Remove content files that have no row (a crash came between the file and its row), once
        they are old enough not to be another instance's write in progress on a shared folder."""
        known = {r[0] for r in self.conn.execute("SELECT id FROM files")}
        horizon = time.time() - min_age_s
        for p in self.content_dir.iterdir():
            with contextlib.suppress(OSError):
                if p.name.removesuffix(".part") not in known and p.stat().st_mtime < horizon:
                    p.unlink()

    # -- files (on the store's thread) ----------------------------------------------------------
    def add_file(self, row: FileRow, chunks: list[bytes] | list[memoryview]) -> None:
        write_durably(self.content_path(row.id), chunks)
        self.conn.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                          (row.id, row.owner, row.purpose, row.filename, row.bytes, row.lines, row.created_at))

    def file(self, file_id: str) -> FileRow | None:
        r = self.conn.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return FileRow(*r) if r else None

    def files(self, owner: str | None, purpose: str | None, limit: int, after: str | None) -> list[FileRow]:
        sql, args = "SELECT * FROM files WHERE 1=1", []
        if owner is not None:
            sql, args = sql + " AND owner = ?", [owner]
        if purpose:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        if after:
            sql, args = sql + " AND created_at <= (SELECT created_at FROM files WHERE id = ?) AND id != ?", \
                [*args, after, after]
        rows = self.conn.execute(sql + " ORDER BY created_at DESC, id DESC LIMIT ?", [*args, limit]).fetchall()
        return [FileRow(*r) for r in rows]

    def delete_file(self, file_id: str) -> None:
        self.conn.execute("DELETE FROM files WHERE id = ?", (file_id,))
        with contextlib.suppress(FileNotFoundError):
            self.content_path(file_id).unlink()

    def total_bytes(self) -> int:
        """Bytes kept: every file's, and the ``.part`` files being written (or left by a kill)."""
        parts = 0
        for p in self.content_dir.glob("*.part"):
            with contextlib.suppress(OSError):
                parts += p.stat().st_size
        return parts + int(self.conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()[0])

    def file_in_use(self, file_id: str) -> bool:
        """An active batch reads it."""
        rows = self.conn.execute(f"SELECT doc FROM batches WHERE status IN ({','.join('?' * len(ACTIVE))})",
                                 ACTIVE).fetchall()
        return any(orjson.loads(r[0]).get("input_file_id") == file_id for r in rows)

    # -- batches --------------------------------------------------------------------------------
    def put_batch(self, doc: dict[str, Any]) -> None:
        self.conn.execute("INSERT OR REPLACE INTO batches VALUES (?, ?, ?, ?)",
                          (doc["id"], doc["_owner"], orjson.dumps(doc), doc["status"]))

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        r = self.conn.execute("SELECT doc FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return orjson.loads(r[0]) if r else None

    def batches(self, owner: str | None, limit: int, after: str | None,
                statuses: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        sql, args = "SELECT doc FROM batches WHERE 1=1", []
        if owner is not None:
            sql, args = sql + " AND owner = ?", [owner]
        if statuses:
            sql, args = sql + f" AND status IN ({','.join('?' * len(statuses))})", [*args, *statuses]
        rows = [orjson.loads(r[0]) for r in self.conn.execute(sql, args).fetchall()]
        rows.sort(key=lambda d: (d["created_at"], d["id"]), reverse=True)
        if after:
            ids = [d["id"] for d in rows]
            rows = rows[ids.index(after) + 1:] if after in ids else []
        return rows[:limit]

    # -- answered lines -------------------------------------------------------------------------
    def done_among(self, batch_id: str, first: int, last: int) -> set[int]:
        """The lines from ``first`` to ``last`` (numbers) already answered."""
        return {r[0] for r in self.conn.execute("SELECT line FROM results WHERE batch_id = ? AND line BETWEEN ? AND ?",
                                                (batch_id, first, last))}

    def counts(self, batch_id: str) -> tuple[int, int]:
        """(lines answered ok, lines failed)."""
        r = self.conn.execute("SELECT COALESCE(SUM(ok), 0), COUNT(*) FROM results WHERE batch_id = ?",
                              (batch_id,)).fetchone()
        return int(r[0]), int(r[1]) - int(r[0])

    def tokens(self, batch_id: str) -> tuple[int, int]:
        r = self.conn.execute("SELECT COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) "
                              "FROM results WHERE batch_id = ?", (batch_id,)).fetchone()
        return int(r[0]), int(r[1])

    def insert_results(self, rows: list[Result]) -> None:
        with self.conn:  # one transaction, one fsync
            self.conn.execute("BEGIN")
            self.conn.executemany("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?, ?)",
                                  [(r.batch_id, r.line, int(r.ok), r.record, r.prompt_tokens, r.completion_tokens)
                                   for r in rows])

    def records(self, batch_id: str, ok: bool) -> Iterator[bytes]:
        """The output (``ok``) or error file's lines, in the input's order."""
        cur = self.conn.execute("SELECT record FROM results WHERE batch_id = ? AND ok = ? ORDER BY line",
                                (batch_id, int(ok)))
        for (record,) in cur:
            yield bytes(record) + b"\n"

    def finish(self, doc: dict[str, Any], outputs: list[FileRow]) -> None:
        """Assemble the output and error files from the answered lines and mark the batch done, in
        that order: after a crash in between, the batch is still finalizing and is assembled again."""
        for row in outputs:
            ok = row.purpose == "batch_output"
            size = write_durably(self.content_path(row.id), self.records(doc["id"], ok))
            row = FileRow(row.id, row.owner, row.purpose, row.filename, size, row.lines, row.created_at)
            self.conn.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                              (row.id, row.owner, row.purpose, row.filename, row.bytes, row.lines, row.created_at))
        self.put_batch(doc)

    def drop_batch(self, batch_id: str) -> None:
        with self.conn:
            self.conn.execute("BEGIN")
            self.conn.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))
            self.conn.execute("DELETE FROM batches WHERE id = ?", (batch_id,))

    async def add_result(self, result: Result) -> None:
        """Record a line's answer; returns once it is committed (grouped with others)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((result, fut))
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush())
        await fut

    async def _flush(self) -> None:
        try:
            while self._pending:
                group, self._pending = self._pending, []
                try:
                    await self.run(self.insert_results, [r for r, _ in group])
                except Exception as exc:  # (a full disk): each waiting line sees it
                    for _, fut in group:
                        if not fut.done():
                            fut.set_exception(exc)
                else:
                    for _, fut in group:
                        if not fut.done():
                            fut.set_result(None)
        finally:
            self._flushing = None

    def expired_before(self, horizon: float) -> tuple[list[str], list[str]]:
        """Finished batches and unused input files older than ``horizon``: (batch ids, file ids)."""
        done: list[str] = []
        for (doc,) in self.conn.execute(f"SELECT doc FROM batches WHERE status NOT IN ({','.join('?' * len(ACTIVE))})",
                                        ACTIVE):
            d = orjson.loads(doc)
            ended = max(d.get(k) or 0 for k in ("completed_at", "failed_at", "expired_at", "cancelled_at"))
            if ended and ended < horizon:
                done.append(d["id"])
        files = [r[0] for r in self.conn.execute("SELECT id FROM files WHERE created_at < ?", (horizon,))]
        return done, [f for f in files if not self.file_in_use(f)]


def now() -> float:
    return time.time()
