"""What a runtime or a client can make the gateway hold, trust or say, in-process (tests/inprocess.py):
bytes after a runtime's answer, a runtime's error page, forwarded addresses, echoed strings, and
media parts a model cannot take."""

from __future__ import annotations

import orjson
import pytest

from passerelle.config import AuthConfig, ModelConfig, ServerConfig
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


@pytest.mark.parametrize(("trusted", "headers", "client"), [
    # by default no peer is trusted, loopback included: the headers change nothing
    ((), {"x-forwarded-for": "10.9.9.9"}, "127.0.0.1"),
    ((), {"x-real-ip": "10.9.9.9"}, "127.0.0.1"),
    ((), {"forwarded": "for=10.9.9.9"}, "127.0.0.1"),
    # from a trusted proxy: the nearest hop it does not trust
    (("127.0.0.1",), {"x-forwarded-for": "1.1.1.1, 10.9.9.9"}, "10.9.9.9"),
    (("127.0.0.1", "10.0.0.0/8"), {"x-forwarded-for": "1.1.1.1, 10.9.9.9"}, "1.1.1.1"),
    (("127.0.0.0/8",), {"forwarded": 'for=1.1.1.1, for="[2001:db8::1]:4711";proto=https'}, "2001:db8::1"),
    (("127.0.0.1",), {"x-real-ip": "10.9.9.9"}, "10.9.9.9"),
    (("127.0.0.1",), {"x-forwarded-for": "not-an-address"}, "127.0.0.1"),
    (("127.0.0.1",), {}, "127.0.0.1"),
    # a peer that is not a trusted proxy
    (("10.0.0.1",), {"x-forwarded-for": "10.9.9.9"}, "127.0.0.1"),
])
async def test_forwarded_addresses_are_believed_only_from_configured_proxies(trusted, headers, client):
    async with fake_runtime() as fake, \
            gateway(fake.backend_config(), server=ServerConfig(trusted_proxies=trusted)) as gw:
        resp = await gw.post("/v1/chat/completions", CHAT, headers=headers)
        assert resp.status == 200 and gw.records[0].client == client


async def test_a_local_client_cannot_rotate_its_failed_key_throttle_with_forwarded_headers(tmp_path):
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "keys.db",
                                               auth=AuthConfig(required=True, failed_attempts_per_minute=3)) as gw:
        codes = []
        for i in range(5):
            resp = await gw.post("/v1/chat/completions", CHAT, headers={
                "authorization": "Bearer sk-wrong-key", "x-forwarded-for": f"10.0.0.{i}", "x-real-ip": f"10.1.0.{i}"})
            codes.append(resp.status)
        assert codes == [401, 401, 401, 429, 429]


def test_uvicorn_never_reads_forwarded_headers_itself():
    # (uvicorn trusts X-Forwarded-For from 127.0.0.1 by default; the gateway decides, server/forwarded.py)
    from passerelle.config import Config
    from passerelle.server.serving import gateway_server

    server = gateway_server(object(), Config())
    assert server.config.proxy_headers is False


def test_trusted_proxies_must_be_addresses_or_networks(tmp_path):
    from passerelle.config import load_config
    from passerelle.errors import ConfigError

    path = tmp_path / "p.toml"
    path.write_text('[server]\ntrusted_proxies = ["127.0.0.1", "10.0.0.0/8", "::1"]\n')
    assert load_config(str(path), env={}).server.trusted_proxies == ("127.0.0.1", "10.0.0.0/8", "::1")
    path.write_text('[server]\ntrusted_proxies = ["localhost"]\n')
    with pytest.raises(ConfigError, match=r"server\.trusted_proxies"):
        load_config(str(path), env={})


IMAGE_URL = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
B64 = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
MEDIA_CASES = [
    # path, content part(s), capability it needs
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE_URL]}]},
     "vision"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [AUDIO]}]}, "audio"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}]}, "vision"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]}, "audio"),
    ("/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_file", "filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}]}]}, "vision"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": B64}]}]}, "vision"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}]}]},
     "vision"),
    # an image inside a tool result
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image", "source": B64}]}]}]}, "vision"),
]
ENDPOINTS = ("chat", "responses", "messages")


def _media_gateway(fake, capabilities):
    models = (ModelConfig(name="fake-model", capabilities=capabilities),) if capabilities is not None else ()
    return gateway(fake.backend_config(endpoints=ENDPOINTS), models=models)


@pytest.mark.parametrize(("path", "body", "needs"), MEDIA_CASES)
async def test_media_to_a_model_that_declares_no_such_capability_is_a_400_naming_both(path, body, needs):
    async with fake_runtime() as fake, _media_gateway(fake, ("chat", "tools")) as gw:
        resp = await gw.post(path, {"model": "fake-model", **body})
        assert resp.status == 400, resp.body
        err = resp.json()
        if path == "/v1/messages":
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        else:
            assert err["error"]["type"] == "invalid_request_error"
        message = err["error"]["message"]
        assert "'fake-model'" in message and f"'{needs}'" in message
        assert gw.records[0].cause is Cause.INVALID_REQUEST
        assert fake.runtime.counters.requests == 0  # refused before the runtime saw it


@pytest.mark.parametrize(("path", "body", "needs"), MEDIA_CASES)
async def test_media_passes_to_a_model_that_declares_it_or_declares_nothing(path, body, needs):
    for capabilities in (("chat", needs), None):
        async with fake_runtime() as fake, _media_gateway(fake, capabilities) as gw:
            resp = await gw.post(path, {"model": "fake-model", **body})
            assert resp.status == 200, (capabilities, resp.body)


@pytest.mark.parametrize("body", [
    # text parts, a text document, a tool whose schema has properties named like media types
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "an image_url or input_audio"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": "plain words"}}]}], "max_tokens": 5},
    {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"image": {"type": "image"},
                                                                      "type": {"type": "string"}}}}}]},
])
async def test_text_only_requests_pass_a_text_model(body):
    path = "/v1/messages" if "max_tokens" in body else "/v1/chat/completions"
    # (with tools declared: a model without them refuses a request with tools, whatever their schemas)
    caps = ("chat", "tools") if "tools" in body else ("chat",)
    async with fake_runtime() as fake, _media_gateway(fake, caps) as gw:
        resp = await gw.post(path, {"model": "fake-model", **body})
        assert resp.status == 200, resp.body


def test_the_embedded_default_declares_a_text_model_without_vision_or_audio():
    from passerelle.config import Config, EmbeddedConfig
    from passerelle.runtimes.factory import embedded_models

    (entry,) = embedded_models(Config())
    assert entry.name == Config().embedded.served_id
    assert "chat" in entry.capabilities and not {"vision", "audio"} & set(entry.capabilities)
    # a model of the operator's own (embedded.model_path) may see or hear: no capability is declared
    # for it (its entry only carries the agents' aliases)
    (own_model,) = embedded_models(Config(embedded=EmbeddedConfig(model_path="/models/llava.gguf")))
    assert own_model.capabilities == () and own_model.aliases == Config().embedded.aliases
    assert embedded_models(Config(embedded=EmbeddedConfig(model_path="/models/llava.gguf", aliases=()))) == ()
    # nor for a model the operator's [[models]] already describes
    own = ModelConfig(name="chat", served_name=Config().embedded.served_id)
    assert embedded_models(Config(models=(own,))) == ()


async def test_a_media_type_written_with_escapes_is_still_a_media_part():
    body = b'{"model":"fake-model","messages":[{"role":"user","content":[{"type":"image\\u005furl",' \
           b'"image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}}]}]}'
    async with fake_runtime() as fake, _media_gateway(fake, ("chat",)) as gw:
        resp = await gw.request("POST", "/v1/chat/completions", body, headers={"content-type": "application/json"})
        assert resp.status == 400 and "'vision'" in resp.json()["error"]["message"]
