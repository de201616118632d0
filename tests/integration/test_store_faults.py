"""The stores against real faults: a full disk (a 256 KiB tmpfs mounted as the state directory,
filled until writes fail, then freed) and a frozen PostgreSQL (its postmaster and backends
stopped with SIGSTOP, so that connections stay open and nothing answers). Nothing written is
lost, no writer thread dies, and a database that stops answering is treated as gone within
``[store] timeout_s``.

Mounting needs root and stopping the server needs the right to signal it: these tests run as
root (as .ci/run does) and fail, saying so, otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import orjson
import psycopg
import pytest
from prometheus_client import generate_latest

from passerelle.errors import Cause
from passerelle.observe.metrics import Metrics
from passerelle.observe.record import RequestRecord
from passerelle.tenants.db import connect
from passerelle.tenants.pgquota import PgQuotas
from passerelle.tenants.pgstore import PgKeyStore
from passerelle.tenants.pgusage import PgUsage, PgUsageReader
from passerelle.tenants.quota import Limit, window
from passerelle.tenants.stores import Stores
from passerelle.tenants.usage import UsageRecorder
from tests.disk import small_disk as mounted
from tests.integration.test_store_postgres import Postgres, chat, shared
from tests.integration.test_store_postgres_ha import burst, make_key, metric, two_gateways
from tests.waiting import until, wait_until


@pytest.fixture(scope="module")
def postgres():
    pg = Postgres()
    yield pg
    pg.close()


@pytest.fixture
def small_disk(tmp_path):
    with mounted(tmp_path / "disk", "256k") as disk:
        yield disk


def finished(i: int, key_id: str = "k1") -> RequestRecord:
    rec = RequestRecord(f"req_{i}", "chat", model="m")
    rec.key_id, rec.tenant, rec.cause = key_id, "t", Cause.OK
    rec.prompt_tokens, rec.completion_tokens = 5, i
    return rec


def pg_rows(url: str, key_id: str = "k1") -> list[int]:
    with psycopg.connect(url) as conn:
        return sorted(r[0] for r in conn.execute("SELECT completion_tokens FROM usage WHERE key_id = %s",
                                                 (key_id,)))


def migrated(url: str) -> str:
    PgKeyStore(url, poll_s=5).close()  # (the schema, as a gateway's start makes it)
    return url


def test_a_full_disk_leaves_no_half_line_in_the_spool_and_every_row_reaches_postgresql(postgres, small_disk,
                                                                                       caplog):
    url = migrated(postgres.new_database())
    spool = small_disk.path / "usage-spool.jsonl"
    usage = PgUsage(url, spool, flush_s=0.05, timeout_s=2)
    n = 0
    for _ in range(3):  # (a block of the spool's in use: the next writes fill it, then one is cut short)
        usage.record(finished(n))
        n += 1
    small_disk.fill()
    for _ in range(300):  # requests finish while the disk is full (the first fill the spool's last block)
        usage.record(finished(n))
        n += 1
    data = spool.read_bytes()
    assert data.endswith(b"\n"), data[-80:]  # whole lines only: a write cut short was taken back
    assert all(len(orjson.loads(line)) == 11 for line in data.splitlines())
    assert len(data.splitlines()) < n  # (the disk did refuse rows)
    assert "usage rows kept in memory" in caplog.text  # said in the log
    small_disk.free()
    usage.start()
    wait_until(lambda: len(pg_rows(url)) == n, 20, what="every row in PostgreSQL")
    assert pg_rows(url) == list(range(n))  # each once, none lost
    assert usage.held == 0 and usage.dropped == 0 and usage.damaged == 0
    assert usage.worker.describe() == {"alive": True, "restarts": 0}
    asyncio.run(usage.stop())
    usage.close()


def test_a_damaged_spool_line_is_skipped_and_counted_and_the_copier_carries_on(postgres, tmp_path):
    url = migrated(postgres.new_database())
    spool = tmp_path / "usage-spool.jsonl"

    def line(i: int) -> bytes:
        return orjson.dumps([uuid.uuid4().hex, time.time(), "t", "k1", "standard", "m", "ok", 5, i, "", ""]) + b"\n"

    # half a line glued to the next one (what a full disk left before), a line that is not a row, a half tail
    spool.write_bytes(line(1) + line(9)[:40] + line(2) + b'{"a": 1}\n' + line(3) + line(8)[:30])
    usage = PgUsage(url, spool, flush_s=0.05, timeout_s=2)
    usage.start()
    wait_until(lambda: len(pg_rows(url)) == 2, 20, what="the good rows in PostgreSQL")
    assert pg_rows(url) == [1, 3]
    assert usage.damaged == 3  # the glued line, the line that is not a row, the half tail (cut off at open)
    assert usage.up and usage.worker.describe() == {"alive": True, "restarts": 0}
    usage.record(finished(4))  # and later rows still go
    wait_until(lambda: len(pg_rows(url)) == 3, 20, what="a later row in PostgreSQL")
    asyncio.run(usage.stop())
    usage.close()


def test_a_copier_that_fails_is_restarted_and_said_in_health(postgres, tmp_path):
    url = migrated(postgres.new_database())
    usage = PgUsage(url, tmp_path / "usage-spool.jsonl", flush_s=0.05, timeout_s=2)
    rows, failed = usage._rows, []

    def failing_once(lines):
        if not failed:
            failed.append(True)
            raise KeyError("a bug in the copier")
        return rows(lines)

    usage._rows = failing_once  # type: ignore[method-assign]
    keys, reader = PgKeyStore(url, poll_s=0.2), PgUsageReader(url)
    stores = Stores(keys=keys, usage=usage, reports=reader, load_usage=reader.used_since)
    usage.record(finished(1))
    usage.start()
    wait_until(lambda: pg_rows(url) == [1], 20, what="the row written after the restart")
    state = stores.describe()
    assert state is not None and state["workers"]["pg-usage"] == {
        "alive": True, "restarts": 1, "last_error": "KeyError: 'a bug in the copier'"}
    assert state["usage_up"] is False and state["up"] is False  # (for a minute after a failure)
    assert state["workers"]["pg-keys"] == {"alive": True, "restarts": 0}
    metrics = Metrics()
    stores.export(metrics)
    assert 'passerelle_store_worker_restarts{worker="pg-usage"} 1.0' in generate_latest(metrics.registry).decode()
    asyncio.run(stores.close())


async def test_sqlite_usage_that_fails_to_commit_on_a_full_disk_is_kept_and_written_once_space_is_back(small_disk):
    conn = connect(small_disk.path / "passerelle.db")
    rec = UsageRecorder(conn, flush_s=0.05)
    n = 0
    for _ in range(3):
        rec.record(finished(n))
        n += 1
    await rec.flush()
    small_disk.fill()

    def stored() -> int:
        return int(conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0])

    while stored() == n:  # requests finish until a commit fails
        assert n < 20_000, "the disk never refused a commit"
        for _ in range(50):
            rec.record(finished(n))
            n += 1
        await rec.flush()
    rec.start()  # the writer task keeps trying
    for _ in range(10):  # more requests finish while the disk is full
        rec.record(finished(n))
        n += 1
    small_disk.free()
    await until(lambda: stored() >= n, 20, "every row in the database", interval=0.05)
    got = sorted(r[0] for r in conn.execute("SELECT completion_tokens FROM usage"))
    assert got == list(range(n))  # none lost, none twice
    assert rec.held == 0 and not rec.failing and rec.dropped == 0
    assert rec.worker.describe() == {"alive": True, "restarts": 0}
    await rec.stop()
    rec.close()


def test_a_transient_error_on_a_reservation_is_tried_again_before_counting_alone(postgres):
    url = migrated(postgres.new_database())
    quotas = PgQuotas(url, timeout_s=2)
    start, end = window("day", time.time())
    limits = [Limit("day", start, end, None, 50)]
    assert quotas._reserve("k", limits, 10) == {"day": (10.0, 1)}
    with psycopg.connect(url, autocommit=True) as admin:  # the server ends the quota connection
        pid = quotas._conn.info.backend_pid
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    assert quotas._reserve("k", limits, 10) == {"day": (20.0, 2)}  # tried again on a new connection
    assert quotas.retried == 1 and quotas.counted_alone == 0 and not quotas.down
    quotas.close()


def test_transient_errors_on_reservations_never_let_two_gateways_past_a_shared_quota(postgres, gateway,
                                                                                   fake_backend, tmp_path):
    url = postgres.new_database()
    a, b, secret, key_id = two_gateways(gateway, fake_backend, url, tmp_path, "50 requests/day")
    with psycopg.connect(url, autocommit=True) as conn:  # a few updates of the counters fail, as under contention
        conn.execute("CREATE SEQUENCE fault_seq")
        conn.execute("""CREATE FUNCTION fault() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN IF nextval('fault_seq') IN (3, 10, 20, 30) THEN
                RAISE EXCEPTION 'could not serialize access (injected)' USING ERRCODE = '40001'; END IF;
            RETURN NEW; END $$""")
        conn.execute("CREATE TRIGGER fault BEFORE UPDATE ON quota_use FOR EACH ROW EXECUTE FUNCTION fault()")
    statuses = asyncio.run(burst([a.url, b.url], secret, 40))
    served = statuses.count(200)
    print(f"\n2 gateways x 40 concurrent requests, a quota of 50 requests a day, 4 serialization failures "
          f"injected: {served} served, {statuses.count(429)} refused (429)")
    assert served == 50 and statuses.count(429) == 30, statuses
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT last_value >= 30 FROM fault_seq").fetchone() == (True,)  # (the faults fired)
        wait_until(lambda: conn.execute("SELECT requests FROM quota_use WHERE key_id = %s AND period = 'day'",
                                        (key_id,)).fetchone() == (50,), 15, what="the counter at 50")
    assert metric(a, "passerelle_quota_counted_alone") == 0 and metric(b, "passerelle_quota_counted_alone") == 0


# -- a frozen PostgreSQL ---------------------------------------------------------------------------
ADMIN_KEY = "adm-7c1e9a04d25b4f38a6e0b5d1c9f27e83"


def admin_metric(gw, name: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10, headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


class Frozen:
    """SIGSTOP the server's postmaster and every backend; SIGCONT undoes it."""

    def __init__(self, pg: Postgres) -> None:
        self.pg = pg
        self.pids: list[int] = []

    def freeze(self) -> None:
        postmaster = int(Path(f"{self.pg.dir}/data/postmaster.pid").read_text().split()[0])
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(postmaster)], capture_output=True, text=True,
                                  timeout=10).stdout.split()
        self.pids = [postmaster, *map(int, children)]
        for pid in self.pids:
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.pids = []


@pytest.fixture
def frozen_pg():
    pg = Postgres()  # (its own: freezing it must not stall the module's other tests)
    frozen = Frozen(pg)
    yield frozen
    frozen.thaw()
    pg.close()


def timed_chat(gw, secret: str) -> tuple[int, float]:
    t0 = time.monotonic()
    try:
        status = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                            timeout=10, json={"model": "fake-model", "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "hi"}]}).status_code
    except httpx.TimeoutException:
        status = 0  # (held past 10 s)
    return status, time.monotonic() - t0


def test_a_frozen_database_is_treated_as_gone_within_timeout_s(frozen_pg, gateway, fake_backend):
    url = frozen_pg.pg.new_database()
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(shared(fake.url, url) + f'\n[admin]\nkey = "{ADMIN_KEY}"\n')  # [store] timeout_s = 2, poll_s = 0.2
    secret, key_id = make_key(gw, "--quota", "1000 requests/day")
    wait_until(lambda: chat(gw, None) == 401, 10, what="keys in use")
    assert chat(gw, secret) == 200  # the key served, its quota reserved in PostgreSQL
    frozen_pg.freeze()
    frozen_at = time.monotonic()
    answered = [timed_chat(gw, secret) for _ in range(3)]
    print(f"\nrequests of a key with a quota, PostgreSQL frozen ([store] timeout_s = 2): "
          f"{', '.join(f'{s} in {t:.2f} s' for s, t in answered)}")
    assert all(s == 200 and t < 2 + 2.5 for s, t in answered), answered  # not held past the deadline

    def store_down() -> bool:
        store = httpx.get(gw.url + "/health", timeout=5).json()["store"]
        return store["up"] is False and store["keys_from"] == "cache" and store["quotas_up"] is False

    wait_until(store_down, 2 + 0.2 + 5, what="/health saying the store is down")
    print(f"/health says the store is down {time.monotonic() - frozen_at:.1f} s after the freeze")
    assert admin_metric(gw, "passerelle_store_up") == 0
    assert admin_metric(gw, "passerelle_quota_counted_alone") >= 1  # counting alone, said
    assert "counted by this gateway alone" in gw.log_text()
    concurrent = asyncio.run(_burst(gw.url, secret, 10))
    assert all(s == 200 and t < 2 + 2.5 for s, t in concurrent), concurrent
    t0 = time.monotonic()  # a key written meanwhile: a 503 that says why, within the deadline
    made = httpx.post(gw.url + "/admin/keys", json={"tenant": "x"}, timeout=10,
                      headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert made.status_code == 503 and made.json()["error"]["code"] == "store_unavailable", made.text
    assert time.monotonic() - t0 < 2 + 2.5
    frozen_pg.thaw()
    wait_until(lambda: httpx.get(gw.url + "/health", timeout=5).json()["store"]["up"] is True, 30,
               what="the store back in /health")
    assert chat(gw, secret) == 200 and admin_metric(gw, "passerelle_store_up") == 1
    # what was served meanwhile is in the shared usage table and counter, once each
    wait_until(lambda: len(pg_rows(url, key_id)) == 15, 20, what="the usage rows in PostgreSQL")
    with psycopg.connect(url) as conn:
        wait_until(lambda: conn.execute("SELECT requests FROM quota_use WHERE key_id = %s AND period = 'day'",
                                        (key_id,)).fetchone() == (15,), 20, what="the quota counter caught up")
    health = httpx.get(gw.url + "/health", timeout=5).json()["store"]
    assert all(w["alive"] and w["restarts"] == 0 for w in health["workers"].values()), health


async def _burst(url: str, secret: str, n: int) -> list[tuple[int, float]]:
    async with httpx.AsyncClient(timeout=30) as client:
        async def one() -> tuple[int, float]:
            t0 = time.monotonic()
            r = await client.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                                  json={"model": "fake-model", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "hi"}]})
            return r.status_code, time.monotonic() - t0
        return await asyncio.gather(*(one() for _ in range(n)))
