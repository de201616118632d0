"""Quotas over a day, a week, a month: the calendar, the 429 with Retry-After to the window's end,
a new window starting from nothing, and a restart that forgets nothing (usage read back from the
store). A clock stands in for time; the usage store is a real SQLite file."""

from __future__ import annotations

from datetime import datetime

import pytest

from passerelle.errors import Cause, QuotaExceeded
from passerelle.observe.record import RequestRecord
from passerelle.tenants.db import connect
from passerelle.tenants.quota import Quota, QuotaBook, parse_quota, window
from passerelle.tenants.usage import UsageRecorder, report, used_since

DAY = (Quota(1000, "day"),)


def ts(*args: int) -> float:
    return datetime(*args).timestamp()  # local time, as the windows are


@pytest.mark.parametrize(("text", "tokens", "period"), [
    ("2M/day", 2_000_000, "day"), ("500k/week", 500_000, "week"), ("30000000/month", 30_000_000, "month"),
    ("1.5M / day", 1_500_000, "day"), ("2M tokens/day", 2_000_000, "day"),
])
def test_quota_forms(text, tokens, period):
    assert parse_quota(text) == Quota(tokens, period)


@pytest.mark.parametrize("text", ["2M", "2M/year", "-5/day", "0/day", "1.5/day", "two/day"])
def test_quota_forms_refused(text):
    with pytest.raises(ValueError):
        parse_quota(text)


def test_windows_follow_the_local_calendar():
    now = ts(2026, 12, 31, 23, 59)  # a Thursday
    assert window("day", now) == (ts(2026, 12, 31), ts(2027, 1, 1))
    assert window("week", now) == (ts(2026, 12, 28), ts(2027, 1, 4))  # Monday to Monday
    assert window("month", now) == (ts(2026, 12, 1), ts(2027, 1, 1))
    assert window("month", ts(2027, 2, 10)) == (ts(2027, 2, 1), ts(2027, 3, 1))


class Store:
    """The usage table behind the book, as the gateway has it."""

    def __init__(self, path) -> None:
        self.conn = connect(path)

    def add(self, when: float, key_id: str, tokens: int) -> None:
        self.conn.execute("INSERT INTO usage (ts, tenant, key_id, class, model, cause, prompt_tokens, "
                          "completion_tokens) VALUES (?, 't', ?, 'standard', 'm', 'ok', 0, ?)", (when, key_id, tokens))

    async def load(self, key_id: str, starts: list[float]) -> list[tuple[int, int]]:
        return used_since(self.conn, key_id, starts)


async def test_used_up_quota_is_429_until_the_end_of_the_day(tmp_path):
    now = [ts(2026, 12, 2, 22, 0)]
    book = QuotaBook(Store(tmp_path / "u.db").load, clock=lambda: now[0])
    await book.ensure("k", DAY)
    charge = book.reserve("k", DAY, 900)  # an estimate: prompt + max_tokens
    book.settle(charge, 400)  # the runtime counted 400
    assert book.usage("k", DAY)[0]["used"] == 400
    big = book.reserve("k", DAY, 600)  # exactly what is left
    with pytest.raises(QuotaExceeded) as info:
        book.reserve("k", DAY, 1)
    err = info.value
    assert err.status == 429 and err.code == "quota_exceeded" and err.cause.value == "quota_exceeded"
    assert err.retry_after == pytest.approx(2 * 3600)  # to midnight
    assert dict(err.headers())[b"retry-after"] == b"7200"
    assert "1k tokens a day" in err.message and "2026-12-03 00:00" in err.message
    book.settle(big, 100)  # it used less than it reserved: room again
    assert book.usage("k", DAY)[0]["remaining"] == 500
    with pytest.raises(QuotaExceeded) as info:  # asks more than is left: says how much is left
        book.reserve("k", DAY, 700)
    assert "500 are left" in info.value.message


async def test_a_new_day_starts_from_nothing_and_a_request_counts_where_it_ends(tmp_path):
    now = [ts(2026, 12, 2, 23, 59, 50)]
    book = QuotaBook(Store(tmp_path / "u.db").load, clock=lambda: now[0])
    quotas = (Quota(1000, "day"), Quota(5000, "week"))
    await book.ensure("k", quotas)
    running = book.reserve("k", quotas, 800)  # starts before midnight...
    with pytest.raises(QuotaExceeded):
        book.reserve("k", quotas, 300)
    now[0] = ts(2026, 12, 3, 0, 0, 20)
    book.settle(running, 700)  # ...ends after it: charged to the new day, as its usage row will be
    day, week = book.usage("k", quotas)
    assert day["used"] == 700 and day["resets_at"].startswith("2026-12-04T00:00:00")
    assert week["used"] == 700  # same week: the estimate (800) was replaced by the count
    book.reserve("k", quotas, 300)


async def test_a_restart_forgets_nothing(tmp_path):
    """A gateway writes usage rows; a new one (new book, same file) counts them against the quota."""
    db = tmp_path / "u.db"
    now = [ts(2026, 12, 2, 10, 0)]
    store = Store(db)
    recorder = UsageRecorder(connect(db), clock=lambda: now[0])
    book = QuotaBook(store.load, clock=lambda: now[0])
    await book.ensure("k", DAY)
    for tokens in (300, 350):
        charge = book.reserve("k", DAY, 400)
        rec = RequestRecord(id="r", endpoint="chat", model="m", key_id="k", tenant="t", prompt_tokens=50,
                            completion_tokens=tokens - 50)
        rec.finish(Cause.OK, 200)
        recorder.record(rec)
        book.settle(charge, tokens)
    await recorder.flush()
    # yesterday's and another key's rows do not count
    store.add(ts(2026, 12, 1, 23, 0), "k", 10_000)
    store.add(ts(2026, 12, 2, 9, 0), "other", 10_000)
    restarted = QuotaBook(store.load, clock=lambda: now[0])
    await restarted.ensure("k", DAY)
    assert restarted.usage("k", DAY)[0]["used"] == 650 == book.usage("k", DAY)[0]["used"]
    restarted.reserve("k", DAY, 350)
    with pytest.raises(QuotaExceeded):
        restarted.reserve("k", DAY, 1)
    rows = report(store.conn, by=("key",))
    assert {r["key"]: r["total_tokens"] for r in rows} == {"k": 10_650, "other": 10_000}


async def test_concurrent_first_requests_load_once(tmp_path):
    import asyncio

    calls = []
    store = Store(tmp_path / "u.db")

    async def load(key_id, starts):
        calls.append(key_id)
        await asyncio.sleep(0.01)
        return await store.load(key_id, starts)

    book = QuotaBook(load)
    await asyncio.gather(*(book.ensure("k", DAY) for _ in range(5)))
    assert calls == ["k"]


async def test_overlapping_flushes_write_every_row_once(tmp_path):
    import asyncio

    conn = connect(tmp_path / "u.db")
    recorder = UsageRecorder(connect(tmp_path / "u.db"))

    def record(n: int) -> None:
        for i in range(n):
            rec = RequestRecord(id=f"r{i}", endpoint="chat", model="m", key_id="k", completion_tokens=1)
            rec.finish(Cause.OK, 200)
            recorder.record(rec)

    for _ in range(20):
        record(500)
        timer = asyncio.create_task(recorder.flush())  # the timer's flush, writing in a thread...
        await asyncio.sleep(0)
        record(500)
        await recorder.flush()  # ...and a report's, while it may still be at it
        await timer
    assert conn.execute("SELECT COUNT(*), SUM(completion_tokens) FROM usage").fetchone() == (20_000, 20_000)


async def test_a_failed_load_is_not_remembered(tmp_path):
    attempts = []

    async def load(key_id, starts):
        attempts.append(key_id)
        if len(attempts) == 1:
            raise OSError("disk unavailable")
        return [(5, 1), (5, 1), (5, 1)]

    book = QuotaBook(load)
    with pytest.raises(OSError):
        await book.ensure("k", DAY)
    await book.ensure("k", DAY)
    assert attempts == ["k", "k"] and book.usage("k", DAY)[0]["used"] == 5


def test_request_quotas_are_read_written_and_counted(tmp_path):
    q = parse_quota("60 requests/day")
    assert (q.tokens, q.period, q.unit, str(q)) == (60, "day", "requests", "60req/day")
    assert parse_quota(str(q)) == q and parse_quota("1k REQ/week") == Quota(1000, "week", "requests")
    assert parse_quota("2M/day").unit == "tokens"


async def test_a_request_quota_counts_admitted_requests_and_a_released_one_does_not(tmp_path):
    store = Store(tmp_path / "u.db")
    now = ts(2026, 12, 2, 12, 0)
    store.add(now - 60, "k", 10)  # one request served earlier today: it counts after a restart
    store.conn.execute("INSERT INTO usage (ts, tenant, key_id, class, model, cause, prompt_tokens, "
                       "completion_tokens) VALUES (?, 't', 'k', 'standard', 'm', 'rate_limited', 0, 0)", (now - 30,))
    quotas = (Quota(3, "day", "requests"),)
    book = QuotaBook(store.load, clock=lambda: now)
    first = await book.take("k", quotas, 500)  # tokens do not matter to a request quota
    released = book.reserve("k", quotas, 500)
    book.release(released)  # refused after its reservation (its queue): not counted
    await book.take("k", quotas, 500)
    with pytest.raises(QuotaExceeded, match="quota of 3 requests a day is used up"):
        await book.take("k", quotas, 1)
    book.settle(first, 20)
    assert book.usage("k", quotas)[0]["used"] == 3 and book.usage("k", quotas)[0]["remaining"] == 0
