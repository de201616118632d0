"""The admin key cannot be guessed (issue 28, failure 5): on every route that takes it (the login
form, ``Authorization: Bearer`` or the login cookie on /admin/*, the Batch API) failed attempts are
throttled per address and in all *before* anything is compared, so while throttled even the right
key gets 429 with ``Retry-After``; each wrong attempt is logged (never the key) and counted. The
Batch API takes the admin key only from ``[admin] allow``. Weak admin keys are refused at start.

In process, against the fake runtime (tests/inprocess.py); time is the throttle's own clock.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
import tomllib
from typing import Any

import pytest

from passerelle.cli import main
from passerelle.config import AdminConfig, admin_key_weakness, load_config
from passerelle.errors import ConfigError, RateLimited
from passerelle.tenants.admin_key import GLOBAL_PER_MINUTE, PER_ADDRESS_PER_MINUTE, AdminKeyCheck
from passerelle.tenants.attempts import AttemptThrottle
from passerelle.tenants.keys import KeyStore
from tests.inprocess import InProcessGateway, fake_runtime, gateway

KEY = "5f0c9e2ab7d34816c1e8a0f3"  # strong enough for [admin] key
FORM = {"content-type": "application/x-www-form-urlencoded"}


def frozen(gw: InProcessGateway) -> list[float]:
    """The admin key throttle's clock, moved by the test (starts at now)."""
    now = [time.monotonic()]
    gw.app.admin_guard.key_check.throttle.clock = lambda: now[0]
    return now


def refused(gw: InProcessGateway, route: str, reason: str) -> float:
    value = gw.app.metrics.registry.get_sample_value("passerelle_admin_key_failures_total",
                                                     {"route": route, "reason": reason})
    return value or 0.0


async def login(gw: InProcessGateway, key: str, client: str = "127.0.0.1") -> Any:
    return await gw.request("POST", "/admin/login", f"key={key}".encode(), headers=FORM, client=client)


async def test_a_login_guesser_is_refused_before_any_comparison_even_with_the_right_key(caplog):
    caplog.set_level(logging.WARNING, "passerelle.admin")
    async with fake_runtime() as fake, gateway(fake.backend_config(), admin=AdminConfig(key=KEY)) as gw:
        now = frozen(gw)
        # the report's guesser: 351 wrong guesses at full speed, then the right key
        statuses = [(await login(gw, f"guess-{i:04d}")).status for i in range(351)]
        assert statuses.count(401) == PER_ADDRESS_PER_MINUTE and statuses.count(429) == 351 - PER_ADDRESS_PER_MINUTE
        right = await login(gw, KEY)
        assert right.status == 429 and b"set-cookie" not in right.headers  # throttled: not compared at all
        assert right.headers[b"content-type"].startswith(b"text/html") and b"<form" in right.body
        wait = int(right.headers[b"retry-after"])
        assert 1 <= wait <= 60 / PER_ADDRESS_PER_MINUTE + 1
        assert gw.app.admin_guard.key_check.throttle.failures == PER_ADDRESS_PER_MINUTE  # only these were compared
        assert refused(gw, "login", "wrong_key") == PER_ADDRESS_PER_MINUTE
        assert refused(gw, "login", "throttled") == 351 - PER_ADDRESS_PER_MINUTE + 1
        wrong_lines = [r.getMessage() for r in caplog.records if "wrong admin key" in r.getMessage()]
        assert len(wrong_lines) == PER_ADDRESS_PER_MINUTE and "127.0.0.1" in wrong_lines[0]
        assert not any("guess-" in r.getMessage() or KEY in r.getMessage() for r in caplog.records)
        # a guesser that keeps going for ten minutes, a guess every 0.25 s: what it may really try
        compared_before, span_s = gw.app.admin_guard.key_check.throttle.failures, 600.0
        for i in range(int(span_s / 0.25)):
            now[0] += 0.25
            await login(gw, f"more-{i}")
        rate = (gw.app.admin_guard.key_check.throttle.failures - compared_before) / span_s
        assert rate <= PER_ADDRESS_PER_MINUTE / 60 * 1.01  # 1 guess every 6 s, not 5,000 a second
        # once the throttle's wait is over, the right key opens the dashboard
        now[0] += 60.0
        ok = await login(gw, KEY)
        assert ok.status == 303 and b"passerelle_admin=" in ok.headers[b"set-cookie"]


async def test_a_login_form_with_too_many_fields_is_a_400_not_a_gateway_error():
    # parse_qs's ValueError (more than 8 fields) left the app: uvicorn's bare 500.
    async with fake_runtime() as fake, gateway(fake.backend_config(), admin=AdminConfig(key=KEY)) as gw:
        r = await gw.request("POST", "/admin/login", b"key=a&" * 100, headers=FORM)
        assert r.status == 400 and r.json()["error"]["code"] == "invalid_request"
        assert gw.app.admin_guard.key_check.throttle.failures == 0  # (nothing was compared)
        assert (await login(gw, KEY)).status == 303


async def test_wrong_bearer_keys_and_cookies_on_admin_routes_are_throttled():
    admin = AdminConfig(key=KEY, allow=("127.0.0.0/8", "10.0.0.0/8"))
    async with fake_runtime() as fake, gateway(fake.backend_config(), admin=admin) as gw:
        now = frozen(gw)
        for _ in range(PER_ADDRESS_PER_MINUTE):
            assert (await gw.get("/admin/stats", headers={"authorization": "Bearer nope"})).status == 401
        for path in ("/admin/stats", "/metrics", "/admin/keys", "/admin/runtimes"):
            r = await gw.get(path, headers={"authorization": f"Bearer {KEY}"})  # the right key, throttled
            assert r.status == 429 and int(r.headers[b"retry-after"]) >= 1, path
            assert set(r.json()["error"]) == {"message", "type", "code"} and r.json()["error"]["code"] == \
                "rate_limit_exceeded"
        cookie = (await gw.get("/admin/stats", headers={"cookie": "passerelle_admin=forged"}))
        assert cookie.status == 429
        ui = await gw.get("/ui", headers={"authorization": f"Bearer {KEY}"})  # a browser: the form, 429
        assert ui.status == 429 and ui.headers[b"content-type"].startswith(b"text/html")
        assert refused(gw, "admin", "wrong_key") == PER_ADDRESS_PER_MINUTE
        # another address is not held by this one's failures; no key at all is no attempt
        assert (await gw.get("/admin/stats", headers={"authorization": f"Bearer {KEY}"}, client="10.1.1.1")).status \
            == 200
        assert (await gw.get("/admin/stats", client="10.1.1.2")).status == 401
        # many addresses together get the global budget, no more
        budget = GLOBAL_PER_MINUTE - PER_ADDRESS_PER_MINUTE
        spray = [(await gw.get("/admin/stats", headers={"authorization": "Bearer nope"},
                               client=f"10.2.{i // 250}.{i % 250}")).status for i in range(300)]
        assert spray.count(401) == budget and spray.count(429) == 300 - budget
        late = await gw.get("/admin/stats", headers={"authorization": f"Bearer {KEY}"}, client="10.3.0.1")
        assert late.status == 429 and "all addresses" in late.json()["error"]["message"]
        now[0] += 60.0
        assert (await gw.get("/admin/stats", headers={"authorization": f"Bearer {KEY}"})).status == 200
        stats = (await gw.get("/admin/stats", headers={"authorization": f"Bearer {KEY}"})).json()
        assert stats["admin_key_throttle"]["failures_total"] == PER_ADDRESS_PER_MINUTE + budget


async def test_the_batch_api_takes_the_admin_key_only_from_admin_allow_and_throttles_it(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    _, secret = store.create("team-a")
    store.close()
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db",
                                               admin=AdminConfig(key=KEY)) as gw:
        now = frozen(gw)
        assert (await gw.get("/v1/files", headers={"authorization": f"Bearer {secret}"})).status == 200
        # from an address outside [admin] allow the admin key is an unknown key: 401, never compared
        outside = await gw.get("/v1/files", headers={"authorization": f"Bearer {KEY}"}, client="192.0.2.9")
        assert outside.status == 401 and outside.json()["error"]["code"] == "invalid_api_key"
        assert gw.app.admin_guard.key_check.throttle.failures == 0 and refused(gw, "batches", "throttled") == 0
        assert (await gw.get("/v1/batches", headers={"authorization": f"Bearer {KEY}"}, client="192.0.2.9")).status \
            == 401
        # from loopback it is the admin's, and guesses are throttled before they are compared
        assert (await gw.get("/v1/files", headers={"authorization": f"Bearer {KEY}"})).status == 200
        for i in range(PER_ADDRESS_PER_MINUTE):
            assert (await gw.get("/v1/files", headers={"authorization": f"Bearer guess-{i}"})).status == 401
        right = await gw.get("/v1/files", headers={"authorization": f"Bearer {KEY}"})
        assert right.status == 429 and int(right.headers[b"retry-after"]) >= 1
        assert right.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused(gw, "batches", "wrong_key") == PER_ADDRESS_PER_MINUTE
        # an API key of ours is never taken for an admin attempt, throttled or not
        assert (await gw.get("/v1/files", headers={"authorization": f"Bearer {secret}"})).status == 200
        now[0] += 60.0
        assert (await gw.get("/v1/batches", headers={"authorization": f"Bearer {KEY}"})).status == 200


async def test_a_placeholder_key_on_the_batch_api_without_keys_in_use_is_no_admin_guess(tmp_path):
    # No API key yet, an admin key for the dashboard: an SDK on this host must send some key, and
    # twenty Batch API calls with it neither get 429 nor lock the admin out of /admin.
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db",
                                               admin=AdminConfig(key=KEY)) as gw:
        frozen(gw)
        placeholder = {"authorization": "Bearer sk-no-key-required"}
        assert [(await gw.get("/v1/files", headers=placeholder)).status for _ in range(20)] == [200] * 20
        assert (await gw.get("/v1/batches", headers=placeholder)).status == 200
        assert gw.app.admin_guard.key_check.throttle.failures == 0 and refused(gw, "batches", "throttled") == 0
        assert (await gw.get("/admin/stats", headers={"authorization": f"Bearer {KEY}"})).status == 200


async def test_a_dashboard_left_open_after_a_key_change_does_not_lock_its_admin_out():
    # The dashboard polls /admin/stats every second with its login cookie. After the key changed,
    # each poll counted as a wrong attempt: ten seconds later the admin's own address was
    # throttled, and each token that came back went to the next poll, not to the login.
    async with fake_runtime() as fake, gateway(fake.backend_config(), admin=AdminConfig(key=KEY)) as gw:
        frozen(gw)
        old = (await login(gw, KEY)).headers[b"set-cookie"].split(b";")[0].decode()
        assert (await gw.get("/admin/stats", headers={"cookie": old})).status == 200
        new_key = "9c1e5b2d8046ae19c3f77f3a"
        gw.app.service.configure(dataclasses.replace(gw.app.cfg, admin=AdminConfig(key=new_key)))
        polls = [(await gw.get("/admin/stats", headers={"cookie": old})).status for _ in range(60)]
        assert polls == [401] * 60
        assert gw.app.admin_guard.key_check.throttle.failures == 0 and refused(gw, "admin", "former_key") == 60
        assert (await login(gw, new_key)).status == 303
        # a cookie of no key of this gateway is still a guess (an HMAC computed for a guessed key)
        forged = [(await gw.get("/admin/stats", headers={"cookie": "passerelle_admin=" + "ab" * 32})).status
                  for _ in range(PER_ADDRESS_PER_MINUTE + 1)]
        assert forged == [401] * PER_ADDRESS_PER_MINUTE + [429]


def test_a_spray_of_addresses_does_not_grow_the_throttle_past_its_bound():
    now = [0.0]
    check = AdminKeyCheck(AdminConfig(key=KEY, allow=("0.0.0.0/0", "::/0")), clock=lambda: now[0])
    scope: dict[str, Any] = {"method": "GET", "path": "/admin/stats"}
    # 100,000 addresses, a thousand a second: the global bucket compares 1 a second and the rest are
    # refused without leaving anything behind (an entry is made only by a compared failure)
    wrong = 0
    for i in range(100_000):
        scope["client"] = (f"{10 + (i >> 16)}.{(i >> 8) & 255}.{i & 255}.1", 1)
        try:
            check.verify(scope, "admin", key=b"x")
            wrong += 1
        except RateLimited:
            pass
        if i % 1000 == 0:
            now[0] += 1.0
    assert wrong <= GLOBAL_PER_MINUTE + 100 * GLOBAL_PER_MINUTE / 60 + 1
    assert len(check.throttle) == wrong <= check.throttle.max_addresses
    # entries are made only by compared failures: force more than the cap through and it holds
    small = AttemptThrottle(per_address_per_minute=10, global_per_minute=10**9, max_addresses=1000,
                            clock=lambda: now[0])
    for i in range(20_000):
        small.check(f"2001:db8:{i:x}::1")
        small.failed(f"2001:db8:{i:x}::1")
    assert len(small) == 1000


def test_an_ipv6_host_counts_as_its_64_and_buckets_refill():
    now = [0.0]
    t = AttemptThrottle(per_address_per_minute=3, global_per_minute=100, clock=lambda: now[0])
    for suffix in ("1", "2", "ffff:1"):
        t.check(f"2001:db8:0:1::{suffix}")
        t.failed(f"2001:db8:0:1::{suffix}")
    with pytest.raises(RateLimited) as err:
        t.check("2001:db8:0:1::abcd")  # the same /64
    assert 19 <= err.value.retry_after <= 20  # one failure back every 20 s
    t.check("2001:db8:0:2::1")  # another /64
    now[0] += 20.0
    t.check("2001:db8:0:1::abcd")


@pytest.mark.parametrize("weak", ["change-me-admin", "s3cret", "adm1n", "aaaaaaaaaaaaaaaaaaaaaaaa",
                                  "abababababababababababab", "abcdefghijklmnopqrstuvwx", "0123456789abcdef",
                                  "please-change-me-now-2026", "your-admin-key-goes-here",
                                  "psk_0123456789ab_c2a8f05e91d74b36"])
def test_weak_admin_keys_are_refused_at_start_naming_file_and_key(tmp_path, weak, monkeypatch, capsys):
    path = tmp_path / "gw.toml"
    path.write_text(f'[server]\nport = 8181\n\n[admin]\nkey = "{weak}"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    text = str(err.value)
    assert text.startswith(f"{path}:5: key 'admin.key': the admin key ") and "openssl rand -hex 24" in text
    assert weak not in text  # the key itself is never echoed
    with pytest.raises(ConfigError, match=r"^environment: key 'PASSERELLE_ADMIN_KEY': the admin key"):
        load_config(None, env={"PASSERELLE_ADMIN_KEY": weak})
    monkeypatch.delenv("PASSERELLE_ADMIN_KEY", raising=False)
    assert main(["serve", "--config", str(path)]) == 2  # before anything starts
    assert "admin.key" in capsys.readouterr().err


def test_generated_admin_keys_pass():
    for key in (secrets.token_hex(24), secrets.token_hex(8), secrets.token_urlsafe(16), KEY, "",
                "correct horse battery staple"):
        assert admin_key_weakness(key) is None, key
    refusals = sum(admin_key_weakness(secrets.token_hex(8)) is not None for _ in range(20_000))
    assert refusals <= 2  # the shortest accepted random key is almost never taken for a weak one


def test_the_example_configuration_has_no_admin_key_to_copy():
    from pathlib import Path

    example = (Path(__file__).resolve().parents[2] / "passerelle.example.toml").read_text()
    assert "change-me" not in example and "openssl rand -hex 24" in example
    assert tomllib.loads(example)["admin"]["key"] == ""
