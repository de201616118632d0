"""Sessions named by coding agents and front-ends: where each client puts its session id, affinity
by it, its hash in the access log and the usage store, and the per-session cap on requests in flight.
"""

from __future__ import annotations

import asyncio

import pytest

from passerelle.config import RoutingConfig
from passerelle.errors import Cause
from passerelle.observe.accesslog import record_fields
from passerelle.proxy.intake import affinity_key, keeps_kv, session_hash, session_of
from passerelle.tenants.keys import KeyStore
from tests.inprocess import fake_runtime, gateway
from tests.waiting import until

R = RoutingConfig()
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def scope(**headers: str) -> dict:
    return {"headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}


@pytest.mark.parametrize(("headers", "data", "where"), [
    ({"X-Claude-Code-Session-Id": "cc-1"}, {"metadata": {"user_id": "u_session_x"}}, "x-claude-code-session-id"),
    ({"session-id": "cc-1"}, {"prompt_cache_key": "other"}, "session-id"),  # Codex, header
    ({"session_id": "cc-1"}, {}, "session_id"),  # Codex's other spelling
    ({"x-session-id": "cc-1"}, {}, "x-session-id"),  # the [routing] session_header
    ({}, {"prompt_cache_key": "cc-1", "user": "ada"}, "prompt_cache_key"),  # Codex, OpenAI
    ({}, {"promptCacheKey": "cc-1", "user": "ada"}, "promptCacheKey"),  # opencode with setCacheKey
    ({}, {"metadata": {"user_id": "cc-1"}}, "metadata.user_id"),  # Anthropic (Claude Code)
    ({}, {"user": "cc-1"}, "user"),
])
def test_each_clients_session_is_found_where_it_puts_it(headers, data, where):
    assert session_of(R, scope(**headers), data) == (where, "cc-1")


def test_no_session_and_odd_fields_are_ignored():
    assert session_of(R, scope(), {"metadata": "x", "prompt_cache_key": 7, "user": "  "}) == ("", "")
    assert session_of(R, scope(), None) == ("", "")


def test_a_front_ends_chat_header_counts_only_when_given():
    s = scope(**{"x-openwebui-chat-id": "c1"})
    assert session_of(R, s, {}) == ("", "")
    assert session_of(R, s, {}, "x-openwebui-chat-id") == ("x-openwebui-chat-id", "c1")


def test_affinity_follows_the_session_but_a_user_still_goes_by_conversation():
    data = {"messages": [{"role": "user", "content": "hello"}], "user": "ada"}
    by_session = affinity_key(R, scope(), data, "chat", ("prompt_cache_key", "k1"))
    assert by_session == "s:" + session_hash("k1")
    assert affinity_key(R, scope(), data, "chat", ("user", "ada")).startswith("p:")


async def test_the_session_is_hashed_in_the_access_log_and_the_usage_store(tmp_path):
    _, secret = KeyStore(tmp_path / "k.db").create("team")
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        resp = await gw.post("/v1/chat/completions", CHAT, headers={"authorization": f"Bearer {secret}",
                                                                    "x-claude-code-session-id": "secret-session"})
        assert resp.status == 200
        rec = gw.records[-1]
        assert rec.session == session_hash("secret-session")
        assert record_fields(rec)["session"] == rec.session and "secret-session" not in str(record_fields(rec))
        await gw.app.stores.usage.flush()
        rows = await gw.app.stores.reports.report(by=("session",))
        assert [(r["session"], r["requests"]) for r in rows] == [(rec.session, 1)]


async def test_a_session_over_its_cap_gets_429_and_other_sessions_go_on():
    async with fake_runtime(ttft_ms=300, itl_ms=5) as fake, gateway(
            fake.backend_config(), routing=RoutingConfig(max_session_in_flight=2)) as gw:
        same = {"x-claude-code-session-id": "loop"}
        running = [asyncio.create_task(gw.post("/v1/chat/completions", CHAT, headers=same)) for _ in range(2)]
        await until(lambda: gw.app.gateway.sessions.in_flight("anonymous", session_hash("loop")) >= 2, 5,
                    "two of the session's requests in flight")
        over = await gw.post("/v1/chat/completions", CHAT, headers=same)
        assert over.status == 429 and over.json()["error"]["code"] == "session_limit"
        assert over.headers[b"retry-after"] == b"1" and gw.records[-1].cause is Cause.SESSION_LIMIT
        other = await gw.post("/v1/chat/completions", CHAT, headers={"x-claude-code-session-id": "other"})
        assert other.status == 200
        assert [r.status for r in await asyncio.gather(*running)] == [200, 200]
        assert len(gw.app.gateway.sessions) == 0


@pytest.mark.parametrize(("headers", "data", "kept"), [
    ({"X-Claude-Code-Session-Id": "cc-1"}, {}, True),
    ({}, {"prompt_cache_key": "cc-1"}, True),
    ({}, {"metadata": {"user_id": "user_x_session_cc-1"}}, True),  # Claude Code's own spelling
    ({}, {"user": "ada"}, False),  # a person, many conversations: no slot held for them
    ({}, {}, False),
])
def test_a_slot_and_kv_are_kept_for_a_named_session_never_for_a_user(headers, data, kept):
    assert keeps_kv(session_of(R, scope(**headers), data)) is kept

