"""Usage and quotas shared through a real PostgreSQL (``[store] url``: tenants/pgusage.py,
pgquota.py), a database that goes away and comes back, and an active-passive pair
(tenants/active.py). One PostgreSQL for the module, a database per test (see
test_store_postgres.py for how it is started)."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import psycopg
import pytest

from tests.conftest import wait_until
from tests.integration.test_store_postgres import MODEL, Postgres, chat, cli, shared


@pytest.fixture(scope="module")
def postgres():
    pg = Postgres()
    yield pg
    pg.close()


def rows(url: str, key_id: str) -> list[tuple[str, str]]:
    with psycopg.connect(url) as conn:
        return [(str(r[0]), r[1]) for r in conn.execute("SELECT id, cause FROM usage WHERE key_id = %s", (key_id,))]


def make_key(gw, *args: str) -> tuple[str, str]:
    made = cli("keys", "create", "--tenant", "team", *args, "--config", str(gw.extra["config"]))
    assert made.returncode == 0, made.stderr
    secret = made.stdout.strip()
    return secret, secret.split("_")[1]


async def burst(urls: list[str], secret: str, n: int) -> list[int]:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=2 * n)) as client:
        async def one(url: str) -> int:
            r = await client.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                                  json={"model": MODEL, "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "hi"}]})
            return r.status_code
        return await asyncio.gather(*(one(u) for u in urls for _ in range(n)))


def two_gateways(gateway, fake_backend, url: str, tmp_path, quota: str):
    """Two gateways sharing the database ``url``, and a key with ``quota`` that both know:
    (a, b, secret, key id)."""
    fake = fake_backend(ttft_ms=5, itl_ms=1, slots=64)
    a = gateway(shared(fake.url, url, slots=64))
    b = gateway(shared(fake.url, url, slots=64), env={"PASSERELLE_STATE": str(tmp_path / "state-b")})
    secret, key_id = make_key(a, "--quota", quota)
    for gw in (a, b):
        wait_until(lambda gw=gw: httpx.get(gw.url + "/v1/me", headers={"Authorization": f"Bearer {secret}"},
                                           timeout=10).status_code == 200, 10, what="the key on both gateways")
    return a, b, secret, key_id


def test_two_gateways_never_let_a_key_past_its_request_quota(postgres, gateway, fake_backend, tmp_path):
    url = postgres.new_database()
    a, b, secret, key_id = two_gateways(gateway, fake_backend, url, tmp_path, "60 requests/day")
    statuses = asyncio.run(burst([a.url, b.url], secret, 50))
    served = statuses.count(200)
    print(f"\n2 gateways x 50 concurrent requests, a quota of 60 requests a day: {served} served, "
          f"{statuses.count(429)} refused (429)")
    assert served == 60 and statuses.count(429) == 40, statuses
    # every row reaches the shared usage table, once
    wait_until(lambda: len(rows(url, key_id)) == 100, 15, what="the usage rows in PostgreSQL")
    causes = [c for _, c in rows(url, key_id)]
    assert causes.count("ok") == 60 and causes.count("quota_exceeded") == 40
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT requests FROM quota_use WHERE key_id = %s AND period = 'day'",
                            (key_id,)).fetchone() == (60,)
    report = cli("usage", "--by", "key", "--config", str(b.extra["config"]))  # from the shared table
    assert report.returncode == 0 and key_id in report.stdout and report.stderr.startswith("store: postgresql://")
    me = httpx.get(b.url + "/v1/me", headers={"Authorization": f"Bearer {secret}"}, timeout=10).json()
    assert me["quotas"][0]["unit"] == "requests" and me["quotas"][0]["used"] == 60


def metric(gw, name: str) -> float:
    for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_database_away_leaves_requests_served_and_usage_spooled_then_written_back_once(
        postgres, gateway, fake_backend):
    url = postgres.new_database()
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(shared(fake.url, url))
    secret, key_id = make_key(gw, "--quota", "1000 requests/day")
    # (until the gateway has read the new key, keys are not in use there and any request passes)
    wait_until(lambda: chat(gw, None) == 401, 10, what="keys in use")
    assert chat(gw, secret) == 200  # the key served
    assert httpx.get(gw.url + "/health", timeout=10).json()["store"]["up"] is True
    assert metric(gw, "passerelle_store_up") == 1
    postgres.stop()
    try:
        wait_until(lambda: "unreachable" in gw.log_text(), 20, what="the loss in the log")
        served = sum(chat(gw, secret) == 200 for _ in range(20))
        assert served == 20  # from the keys last read, quotas counted by this gateway alone
        health = httpx.get(gw.url + "/health", timeout=10)
        assert health.status_code == 200, health.text
        store = health.json()["store"]
        assert store["up"] is False and store["keys_from"] == "cache" and store["serving_keys"] is True
        wait_until(lambda: httpx.get(gw.url + "/health", timeout=10).json()["store"]["usage_up"] is False, 10,
                   what="the usage writer noticing")
        assert httpx.get(gw.url + "/health", timeout=10).json()["store"]["usage_spooled_bytes"] > 0
        assert metric(gw, "passerelle_store_up") == 0 and metric(gw, "passerelle_usage_spool_bytes") > 0
    finally:
        postgres.start()
    wait_until(lambda: len(rows(url, key_id)) >= 21, 30, what="the spooled rows written back")
    wait_until(lambda: httpx.get(gw.url + "/health", timeout=10).json()["store"]["up"] is True, 30,
               what="the store back in /health")
    got = rows(url, key_id)
    assert len(got) == 21 and len({i for i, _ in got}) == 21 and all(c == "ok" for _, c in got)  # each once
    assert metric(gw, "passerelle_store_up") == 1 and metric(gw, "passerelle_usage_spool_bytes") == 0
    # what the gateway admitted alone is in the shared counter once the database is back
    with psycopg.connect(url) as conn:
        wait_until(lambda: conn.execute("SELECT requests FROM quota_use WHERE key_id = %s AND period = 'day'",
                                        (key_id,)).fetchone() == (21,), 15, what="the quota counter caught up")
    assert "written back" in gw.log_text()


def test_past_offline_s_requests_are_refused_with_their_own_cause(postgres, gateway, fake_backend):
    url = postgres.new_database()
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(shared(fake.url, url, store="offline_s = 1"))
    secret, _ = make_key(gw)
    # (until the gateway has read the new key, keys are not in use there and any request passes)
    wait_until(lambda: chat(gw, None) == 401, 10, what="keys in use")
    assert chat(gw, secret) == 200  # the key served
    postgres.stop()
    try:
        wait_until(lambda: chat(gw, secret) == 503, 30, what="the cached keys no longer trusted")
        r = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"}, timeout=10,
                       json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503, (r.status_code, r.text)
        assert r.json()["error"]["code"] == "store_unavailable" and "offline_s" in r.json()["error"]["message"]
        health = httpx.get(gw.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "store_unavailable"
    finally:
        postgres.start()
    wait_until(lambda: chat(gw, secret) == 200, 30, what="served again once the database is back")
    assert any('"cause": "store_unavailable"' in line or "store_unavailable" in line
               for line in gw.log_text().splitlines())


PAIR = """
    active_passive = true
    lock_poll_s = 0.2
"""


def test_the_standby_takes_over_when_the_active_is_killed_and_no_accepted_usage_is_lost(
        postgres, gateway, fake_backend, tmp_path):
    url = postgres.new_database()
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    state_a = str(tmp_path / "state-a")
    a = gateway(shared(fake.url, url, store=PAIR), env={"PASSERELLE_STATE": state_a})
    b = gateway(shared(fake.url, url, store=PAIR), env={"PASSERELLE_STATE": str(tmp_path / "state-b")})
    secret, key_id = make_key(a)
    # (until the active has read the new key, keys are not in use there and any request passes)
    wait_until(lambda: chat(a, None) == 401, 10, what="keys in use on the active")
    assert chat(a, secret) == 200  # the key served by the active
    assert httpx.get(a.url + "/health", timeout=10).json()["active"]["active"] is True
    health = httpx.get(b.url + "/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "standby", health.text
    refused = httpx.post(b.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"}, timeout=10,
                         json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "standby"
    assert float(refused.headers["retry-after"]) > 0
    assert metric(b, "passerelle_active") == 0 and metric(a, "passerelle_active") == 1
    accepted = 1 + sum(chat(a, secret) == 200 for _ in range(15))

    a.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    a.proc.wait(10)
    wait_until(lambda: chat(b, secret) == 200, 30, interval=0.02, what="the standby serving")
    took = time.monotonic() - killed
    print(f"\nkill -9 of the active -> the standby serving in {took:.2f} s")
    assert took < 10  # (about lock_poll_s once PostgreSQL sees the session gone; generous for a loaded box)
    assert httpx.get(b.url + "/health", timeout=10).status_code == 200
    assert "holds the lock" in b.log_text()
    accepted += 1
    # the killed gateway's rows: written back already, or from its spool when it comes back (as the standby)
    a2 = gateway(shared(fake.url, url, store=PAIR), env={"PASSERELLE_STATE": state_a})
    assert httpx.get(a2.url + "/health", timeout=10).json()["status"] == "standby"
    wait_until(lambda: len(rows(url, key_id)) >= accepted, 20, what="every accepted request's row")
    got = rows(url, key_id)
    assert len(got) == accepted == sum(c == "ok" for _, c in got) and len({i for i, _ in got}) == accepted


def test_a_database_away_leaves_the_active_serving_and_one_active_when_it_returns(
        postgres, gateway, fake_backend, tmp_path):
    url = postgres.new_database()
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    a = gateway(shared(fake.url, url, store=PAIR), env={"PASSERELLE_STATE": str(tmp_path / "state-a")})
    b = gateway(shared(fake.url, url, store=PAIR), env={"PASSERELLE_STATE": str(tmp_path / "state-b")})
    secret, _ = make_key(a)
    # (until the active has read the new key, keys are not in use there and any request passes)
    wait_until(lambda: chat(a, None) == 401, 10, what="keys in use on the active")
    assert chat(a, secret) == 200  # the key served by the active

    def roles() -> list[int]:
        return [httpx.get(gw.url + "/health", timeout=10).status_code for gw in (a, b)]

    assert roles() == [200, 503]
    postgres.stop()
    try:
        wait_until(lambda: "lock_unconfirmed_s" in httpx.get(a.url + "/health", timeout=10).json()["active"], 20,
                   what="the active noticing")
        assert roles() == [200, 503] and chat(a, secret) == 200  # served on, from the keys last read
    finally:
        postgres.start()
    # one of them takes the lock again (whichever asks first), never both
    wait_until(lambda: sorted(roles()) == [200, 503] and all(
        "lock_unconfirmed_s" not in httpx.get(gw.url + "/health", timeout=10).json()["active"] for gw in (a, b)),
        30, what="one active again, confirmed")
    active = a if roles()[0] == 200 else b
    assert chat(active, secret) == 200
