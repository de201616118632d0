"""People behind one key: a key that trusts a front-end's forwarded user (Open WebUI's headers)
makes each person a tenant of their own (fair share, per-person limits, usage, /v1/me/usage); a key
without the mark, or no key, cannot set its tenant by header. Bounded however many names come.

In process, against the fake runtime (tests/inprocess.py).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest

from passerelle.cli import main
from passerelle.config import AdminConfig, ClassConfig, load_config
from passerelle.errors import Cause, ConfigError
from passerelle.observe.accesslog import record_fields
from passerelle.server import keys_api
from passerelle.tenants.db import SCHEMA_VERSION
from passerelle.tenants.keys import ApiKey, KeyStore
from passerelle.tenants.limits import KeyLimiter
from passerelle.tenants.names import forwarded_user
from tests.inprocess import fake_runtime, gateway

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
OPEN_WEBUI = {"x-openwebui-user-id": "5b9c0e4e-ada", "x-openwebui-user-name": "Ada",
              "x-openwebui-user-email": "ada@example.org", "x-openwebui-user-role": "user",
              "x-openwebui-chat-id": "chat-77"}
STANDARD = ClassConfig("standard", 1, max_queue=512, max_queue_wait_s=120.0)


def bearer(secret: str, **more: str) -> dict[str, str]:
    return {"authorization": f"Bearer {secret}", **more}


async def test_a_trusted_front_ends_user_becomes_a_tenant_within_its_key(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    key, secret = store.create("webui", trust_forwarded_user=True)
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        for who in ("5b9c0e4e-ada", "5b9c0e4e-ada", "c0ffee-bob"):
            resp = await gw.post("/v1/chat/completions", CHAT, headers=bearer(secret, **{**OPEN_WEBUI,
                                                                                      "x-openwebui-user-id": who}))
            assert resp.status == 200
        ada = gw.records[0]
        assert (ada.tenant, ada.user, ada.key_id) == ("webui/5b9c0e4e-ada", "5b9c0e4e-ada", key.id)
        assert ada.session and ada.session != "chat-77" and len(ada.session) == 24  # the chat id, hashed
        fields = record_fields(ada)
        assert fields["user"] == "5b9c0e4e-ada" and fields["session"] == ada.session
        assert "chat-77" not in str(fields) and "ada@example.org" not in str(fields)
        assert gw.records[2].tenant == "webui/c0ffee-bob"
        assert {"webui/5b9c0e4e-ada", "webui/c0ffee-bob"} <= set(gw.app.scheduler.tenants)
        usage = (await gw.get("/v1/me/usage", headers=bearer(secret))).json()
        users = {u["user"]: u for u in usage["users"]}
        assert users["5b9c0e4e-ada"]["requests"] == 2 and users["c0ffee-bob"]["requests"] == 1
        assert users["c0ffee-bob"]["tenant"] == "webui/c0ffee-bob"
        me = (await gw.get("/v1/me", headers=bearer(secret))).json()
        assert me["trust_forwarded_user"] is True and me["limits"]["per"] == "user"


async def test_a_key_without_the_mark_and_no_key_at_all_cannot_set_their_tenant_by_header(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    _, secret = store.create("plain")
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        spoof = {**OPEN_WEBUI, "x-openwebui-user-id": "admin"}
        assert (await gw.post("/v1/chat/completions", CHAT, headers=bearer(secret, **spoof))).status == 200
        rec = gw.records[-1]
        assert (rec.tenant, rec.user, rec.session) == ("plain", "", "")  # the chat header is not taken either
        usage = (await gw.get("/v1/me/usage", headers=bearer(secret))).json()
        assert "users" not in usage
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:  # no keys
        assert (await gw.post("/v1/chat/completions", CHAT, headers=spoof)).status == 200
        assert (gw.records[-1].tenant, gw.records[-1].user) == ("anonymous", "")


async def test_each_person_behind_a_trusting_key_has_the_keys_rpm(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    _, secret = store.create("webui", rpm=2, trust_forwarded_user=True)
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        def as_(who: str) -> dict[str, str]:
            return bearer(secret, **{"x-openwebui-user-id": who})

        assert [(await gw.post("/v1/chat/completions", CHAT, headers=as_("ada"))).status for _ in range(3)] == [
            200, 200, 429]
        assert gw.records[-1].cause is Cause.RATE_LIMITED
        assert (await gw.post("/v1/chat/completions", CHAT, headers=as_("bob"))).status == 200


async def test_hostile_forwarded_names_are_bounded_and_cannot_forge_a_tenant(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    _, secret = store.create("webui", trust_forwarded_user=True)
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        long = "x" * 10_000
        assert (await gw.post("/v1/chat/completions", CHAT, headers=bearer(
            secret, **{"x-openwebui-user-id": "../other-team/" + long}))).status == 200
        rec = gw.records[-1]
        assert rec.tenant.count("/") == 1 and rec.tenant.startswith("webui/.._other-team_x")
        assert len(rec.user) == gw.app.cfg.auth.max_user_chars
    assert forwarded_user("a\x1b[2Jb\nc") == "a_[2Jb_c" and forwarded_user("   ") == ""


async def test_a_million_names_do_not_grow_the_per_person_windows_without_bound():
    key = ApiKey("k", "webui", rpm=100, trust_forwarded_user=True)
    limiter = KeyLimiter()
    limiter.max_entries = 1000
    held = limiter.admit(key, 10, "busy")
    await limiter.wait_turn(held, key, STANDARD)  # holds a slot: never forgotten
    for i in range(20_000):
        grant = limiter.admit(key, 10, f"user-{i}")
        await limiter.wait_turn(grant, key, STANDARD)
        limiter.finish(grant, 10)
    assert len(limiter._usage) == 1000 and "k/busy" in limiter._usage
    assert limiter.state("k") == {"running": 1, "queued": 0}  # the key's people, summed
    limiter.finish(held, 10)
    assert limiter.state("k") == {"running": 0, "queued": 0}


async def test_the_scheduler_forgets_idle_people_past_max_tenants(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    _, secret = store.create("webui", trust_forwarded_user=True)
    async with fake_runtime(ttft_ms=0, itl_ms=0) as fake, gateway(fake.backend_config(),
                                                                  db=tmp_path / "k.db") as gw:
        gw.app.scheduler.max_tenants = 100
        await asyncio.gather(*(gw.post("/v1/chat/completions", CHAT, headers=bearer(
            secret, **{"x-openwebui-user-id": f"u{i}"})) for i in range(150)))
        assert len(gw.app.gateway.sessions) == 0  # (nothing in flight: no session kept)
        # the next person's arrival forgets the least recently seen idle ones
        await gw.post("/v1/chat/completions", CHAT, headers=bearer(secret, **{"x-openwebui-user-id": "late"}))
        assert len(gw.app.scheduler.tenants) == 100 and "webui/late" in gw.app.scheduler.tenants


def test_the_mark_is_set_from_the_command_line_and_kept_in_the_store(tmp_path, capsys):
    db = str(tmp_path / "k.db")
    assert main(["keys", "create", "--db", db, "--tenant", "webui", "--trust-forwarded-user"]) == 0
    assert main(["keys", "create", "--db", db, "--tenant", "cli"]) == 0
    store = KeyStore(db)
    marks = {k.tenant: k.trust_forwarded_user for k in store.list()}
    assert marks == {"webui": True, "cli": False}
    webui = next(k for k in store.list() if k.tenant == "webui")
    assert main(["keys", "update", "--db", db, webui.id, "--no-trust-forwarded-user"]) == 0
    assert store.get(webui.id).trust_forwarded_user is False
    assert store.audit_log(limit=1)[0]["detail"] == {"trust_forwarded_user": {"from": True, "to": False}}
    store.close()


def test_a_version_2_store_gains_the_mark_and_the_usage_columns(tmp_path):
    path = tmp_path / "v2.db"
    store = KeyStore(path)
    key, _ = store.create("team")
    store.conn.execute("INSERT INTO usage (ts, tenant, key_id, class, model, cause, prompt_tokens, "
                       "completion_tokens) VALUES (1, 'team', ?, 'standard', 'm', 'ok', 1, 2)", (key.id,))
    store.close()
    old = sqlite3.connect(path)  # back to what version 2 wrote
    old.executescript("DROP INDEX usage_key_user; ALTER TABLE usage DROP COLUMN user; "
                      "ALTER TABLE usage DROP COLUMN session; ALTER TABLE api_keys DROP COLUMN trust_forwarded_user; "
                      "PRAGMA user_version = 2;")
    old.close()
    store = KeyStore(path)
    try:
        assert store.get(key.id).trust_forwarded_user is False
        assert store.conn.execute("SELECT tenant, user, session FROM usage").fetchall() == [("team", "", "")]
        assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    finally:
        store.close()


def test_the_new_settings_are_read_and_checked_naming_file_key_and_line(tmp_path):
    good = tmp_path / "g.toml"
    good.write_text('[auth]\nforwarded_user_header = "x-openwebui-user-email"\n[scheduler]\ntenant_queue_share = 0.25\n'
                    '[routing]\nsession_headers = ["x-my-session"]\nmax_session_in_flight = 0\n')
    cfg = load_config(good, env={})
    assert (cfg.auth.forwarded_user_header, cfg.scheduler.tenant_queue_share) == ("x-openwebui-user-email", 0.25)
    assert cfg.routing.session_headers == ("x-my-session",) and cfg.routing.max_session_in_flight == 0
    for text, key, line in (("[scheduler]\ntenant_queue_share = 0\n", "scheduler.tenant_queue_share", 2),
                            ("[scheduler]\n\ntenant_queue_share = 1.5\n", "scheduler.tenant_queue_share", 3),
                            ("[routing]\nmax_session_in_flight = -1\n", "routing.max_session_in_flight", 2)):
        bad = tmp_path / "b.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=rf"b\.toml:{line}: key '{key}'"):
            load_config(bad, env={})


def test_a_keys_tenant_may_not_be_a_front_end_persons_name(tmp_path, capsys):
    db = str(tmp_path / "k.db")
    assert main(["keys", "create", "--db", db, "--tenant", "webui/alice"]) == 2
    assert "'tenant' must not contain '/'" in capsys.readouterr().err
    assert main(["keys", "create", "--db", db, "--tenant", "webui", "--trust-forwarded-user"]) == 0
    store = KeyStore(db)
    (webui,) = store.list()
    assert main(["keys", "update", "--db", db, webui.id, "--tenant", "other/alice"]) == 2
    assert [k.tenant for k in store.list()] == ["webui"]
    store.close()


async def test_the_key_api_refuses_a_tenant_with_a_slash(tmp_path):
    admin = AdminConfig(key="0e7b3c91f2a54d68b9c0e1f7")
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db", admin=admin) as gw:
        auth = bearer(admin.key)
        bad = await gw.post("/admin/keys", {"tenant": "webui/alice"}, headers=auth)
        assert bad.status == 400 and "'tenant' must not contain '/'" in bad.json()["error"]["message"]
        made = await gw.post("/admin/keys", {"tenant": "webui", "trust_forwarded_user": True}, headers=auth)
        assert made.status == 201
        patched = await gw.request("PATCH", f"/admin/keys/{made.json()['id']}", b'{"tenant": "webui/bob"}',
                                   headers=auth)
        assert patched.status == 400 and "'tenant' must not contain '/'" in patched.json()["error"]["message"]


async def test_me_usage_pages_a_front_ends_people_with_bounded_answers(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    key, secret = store.create("webui", trust_forwarded_user=True)
    people, now = 5_000, time.time()
    with store.conn:  # one request each, and a few without a person (the front-end's own calls)
        store.conn.executemany(
            "INSERT INTO usage (ts, tenant, key_id, class, model, cause, prompt_tokens, completion_tokens, user, "
            "session) VALUES (?, ?, ?, 'standard', 'fake-model', 'ok', 3, 2, ?, '')",
            [(now - 60, f"webui/p{i:05d}" if i < people else "webui", key.id, f"p{i:05d}" if i < people else "")
             for i in range(people + 5)])
    store.close()
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        first = await gw.get("/v1/me/usage?since=1h", headers=bearer(secret))
        assert first.status == 200
        body = first.json()
        assert len(body["users"]) == 100 and body["has_more"] is True and body["last_user"] == "p00099"
        assert len(first.body) < 32 * 1024  # (the unpaged answer for 200,000 people was 36 MB)
        assert body["total"]["requests"] == people + 5 and body["total"]["total_tokens"] == 5 * (people + 5)
        assert body["users"][0] == {**body["users"][0], "user": "p00000", "tenant": "webui/p00000", "requests": 1}
        seen, after, pages = [], "", 0
        while True:
            page = (await gw.get(f"/v1/me/usage?since=1h&limit=1000&after={after}", headers=bearer(secret))).json()
            assert len(page["users"]) <= 1000
            seen += [u["user"] for u in page["users"]]
            pages += 1
            if not page["has_more"]:
                break
            after = page["last_user"]
        assert seen == [f"p{i:05d}" for i in range(people)] and pages == people // 1000
        for bad in ("limit=0", "limit=1001", "limit=ten", "after=" + "x" * 600):
            refused = await gw.get(f"/v1/me/usage?{bad}", headers=bearer(secret))
            message = refused.json()["error"]["message"]
            assert refused.status == 400 and f"'{bad.split('=')[0]}'" in message, bad


async def test_me_usage_lists_the_largest_models_and_totals_them_all(tmp_path, monkeypatch):
    monkeypatch.setattr(keys_api, "MAX_MODELS", 2)  # (1000 in use: model names are the clients' choice)
    store = KeyStore(tmp_path / "k.db")
    key, secret = store.create("team")
    with store.conn:
        store.conn.executemany(
            "INSERT INTO usage (ts, tenant, key_id, class, model, cause, prompt_tokens, completion_tokens, user, "
            "session) VALUES (?, 'team', ?, 'standard', ?, 'ok', ?, 0, '', '')",
            [(time.time() - 60, key.id, model, tokens) for model, tokens in (("a", 30), ("b", 20), ("c", 10))])
    store.close()
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        usage = (await gw.get("/v1/me/usage?since=1h", headers=bearer(secret))).json()
        assert [r["model"] for r in usage["data"]] == ["a", "b"]
        assert usage["total"]["requests"] == 3 and usage["total"]["prompt_tokens"] == 60
