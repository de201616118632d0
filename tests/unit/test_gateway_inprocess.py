"""The gateway's request paths in-process (tests/inprocess.py): the ASGI app in this event loop, the
fake runtime on a loopback socket of the same loop. Each test checks what the client got, the one
termination cause recorded, and that every slot came back."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from passerelle import __version__
from passerelle.config import AuthConfig, ClassConfig, TimeoutConfig
from passerelle.errors import Cause
from passerelle.tenants.keys import KeyStore
from tests.inprocess import fake_runtime, gateway
from tests.waiting import until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5}


def settled(gw) -> bool:
    """Nothing running or queued in the gateway, and every backend's slots free."""
    s = gw.app.scheduler
    return not s.waiting and not any(s.running.values()) and all(b.in_flight == 0 for b in gw.app.registry.backends)


async def test_stream_relayed_with_usage_removed_and_one_ok_record():
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        resp = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
        assert resp.status == 200 and resp.headers[b"content-type"].startswith(b"text/event-stream")
        events = resp.events()
        assert events[-1] == b"[DONE]"
        assert not any(b'"usage"' in e for e in events)  # asked for by the gateway, not by the client
        [rec] = gw.records
        assert rec.cause is Cause.OK and rec.completion_tokens == 5 and rec.usage_from_server
        assert rec.ttft is not None and len(rec.gaps) == 4
        assert settled(gw)


async def test_non_streaming_answer_passes_through():
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        resp = await gw.post("/v1/completions", {"model": "fake-model", "prompt": "Once", "max_tokens": 3})
        assert resp.status == 200 and resp.json()["usage"]["completion_tokens"] == 3
        assert resp.headers[b"x-request-id"].decode() == gw.records[0].id


@pytest.mark.parametrize(("body", "status", "code"), [
    (b"", 400, "invalid_request"),
    (b"{not json", 400, "invalid_request"),
    (b'{"model": "fake-model"}', 400, "invalid_request"),
    (b'{"model": "fake-model", "messages": [], "stream": "yes"}', 400, "invalid_request"),
    (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "model_not_found"),
])
async def test_bad_requests_get_openai_shaped_errors(body, status, code):
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        resp = await gw.request("POST", "/v1/chat/completions", body)
        assert resp.status == status and resp.json()["error"]["code"] == code
        assert gw.records[0].cause is Cause.INVALID_REQUEST and fake.runtime.counters.requests == 0
        assert settled(gw)


async def test_body_over_the_limit_is_refused_before_it_is_read():
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        big = dict(CHAT, messages=[{"role": "user", "content": "x" * (9 * 1024 * 1024)}])
        resp = await gw.post("/v1/chat/completions", big)
        assert resp.status == 413 and resp.json()["error"]["code"] == "request_too_large"


async def test_routes_unknown_paths_and_wrong_methods():
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        assert (await gw.get("/v1/chat/completions")).status == 405
        assert (await gw.get("/v1/nothing")).json()["error"]["code"] == "not_found"
        assert (await gw.get("/health")).json() == {"status": "ok", "server": "passerelle", "version": __version__}
        models = (await gw.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["fake-model"]
        assert (await gw.get("/admin/stats", client="192.0.2.7")).status == 403


async def test_client_leaving_mid_stream_frees_the_slot_and_is_one_disconnect():
    async with fake_runtime(itl_ms=20) as fake, gateway(fake.backend_config()) as gw:
        resp = await gw.post("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 500},
                             leave_after_chunks=2)
        assert resp.status == 200 and len(resp.chunks) >= 2
        [rec] = gw.records
        assert rec.cause is Cause.CLIENT_DISCONNECT and rec.status == 499
        assert settled(gw)
        # the runtime saw the connection close and stopped generating
        await until(lambda: fake.runtime.counters.disconnected == 1 and not fake.runtime.slots.busy, 5,
                    "the runtime to see the connection close and stop generating")
        assert fake.runtime.counters.completed == 0


async def test_runtime_error_status_is_passed_on_with_its_cause():
    async with fake_runtime(fail_rate=1.0) as fake, gateway(fake.backend_config()) as gw:
        resp = await gw.post("/v1/chat/completions", CHAT)
        assert resp.status == 500 and "injected failure" in resp.json()["error"]["message"]
        assert gw.records[0].cause is Cause.UPSTREAM_ERROR and settled(gw)


async def test_a_replica_that_cannot_be_reached_is_replaced_before_the_first_byte():
    async with fake_runtime() as fake, gateway(fake.backend_config("dead", url="http://127.0.0.1:9"),
                                               fake.backend_config("alive")) as gw:
        for b in gw.app.registry.backends:  # both look healthy: the dead one is found out by the request
            b.stats.up = True
        results = [await gw.post("/v1/chat/completions", CHAT) for _ in range(4)]
        assert all(r.status == 200 for r in results)
        assert {r.backend for r in gw.records} == {"alive"}
        assert any(r.retries == 1 for r in gw.records) and settled(gw)


async def test_first_token_timeout_is_a_504_with_its_own_cause():
    timeouts = TimeoutConfig(first_token_s=0.2)
    async with fake_runtime(ttft_ms=2000) as fake, gateway(fake.backend_config(), timeouts=timeouts) as gw:
        resp = await gw.post("/v1/chat/completions", {**CHAT, "stream": True})
        assert resp.status == 504 and resp.json()["error"]["code"] == "upstream_timeout"
        assert gw.records[0].cause is Cause.UPSTREAM_TIMEOUT and settled(gw)


async def test_full_queue_is_429_with_retry_after_and_the_queued_request_still_served():
    one = (ClassConfig("standard", 1, max_queue=1, max_queue_wait_s=10),)
    async with fake_runtime(itl_ms=10) as fake, \
            gateway(fake.backend_config(max_concurrency=1), classes=one,
                    auth=AuthConfig(anonymous_priority="standard", anonymous_max_priority="standard")) as gw:
        slow = dict(CHAT, max_tokens=40)
        running = asyncio.create_task(gw.post("/v1/chat/completions", slow))
        queued = asyncio.create_task(gw.post("/v1/chat/completions", slow))
        await until(lambda: gw.app.scheduler.waiting, 5, "the second request queued")
        refused = await gw.post("/v1/chat/completions", slow)
        assert refused.status == 429 and refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers[b"retry-after"]) >= 1
        assert (await running).status == 200 and (await queued).status == 200
        assert sorted(r.cause.value for r in gw.records) == ["ok", "ok", "queue_full"] and settled(gw)


async def test_keys_missing_wrong_valid_and_rate_limited(tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    _, secret = store.create("team-a", rpm=2)
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "keys.db") as gw:
        assert (await gw.post("/v1/chat/completions", CHAT)).status == 401
        bad = await gw.post("/v1/chat/completions", CHAT, headers={"authorization": "Bearer nope"})
        assert bad.status == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        ok = {"authorization": f"Bearer {secret}"}
        assert [(await gw.post("/v1/chat/completions", CHAT, headers=ok)).status for _ in range(3)] == [200, 200, 429]
        causes = [r.cause for r in gw.records]
        assert causes == [Cause.UNAUTHORIZED, Cause.UNAUTHORIZED, Cause.OK, Cause.OK, Cause.RATE_LIMITED]
        assert {r.tenant for r in gw.records if r.cause is Cause.OK} == {"team-a"}
        assert settled(gw)


async def test_priority_header_may_lower_a_class_but_not_raise_it():
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        await gw.post("/v1/chat/completions", CHAT, headers={"x-priority": "batch"})
        await gw.post("/v1/chat/completions", CHAT, headers={"x-priority": "interactive"})
        bad = await gw.post("/v1/chat/completions", CHAT, headers={"x-priority": "urgent"})
        assert bad.status == 400
        assert [r.priority for r in gw.records[:2]] == ["batch", "standard"]


async def test_embeddings_are_not_streamed_and_are_metered():
    async with fake_runtime() as fake, \
            gateway(dataclasses.replace(fake.backend_config(), endpoints=("embeddings",))) as gw:
        resp = await gw.post("/v1/embeddings", {"model": "fake-model", "input": "a b c", "stream": True})
        assert resp.status == 200 and len(resp.json()["data"][0]["embedding"]) == 64
        chat = await gw.post("/v1/chat/completions", CHAT)
        assert chat.status == 400 and "/v1/chat" in chat.json()["error"]["message"]
