"""The shared store's parts that need no database: the usage spool (tenants/pgusage.py), the quota
book with a shared counter (tenants/quota.py), and what each does while the database is out of
reach (a port nothing listens on). The real PostgreSQL is in
tests/integration/test_store_postgres_ha.py."""

from __future__ import annotations

import orjson
import pytest

from passerelle.errors import Cause, QuotaExceeded
from passerelle.observe.record import RequestRecord
from passerelle.runtimes.supervisor import free_port
from passerelle.tenants.active import ActiveLock
from passerelle.tenants.pgusage import PgUsage, Spool
from passerelle.tenants.quota import Limit, Quota, QuotaBook, SharedDown


def nowhere() -> str:
    return f"postgresql://nobody@127.0.0.1:{free_port()}/none"


def finished(key_id: str = "k1", tokens: int = 5) -> RequestRecord:
    rec = RequestRecord("req_1", "chat", model="m")
    rec.key_id, rec.tenant, rec.cause = key_id, "t", Cause.OK
    rec.prompt_tokens, rec.completion_tokens = tokens, 1
    return rec


def test_the_spool_keeps_whole_lines_up_to_its_cap_and_empties_once_all_is_written(tmp_path):
    spool = Spool(tmp_path / "s.jsonl", max_bytes=40)
    assert spool.append(b'{"a": 1}\n') and spool.append(b'{"b": 22}\n')
    assert not spool.append(b'{"c": 3333333333333333}\n')  # past the cap: refused, nothing written
    lines, end = spool.read(0)
    assert lines == [b'{"a": 1}', b'{"b": 22}'] and end == 19
    assert spool.append(b'{"d": 4}\n')  # came while the first two were being written back
    assert not spool.truncate_if(end)  # so the file stays
    lines, end = spool.read(end)
    assert lines == [b'{"d": 4}'] and spool.truncate_if(end)
    assert spool.path.stat().st_size == 0 and spool.size == 0
    spool.close()


def test_a_line_cut_by_a_crash_is_not_read(tmp_path):
    (tmp_path / "s.jsonl").write_bytes(b'{"a": 1}\n{"half')
    spool = Spool(tmp_path / "s.jsonl", max_bytes=1 << 20)
    assert spool.read(0) == ([b'{"a": 1}'], 9)
    spool.close()


def test_a_second_gateway_on_the_same_spool_is_refused(tmp_path):
    first = Spool(tmp_path / "s.jsonl", max_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="its own \\[server\\] state_dir"):
        Spool(tmp_path / "s.jsonl", max_bytes=1 << 20)
    first.close()


async def test_usage_waits_in_the_spool_while_the_database_is_away_and_a_full_spool_counts_its_losses(tmp_path):
    usage = PgUsage(nowhere(), tmp_path / "usage-spool.jsonl", timeout_s=1, spool_max_bytes=400)
    for _ in range(3):
        usage.record(finished())
    assert usage.drain() is False and usage.up is False
    lines = (tmp_path / "usage-spool.jsonl").read_bytes().splitlines()
    rows = [orjson.loads(line) for line in lines]
    assert len(rows) == 3 and len({r[0] for r in rows}) == 3  # each row its own id
    assert rows[0][2:] == ["t", "k1", "standard", "m", "ok", 5, 1, "", ""]  # (no user, no session)
    assert usage.pending_bytes == sum(len(line) + 1 for line in lines)
    while usage.dropped == 0:
        usage.record(finished())
    assert usage.spool.size <= 400
    await usage.stop()
    usage.close()
    # a restart finds the spool and starts from its beginning (rows written twice are kept once)
    again = PgUsage(nowhere(), tmp_path / "usage-spool.jsonl", timeout_s=1)
    assert again.offset == 0 and again.pending_bytes == usage.spool.size
    again.close()


class Counter:
    """A shared counter in memory, as PostgreSQL's behaves (atomic per call), or away."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, float], list[float]] = {}
        self.down = False
        self.adjusted: list[tuple[str, dict[str, float], float, int]] = []
        self.alone: list[tuple[str, str]] = []

    async def reserve(self, key_id: str, limits: list[Limit], tokens: float):
        if self.down:
            raise SharedDown("away")
        rows = [self.rows.setdefault((key_id, lim.period, lim.start), [0.0, 0]) for lim in limits]
        for lim, row in zip(limits, rows, strict=True):
            if lim.requests is not None and row[1] + 1 > lim.requests:
                return None
            if lim.tokens is not None and (row[0] >= lim.tokens or row[0] + tokens > lim.tokens):
                return None
        for row in rows:
            row[0] += tokens
            row[1] += 1
        return {lim.period: (row[0], int(row[1])) for lim, row in zip(limits, rows, strict=True)}

    async def counts(self, key_id: str, limits: list[Limit]):
        if self.down:
            raise SharedDown("away")
        return {lim.period: tuple(self.rows.get((key_id, lim.period, lim.start), [0.0, 0])) for lim in limits}

    def adjust(self, key_id, starts, tokens, requests) -> None:
        self.adjusted.append((key_id, dict(starts), tokens, requests))

    def counting_alone(self, key_id: str, why: str) -> None:
        self.alone.append((key_id, why))


async def test_with_a_shared_counter_the_book_reserves_there_and_learns_its_counts():
    shared = Counter()
    book, other = QuotaBook(shared=shared), QuotaBook(shared=shared)  # two gateways
    quotas = (Quota(3, "day", "requests"),)
    charges = [await book.take("k", quotas, 10), await other.take("k", quotas, 10), await book.take("k", quotas, 10)]
    assert all(c is not None and c.shared for c in charges)
    with pytest.raises(QuotaExceeded, match="3 requests a day is used up"):
        await other.take("k", quotas, 10)  # the other gateway's admissions count here too
    assert other.usage("k", quotas)[0]["used"] == 3
    book.settle(charges[0], 4)  # the real count replaces the estimate, in the store too
    assert shared.adjusted[-1][2:] == (-6, 0)
    book.release(charges[1])
    assert shared.adjusted[-1][2:] == (-10, -1)


async def test_with_the_shared_counter_away_the_book_counts_alone_and_queues_what_it_admitted():
    shared = Counter()
    book = QuotaBook(shared=shared)
    quotas = (Quota(100, "day"),)
    shared.down = True
    charge = await book.take("k", quotas, 60)
    assert charge is not None and charge.shared and list(charge.starts) == ["day"]
    assert shared.adjusted == [("k", charge.starts, 60, 1)]  # added to the store's count once it is back
    assert shared.alone == [("k", "away")]  # said (log, passerelle_quota_counted_alone), never silent
    with pytest.raises(QuotaExceeded):
        await book.take("k", quotas, 60)  # counted here meanwhile


def test_an_unreachable_database_leaves_the_gateway_standing_by():
    lock = ActiveLock(nowhere(), poll_s=0.1, timeout_s=1)
    lock.step()
    assert lock.active is False and lock.describe()["reason"] == "database unreachable"


def test_an_active_that_loses_its_database_serves_on_for_offline_s_then_stands_by():
    lock = ActiveLock(nowhere(), poll_s=0.1, timeout_s=1, offline_s=30)
    lock.active = True  # (as if it had taken the lock before the database went away)
    lock.step()
    assert lock.active and lock.describe()["lock_unconfirmed_s"] >= 0
    lock.step()
    assert lock.active  # still within offline_s: no standby can take the lock meanwhile
    assert lock.unconfirmed_since is not None
    lock.unconfirmed_since -= 31
    lock.step()
    assert not lock.active and lock.describe()["reason"] == "database unreachable"


async def test_a_report_while_the_usage_store_is_away_is_a_503_with_its_cause():
    from passerelle.errors import StoreUnavailable
    from passerelle.tenants.pgusage import PgUsageReader

    reader = PgUsageReader(nowhere(), timeout_s=1)
    with pytest.raises(StoreUnavailable) as info:
        await reader.report(since=0.0, by=("key",))
    assert info.value.status == 503 and info.value.cause is Cause.STORE_UNAVAILABLE
    reader.close()
