"""The usage table does not grow without end: rows of refused requests (no tokens) are deleted
after ``[auth] usage_refused_retention_days``, and past ``[auth] usage_max_rows`` the oldest rows
go, refused ones first; pruned when the recorder starts and then periodically."""

from __future__ import annotations

import pytest

from passerelle.config import load_config
from passerelle.errors import ConfigError
from passerelle.tenants.db import connect
from passerelle.tenants.usage import UsageRecorder, tokens_since
from tests.waiting import until

DAY = 86400.0
NOW = 1_900_000_000.0


def rows(conn) -> list[tuple]:
    return conn.execute("SELECT ts, cause, prompt_tokens, completion_tokens FROM usage ORDER BY ts").fetchall()


def fill(recorder: UsageRecorder, spec: list[tuple[float, str, int, int]]) -> None:
    recorder._write([(ts, "team", "k1", "standard", "m", cause, p, c, "", "") for ts, cause, p, c in spec])


async def test_rows_of_refused_requests_are_deleted_after_their_retention(tmp_path):
    conn = connect(tmp_path / "u.db")
    recorder = UsageRecorder(conn, clock=lambda: NOW, refused_retention_s=7 * DAY, max_rows=0)
    fill(recorder, [
        (NOW - 30 * DAY, "unauthorized", 0, 0),    # refused, old: goes
        (NOW - 8 * DAY, "rate_limited", 0, 0),      # refused, old: goes
        (NOW - 30 * DAY, "ok", 10, 5),              # billed: stays (quotas and reports count it)
        (NOW - 30 * DAY, "client_disconnect", 10, 2),  # not refused: it used the runtime
        (NOW - 30 * DAY, "ok", 0, 0),               # served (a tokenize): stays
        (NOW - 1 * DAY, "queue_full", 0, 0),        # refused, recent: stays
    ])
    assert await recorder.prune() == 2
    assert [r[1] for r in rows(conn)] == ["ok", "client_disconnect", "ok", "queue_full"]
    assert tokens_since(conn, "k1", [0.0]) == [27]  # no billed token lost


async def test_past_the_cap_the_oldest_rows_go_refused_ones_first(tmp_path):
    conn = connect(tmp_path / "u.db")
    recorder = UsageRecorder(conn, clock=lambda: NOW, refused_retention_s=0, max_rows=5)
    fill(recorder, [(NOW - 10 + i, "ok", 1, 1) for i in range(4)]
         + [(NOW - 5 + i, "unauthorized", 0, 0) for i in range(3)])
    assert await recorder.prune() == 2
    left = rows(conn)  # the two oldest refused rows went, though newer than every billed one
    assert [r[1] for r in left] == ["ok"] * 4 + ["unauthorized"] and left[-1][0] == NOW - 3
    fill(recorder, [(NOW + i, "ok", 1, 1) for i in range(3)])
    assert await recorder.prune() == 3  # the last refused row, then the two oldest
    left = rows(conn)
    assert len(left) == 5 and left[0][0] == NOW - 8 and all(r[1] == "ok" for r in left)


async def test_the_recorder_prunes_when_it_starts_and_then_periodically(tmp_path):
    conn = connect(tmp_path / "u.db")
    now = [NOW]
    recorder = UsageRecorder(conn, clock=lambda: now[0], flush_s=0.01, refused_retention_s=DAY, max_rows=0,
                             prune_every_s=0.05)
    fill(recorder, [(NOW - 2 * DAY, "unauthorized", 0, 0), (NOW - 0.5 * DAY, "unauthorized", 0, 0)])
    recorder.start()
    try:
        await until(lambda: len(rows(conn)) == 1, 10, "the row past its retention pruned")
        now[0] += DAY  # a day later the second row's retention is over too
        await until(lambda: not rows(conn), 10, "the second row pruned a day later")
    finally:
        await recorder.stop()


@pytest.mark.parametrize(("text", "key"), [
    ("[auth]\nusage_refused_retention_days = -1\n", "auth.usage_refused_retention_days"),
    ("[auth]\nusage_max_rows = -5\n", "auth.usage_max_rows"),
])
def test_retention_keys_are_validated(tmp_path, text, key):
    (tmp_path / "p.toml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "p.toml", env={})
    assert key in str(err.value) and ":2" in str(err.value)


def test_retention_defaults():
    auth = load_config(env={}).auth
    assert auth.usage_refused_retention_days == 7 and auth.usage_max_rows == 5_000_000
