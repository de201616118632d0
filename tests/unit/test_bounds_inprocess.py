"""What a runtime or a client can make the gateway hold, trust or say, in-process (tests/inprocess.py):
bytes after a runtime's answer, a runtime's error page, forwarded addresses, echoed strings, and
media parts a model cannot take."""

from __future__ import annotations

import orjson
import pytest

from passerelle.errors import Cause
from tests.inprocess import fake_runtime, gateway

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5}


@pytest.mark.parametrize("kind", ["openai", "llama-server"])
@pytest.mark.parametrize("stream", [False, True])
async def test_an_unsolicited_second_response_is_never_relayed_and_its_connection_never_reused(kind, stream):
    async with fake_runtime() as fake, gateway(fake.backend_config(kind=kind, max_concurrency=1)) as gw:
        resp = await gw.post("/v1/chat/completions", {**CHAT, "stream": stream, "fake_fault": "second-response"})
        assert resp.status == 200 and b"unasked" not in resp.body
        if stream:
            assert resp.events()[-1] == b"[DONE]"
        else:
            assert resp.json()["choices"][0]["message"]["content"] == "a"
        before = fake.runtime.counters.connections
        ok = await gw.post("/v1/chat/completions", CHAT)
        assert ok.status == 200 and b"unasked" not in ok.body
        assert fake.runtime.counters.connections == before + 1  # a fresh connection, not the poisoned one
        assert [r.cause for r in gw.records] == [Cause.OK, Cause.OK]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/messages", CHAT),
])
async def test_a_runtimes_html_error_page_never_lends_its_content_type_to_the_gateways_json(path, body):
    async with fake_runtime() as fake, gateway(fake.backend_config(endpoints=("chat", "messages"))) as gw:
        resp = await gw.post(path, {**body, "fake_fault": "html-error"})
        assert resp.status == 500
        assert resp.headers[b"content-type"] == b"application/json"
        err = resp.json()
        assert (err["error"]["type"] == "api_error") if path == "/v1/messages" else \
            (err["error"]["code"] == "upstream_500")
        assert gw.records[0].cause is Cause.UPSTREAM_ERROR


async def test_a_runtimes_error_that_looks_like_json_but_is_not_is_wrapped_as_json():
    from passerelle.errors import UpstreamStatus
    from passerelle.proxy.protocols import OPENAI, error_body

    body, ctype = error_body(UpstreamStatus(500, b'{"error" <html>', b"text/html"), OPENAI)
    assert ctype == b"application/json" and orjson.loads(body)["error"]["code"] == "upstream_500"
    passed, ctype = error_body(UpstreamStatus(400, b'{"error":{"message":"too long"}}', b"text/plain"), OPENAI)
    assert ctype == b"application/json" and orjson.loads(passed)["error"]["message"] == "too long"


LONG = "m" * (1024 * 1024)


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/chat/completions", {**CHAT, "model": LONG}),
    ("POST", "/v1/messages", {**CHAT, "model": LONG}),
    ("POST", "/v1/embeddings", {"model": "fake-model" + LONG, "input": "hi"}),
    ("GET", "/v1/models/" + LONG, None),
    ("GET", "/nope/" + LONG, None),
    ("POST", "/v1/nope/" + LONG, {}),
])
async def test_a_client_string_is_echoed_cut_short_in_an_error(method, path, body):
    async with fake_runtime() as fake, gateway(fake.backend_config(endpoints=("chat", "messages"))) as gw:
        if body is None:
            resp = await gw.request(method, path)
        else:
            resp = await gw.post(path, body)
        assert 400 <= resp.status < 500
        assert len(resp.body) < 1024, resp.body[:300]
        assert "mmm…" in resp.json()["error"]["message"]
