"""The stores' writers, supervised (tenants/workers.py): one that fails is restarted and said in
/health (``Stores.describe``) and /metrics; SQLite's usage rows whose commit fails are kept,
within a bound, and what passes it is counted. The real full disk and frozen database are in
tests/integration/test_store_faults.py."""

from __future__ import annotations

import sqlite3
import threading
import time

from prometheus_client import generate_latest

from passerelle.errors import Cause
from passerelle.observe.metrics import Metrics
from passerelle.observe.record import RequestRecord
from passerelle.tenants.db import connect
from passerelle.tenants.stores import Stores
from passerelle.tenants.usage import UsageReader, UsageRecorder
from passerelle.tenants.workers import Worker
from tests.waiting import until, wait_until


def finished(i: int) -> RequestRecord:
    rec = RequestRecord(f"req_{i}", "chat", model="m")
    rec.key_id, rec.tenant, rec.cause = "k1", "t", Cause.OK
    rec.prompt_tokens, rec.completion_tokens = 5, i
    return rec


def test_a_thread_whose_loop_raises_is_run_again_and_counted():
    stop = threading.Event()
    runs: list[float] = []

    def loop() -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            raise RuntimeError("a bug in the copier")
        stop.wait()

    worker = Worker("copier", loop, stop)
    worker.start()
    wait_until(lambda: len(runs) == 2, 5, what="the loop run again")
    assert runs[1] - runs[0] >= 0.5  # (after a backoff)
    assert worker.describe() == {"alive": True, "restarts": 1, "last_error": "RuntimeError: a bug in the copier"}
    stop.set()
    worker.join(5)
    assert not worker.alive


async def test_the_sqlite_usage_writer_that_fails_is_restarted_and_said_in_health_and_metrics(tmp_path):
    rec = UsageRecorder(connect(tmp_path / "p.db"), flush_s=0.02)
    reader = UsageReader(tmp_path / "p.db")
    flush, failed = rec.flush, []

    async def failing_once() -> None:
        if not failed:
            failed.append(True)
            raise RuntimeError("a bug in the writer")
        await flush()

    rec.flush = failing_once  # type: ignore[method-assign]
    stores = Stores(keys=None, usage=rec, reports=reader, load_usage=reader.used_since)  # type: ignore[arg-type]
    assert stores.describe() is None  # (SQLite, all well: nothing to say in /health)
    rec.start()
    rec.record(finished(1))
    await until(lambda: not rec.held, 5, "the held rows written", interval=0.02)
    assert rec.held == 0 and (await reader.report(by=("key",)))[0]["requests"] == 1  # written after the restart
    state = stores.describe()
    assert state is not None and state["workers"]["usage-writer"] == {
        "alive": True, "restarts": 1, "last_error": "RuntimeError: a bug in the writer"}
    assert state["usage_up"] is False  # (for a minute after a failure: it may fail again)
    metrics = Metrics()
    stores.export(metrics)
    assert 'passerelle_store_worker_restarts{worker="usage-writer"} 1.0' in generate_latest(metrics.registry).decode()
    await rec.stop()
    rec.close()
    reader.close()


async def test_sqlite_rows_whose_commit_fails_are_kept_up_to_a_bound_and_the_rest_counted(tmp_path):
    rec = UsageRecorder(connect(tmp_path / "p.db"), max_held=4)
    write = rec._write

    def full(rows) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    rec._write = full  # type: ignore[method-assign]
    for i in range(10):
        rec.record(finished(i))
    await rec.flush()
    assert rec.failing and rec.held == 4 and rec.dropped == 6
    rec._write = write  # type: ignore[method-assign]
    await rec.flush()
    assert not rec.failing and rec.held == 0
    assert sorted(r[0] for r in rec.conn.execute("SELECT completion_tokens FROM usage")) == [6, 7, 8, 9]
    rec.close()
