"""Usage per tenant (requests, prompt and completion tokens, by class) in SQLite.

Rows are buffered and written by a background task every half second in one transaction, so the
event loop never waits on the disk and a ``kill -9`` loses at most the last half second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time

from passerelle.observe.record import RequestRecord, clip

log = logging.getLogger("passerelle.tenants.usage")


class UsageRecorder:
    def __init__(self, conn: sqlite3.Connection, *, flush_s: float = 0.5) -> None:
        self.conn = conn
        self.flush_s = flush_s
        self._rows: list[tuple] = []
        self._task: asyncio.Task[None] | None = None

    def record(self, rec: RequestRecord) -> None:
        if rec.cause is None:
            return
        self._rows.append((time.time(), rec.tenant, rec.priority, clip(rec.model), rec.cause.value,
                           rec.prompt_tokens or 0, rec.completion_tokens or 0))

    def _write(self, rows: list[tuple]) -> None:
        with self.conn:
            self.conn.execute("BEGIN")
            self.conn.executemany("INSERT INTO usage VALUES (?,?,?,?,?,?,?)", rows)

    async def flush(self) -> None:
        if self._rows:
            rows, self._rows = self._rows, []
            try:
                await asyncio.to_thread(self._write, rows)
            except sqlite3.Error:
                log.exception("could not record usage of %d requests", len(rows))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="passerelle-usage")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()


def summarize(conn: sqlite3.Connection, since: float = 0.0) -> list[tuple]:
    """(tenant, class, requests, prompt tokens, completion tokens, requests not ok) since ``since``."""
    return conn.execute(
        "SELECT tenant, class, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), "
        "SUM(CASE WHEN cause = 'ok' THEN 0 ELSE 1 END) FROM usage WHERE ts >= ? "
        "GROUP BY tenant, class ORDER BY tenant, class", (since,)).fetchall()
