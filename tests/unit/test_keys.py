"""Keys: the store and its migration from an old file, the checks on what a person types, the
allow-list, expiry, and the failed-key throttle that never locks out a valid key.

In process, on a real SQLite file per test; the same paths through a real gateway are in
tests/integration/test_keys_fake.py.
"""

from __future__ import annotations

import sqlite3
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from passerelle.config import Config, load_config
from passerelle.errors import InvalidRequest, KeyExpired, KeyNotFound, ModelNotAllowed, RateLimited, Unauthorized
from passerelle.observe.record import RequestRecord
from passerelle.tenants.db import SCHEMA_VERSION, connect
from passerelle.tenants.keys import KeyRing, KeyStore, presented_prefix
from passerelle.tenants.manage import KeyManager, parse_expiry
from passerelle.tenants.policy import KeyPolicy
from passerelle.tenants.quota import Quota

CLASSES = ("interactive", "standard", "batch")


def scope(key: str | None = None, client: str = "10.0.0.7", *, header: str = "authorization") -> dict[str, Any]:
    headers = []
    if key is not None:
        headers.append((header.encode(), (f"Bearer {key}" if header == "authorization" else key).encode()))
    return {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers,
            "client": (client, 40000)}


@pytest.fixture
def store(tmp_path) -> KeyStore:
    s = KeyStore(tmp_path / "passerelle.db")
    yield s
    s.close()


@pytest.fixture
def manager(store) -> KeyManager:
    return KeyManager(store, CLASSES)


def policy_for(store: KeyStore, cfg: Config | None = None) -> KeyPolicy:
    return KeyPolicy(cfg or load_config(env={}), KeyRing(store))


# -- the store -------------------------------------------------------------------------------------
def test_a_file_from_before_keeps_its_keys_and_usage_and_gains_the_new_columns(tmp_path):
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE api_keys (id TEXT PRIMARY KEY, digest BLOB NOT NULL, tenant TEXT NOT NULL, priority TEXT,
            max_priority TEXT, rpm INTEGER NOT NULL DEFAULT 0, tpm INTEGER NOT NULL DEFAULT 0,
            max_concurrency INTEGER NOT NULL DEFAULT 0, weight REAL NOT NULL DEFAULT 1.0, created REAL NOT NULL,
            revoked INTEGER NOT NULL DEFAULT 0);
        CREATE TABLE usage (ts REAL NOT NULL, tenant TEXT NOT NULL, class TEXT NOT NULL, model TEXT NOT NULL,
            cause TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL);
        CREATE INDEX usage_ts ON usage (ts);
        INSERT INTO api_keys VALUES ('0123456789ab', x'00', 'old-team', 'batch', 'batch', 7, 0, 2, 1.0, 1.0, 0);
        INSERT INTO usage VALUES (5.0, 'old-team', 'batch', 'm', 'ok', 11, 22);
    """)
    old.close()
    store = KeyStore(path)
    try:
        (key,) = store.list()
        assert (key.id, key.tenant, key.priority, key.rpm, key.max_concurrency) == ("0123456789ab", "old-team",
                                                                                    "batch", 7, 2)
        assert (key.label, key.models, key.quotas, key.expires_at) == ("", (), (), None)
        row = store.conn.execute("SELECT tenant, key_id, prompt_tokens, completion_tokens FROM usage").fetchone()
        assert row == ("old-team", "", 11, 22)
        assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        # and a second opening (another process) finds nothing to do
        connect(path).close()
        assert store.update("0123456789ab", actor="t", label="legacy").label == "legacy"
    finally:
        store.close()


def test_secrets_are_never_stored_and_every_change_is_audited(store, manager):
    key, secret = manager.create({"tenant": "team-a", "label": "laptop", "owner": "ana@example.org"}, actor="cli:ana")
    raw = store.path.read_bytes() + (store.path.with_name(store.path.name + "-wal").read_bytes()
                                      if store.path.with_name(store.path.name + "-wal").exists() else b"")
    assert secret.encode() not in raw and secret.split("_", 2)[2].encode() not in raw  # (the random part may hold "_")
    manager.update(key.id, {"rpm": 30, "models": ["small-*"]}, actor="admin API from 127.0.0.1")
    manager.revoke(key.id, actor="cli:bob")
    log = store.audit_log()
    assert [(r["action"], r["actor"]) for r in log] == [("revoke", "cli:bob"), ("update", "admin API from 127.0.0.1"),
                                                        ("create", "cli:ana")]
    assert log[1]["detail"] == {"rpm": {"from": 0, "to": 30}, "models": {"from": [], "to": ["small-*"]}}
    assert all(secret not in str(r) for r in log)
    with pytest.raises(KeyNotFound):
        manager.update(key.id, {"rpm": 1}, actor="x")  # revoked keys stay revoked


def test_the_ring_sees_a_change_made_by_another_connection(store, tmp_path):
    ring = KeyRing(store, refresh_s=0)
    other = KeyStore(store.path)  # e.g. `passerelle keys create` while the gateway runs
    try:
        _, secret = other.create("late", actor="cli")
        assert ring.lookup(secret).tenant == "late"
        other.revoke(secret.split("_")[1], actor="cli")
        assert ring.lookup(secret) is None and ring.any
    finally:
        other.close()


@pytest.mark.parametrize(("spec", "field"), [
    ({}, "tenant"),
    ({"tenant": ""}, "tenant"),
    ({"tenant": "a", "rpm": -1}, "rpm"),
    ({"tenant": "a", "rpm": "10"}, "rpm"),
    ({"tenant": "a", "priority": "urgent"}, "priority"),
    ({"tenant": "a", "quotas": ["2M/fortnight"]}, "quotas"),
    ({"tenant": "a", "quotas": ["2M/day", "3M/day"]}, "quotas"),
    ({"tenant": "a", "expires_at": "yesterday"}, "expires_at"),
    ({"tenant": "a", "expires_at": "2001-01-01"}, "expires_at"),
    ({"tenant": "a", "models": [1, 2]}, "models"),
    ({"tenant": "a", "weight": 0}, "weight"),
    ({"tenant": "a", "colour": "blue"}, "colour"),
    ({"tenant": "a", "label": "x\x1b[2J"}, "label"),
    ({"tenant": "a", "owner": "x\x9b31m"}, "owner"),  # a C1 control: CSI on some terminals
    ({"tenant": "a\x7f"}, "tenant"),
])
def test_bad_input_is_refused_naming_the_field(manager, spec, field):
    with pytest.raises(InvalidRequest) as info:
        manager.create(spec, actor="t")
    assert info.value.param == field and info.value.status == 400


def test_forms_people_type_are_read(manager):
    key, _ = manager.create({"tenant": "ci", "models": "qwen2.5-7b*, embed-small", "quotas": ["2M/day", "40M/month"],
                             "expires_at": "90d"}, actor="t")
    assert key.models == ("qwen2.5-7b*", "embed-small")
    assert key.quotas == (Quota(2_000_000, "day"), Quota(40_000_000, "month"))
    assert 89.9 * 86400 < key.expires_at - time.time() <= 90 * 86400
    assert parse_expiry("2026-07-01") == datetime(2026, 7, 1).timestamp()  # local midnight
    assert parse_expiry("never") is None and parse_expiry(None) is None
    again = manager.update(key.id, {"models": "*", "quotas": [], "expires_at": "never"}, actor="t")
    assert (again.models, again.quotas, again.expires_at) == ((), (), None)


# -- who is asking ---------------------------------------------------------------------------------
async def test_allow_list_globs_and_the_403_lists_the_keys_models(store, manager):
    key, secret = manager.create({"tenant": "ci", "models": ["qwen2.5-7b*", "embed-small"]}, actor="t")
    assert key.allows("qwen2.5-7b-instruct") and key.allows("embed-small")
    assert not key.allows("qwen2.5-72b") and not key.allows("embed-small-v2")
    policy = policy_for(store)
    rec = RequestRecord(id="r", endpoint="chat", client="10.0.0.7", model="llama-70b")
    found = policy.authenticate(scope(secret), rec)
    assert found.id == key.id and rec.key_id == key.id and rec.tenant == "ci"
    with pytest.raises(ModelNotAllowed) as info:
        await policy.admit(found, rec, load_config(env={}).classes[1], 10)
    assert info.value.status == 403 and info.value.cause.value == "forbidden"
    assert "llama-70b" in info.value.message and "qwen2.5-7b*, embed-small" in info.value.message


def test_an_expired_key_gets_401_naming_the_expiry(store, manager):
    key, secret = manager.create({"tenant": "intern", "owner": "ana@example.org", "expires_at": "1h"}, actor="t")
    store.conn.execute("UPDATE api_keys SET expires_at = ? WHERE id = ?",
                       (datetime(2026, 6, 30, 18, 0).timestamp(), key.id))  # as if an hour had long passed
    policy = policy_for(store)
    with pytest.raises(KeyExpired) as info:
        policy.authenticate(scope(secret))
    err = info.value
    assert err.status == 401 and err.code == "expired_api_key" and err.cause.value == "unauthorized"
    assert "2026-06-30 18:00" in err.message and key.id in err.message and "ana@example.org" in err.message
    # an expired key is no guess: it does not feed the failed-attempt throttle
    assert policy.throttle.failures == 0


def test_anthropic_x_api_key_header_is_accepted(store, manager):
    key, secret = manager.create({"tenant": "claude-code"}, actor="t")
    assert policy_for(store).authenticate(scope(secret, header="x-api-key")).id == key.id


def test_without_keys_nobody_is_asked_for_one(store):
    assert policy_for(store).authenticate(scope(None)) is None


def test_twenty_bad_attempts_then_a_valid_key_from_the_same_address_passes(store, manager):
    key, secret = manager.create({"tenant": "team"}, actor="t")
    policy = policy_for(store)  # [auth] failed_attempts_per_minute = 20
    stale = "psk_0123456789ab_not-the-secret"
    for _ in range(20):
        with pytest.raises(Unauthorized):
            policy.authenticate(scope(stale))
    with pytest.raises(RateLimited) as info:  # the 21st from that client with that key: throttled
        policy.authenticate(scope(stale))
    assert 59 <= info.value.retry_after <= 60 and "psk_0123456789ab" in info.value.message
    # the same address (a reverse proxy, the box itself) with the valid key: served
    assert policy.authenticate(scope(secret)).id == key.id
    # another wrong key from the same address is not blamed for the first one's failures
    with pytest.raises(Unauthorized) as info2:
        policy.authenticate(scope("sk-other-typo"))
    assert not isinstance(info2.value, RateLimited)
    snap = policy.snapshot()["auth_throttle"]
    assert snap["blocked"] == [{"client": "10.0.0.7", "key_prefix": "psk_0123456789ab", "failures": 20,
                                "retry_after_s": pytest.approx(60, abs=1)}]
    assert snap["refused_total"] == 1 and snap["failures_total"] == 21


def test_the_throttle_forgets_after_a_minute(store, manager):
    manager.create({"tenant": "team"}, actor="t")
    now = [1000.0]
    policy = policy_for(store)
    policy.throttle.clock = lambda: now[0]
    for _ in range(20):
        with pytest.raises(Unauthorized):
            policy.authenticate(scope(None))
    with pytest.raises(RateLimited):
        policy.authenticate(scope(None))
    now[0] += 60.5
    with pytest.raises(Unauthorized) as info:
        policy.authenticate(scope(None))
    assert not isinstance(info.value, RateLimited)


def test_presented_prefix_never_shows_a_secret():
    assert presented_prefix("psk_0123456789ab_SECRETSECRET") == "psk_0123456789ab"
    assert presented_prefix("sk-proj-abcdefghijkl") == "sk-proj-"
    assert presented_prefix("") == "(none)"


# -- where the store lives -------------------------------------------------------------------------
def test_the_state_directory_follows_the_configuration(tmp_path):
    home_default = load_config(env={})
    assert home_default.state_path(env={}).parts[-3:] == (".local", "state", "passerelle")
    assert home_default.state_path(env={"PASSERELLE_STATE": "/srv/p"}) == Path("/srv/p")
    path = tmp_path / "team.toml"
    path.write_text("")
    cfg = load_config(path, env={})
    assert cfg.state_path(env={}) == tmp_path / "team.state"
    assert cfg.db_path(env={}) == tmp_path / "team.state" / "passerelle.db"
    assert cfg.state_path(env={"PASSERELLE_STATE": "/srv/p"}) == Path("/srv/p")  # explicit wins over the default
    path.write_text('[server]\nstate_dir = "var"\n')
    cfg = load_config(path, env={})
    assert cfg.state_path(env={"PASSERELLE_STATE": "/srv/p"}) == tmp_path / "var"  # relative to the file
    path.write_text('[server]\nstate_dir = "/var/lib/passerelle"\n[auth]\ndb = "/data/keys.db"\n')
    cfg = load_config(path, env={})
    assert cfg.state_path() == Path("/var/lib/passerelle") and cfg.db_path() == Path("/data/keys.db")
