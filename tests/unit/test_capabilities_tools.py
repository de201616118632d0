"""Tools never vanish silently, in-process with the fake runtime: a model that cannot use tools
refuses a request with tools (a 400 in each API's shape, naming the model and the capability), or
serves it without them and says so (``tools = "ignore"``); a request with tools goes only to the
replicas whose template renders tools; ``tools: []`` and a ``tool_choice`` with no tools never reach
the runtime, and a request that needs no change reaches it byte for byte."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from passerelle.config import ModelConfig
from passerelle.errors import Cause
from passerelle.proxy.capabilities import capabilities_needed, normalise_tools
from tests.inprocess import fake_runtime, gateway
from tests.waiting import until

TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                         "parameters": {"type": "object", "properties": {"w": {"type": "string"}}}}}
CHAT = {"model": "fake-model", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
# each API's request with a tool, and where its 400 says what
WITH_TOOLS = {
    "/v1/chat/completions": {**CHAT, "tools": [TOOL], "tool_choice": "required"},
    "/v1/responses": {"model": "fake-model", "input": "Hi", "max_output_tokens": 3,
                      "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]},
    "/v1/messages": {"model": "fake-model", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}],
                     "tools": [{"name": "lookup", "input_schema": {"type": "object"}}]},
}
ENDPOINTS = ("chat", "completions", "responses", "messages")


def capture(fake: Any) -> list[tuple[bytes, bytes]]:
    """The inference requests the runtime receives (path, body)."""
    received: list[tuple[bytes, bytes]] = []
    dispatch = fake.runtime.dispatch

    async def wrapped(conn: Any, method: bytes, path: bytes, body: bytes, keep_alive: bool) -> None:
        if method == b"POST" and path.startswith(b"/v1/"):
            received.append((path, body))
        await dispatch(conn, method, path, body, keep_alive)

    fake.runtime.dispatch = wrapped
    return received


@pytest.mark.parametrize("path", WITH_TOOLS)
async def test_tools_to_a_model_without_them_are_a_400_naming_model_and_capability(path: str) -> None:
    async with fake_runtime() as fake:
        received = capture(fake)
        backend = fake.backend_config(endpoints=ENDPOINTS)
        models = (ModelConfig(name="fake-model", capabilities=("chat", "completions")),)
        async with gateway(backend, models=models) as gw:
            r = await gw.post(path, WITH_TOOLS[path])
            assert r.status == 400, r.body
            body = r.json()
            error = body["error"]
            if path == "/v1/messages":  # Anthropic's shape
                assert body["type"] == "error" and error["type"] == "invalid_request_error"
            else:
                assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
            assert "'fake-model' cannot use tools" in error["message"] and "'tools'" in error["message"]
            assert gw.records[-1].cause is Cause.INVALID_REQUEST
            assert received == []


@pytest.mark.parametrize("path", WITH_TOOLS)
async def test_tools_ignore_serves_without_them_and_says_so(path: str) -> None:
    async with fake_runtime() as fake:
        received = capture(fake)
        backend = fake.backend_config(endpoints=ENDPOINTS)
        models = (ModelConfig(name="fake-model", capabilities=("chat",), tools="ignore"),)
        async with gateway(backend, models=models) as gw:
            r = await gw.post(path, WITH_TOOLS[path])
            assert r.status == 200, r.body
            assert r.headers.get(b"x-passerelle-warning") == b"tools ignored: model fake-model cannot use tools"
            [(_, sent)] = received
            assert b'"tools"' not in sent and b"tool_choice" not in sent


async def test_a_model_whose_capabilities_nobody_declared_is_not_judged() -> None:
    async with fake_runtime() as fake:
        received = capture(fake)
        async with gateway(fake.backend_config()) as gw:
            body = WITH_TOOLS["/v1/chat/completions"]
            r = await gw.post("/v1/chat/completions", body)
            assert r.status == 200 and b"x-passerelle-warning" not in r.headers
            assert orjson.loads(received[0][1])["tools"] == [TOOL]


async def test_tools_go_only_to_the_replica_whose_template_renders_them() -> None:
    async with fake_runtime(tools=True) as able, fake_runtime(tools=False) as unable:
        got_able, got_unable = capture(able), capture(unable)
        backends = (able.backend_config("able", kind="llama-server", endpoints=("chat",)),
                    unable.backend_config("unable", kind="llama-server", endpoints=("chat",)))
        async with gateway(*backends) as gw:
            replicas = {b.name: b for b in gw.app.gateway.registry.backends}
            await until(lambda: "tools" in replicas["able"].traits and "tools" in replicas["unable"].traits,
                        10, what="both replicas probed")
            assert replicas["able"].traits["tools"] and not replicas["unable"].traits["tools"]
            for _ in range(6):
                r = await gw.post("/v1/chat/completions", WITH_TOOLS["/v1/chat/completions"])
                assert r.status == 200, r.body
            assert len(got_able) == 6 and got_unable == []
            listed = (await gw.get("/v1/models")).json()["data"][0]
            assert "tools" in listed["capabilities"] and listed["meta"]["capabilities"]["function_calling"]
            assert listed["info"]["meta"]["capabilities"]["function_calling"] is True
            # the able one going away leaves a model that cannot: a 400, not a silent drop
            replicas["able"].traits["tools"] = False
            r = await gw.post("/v1/chat/completions", WITH_TOOLS["/v1/chat/completions"])
            assert r.status == 400 and "cannot use tools" in r.json()["error"]["message"]
            model = (await gw.get("/v1/models/fake-model")).json()
            assert "tools" not in model["capabilities"] and model["meta"]["capabilities"]["function_calling"] is False


async def test_empty_tools_and_a_lone_tool_choice_never_reach_the_runtime() -> None:
    async with fake_runtime() as fake:
        received = capture(fake)
        async with gateway(fake.backend_config(endpoints=ENDPOINTS)) as gw:
            r = await gw.post("/v1/chat/completions", {**CHAT, "tools": [], "tool_choice": "auto"})
            assert r.status == 200, r.body
            sent = orjson.loads(received[-1][1])
            assert "tools" not in sent and "tool_choice" not in sent and sent["messages"] == CHAT["messages"]
            r = await gw.post("/v1/responses", {"model": "fake-model", "input": "Hi", "tool_choice": "auto",
                                                "max_output_tokens": 3})
            assert r.status == 200 and b"tool_choice" not in received[-1][1]
            # a request that needs no change goes on byte for byte
            raw = b'{"model":"fake-model","max_tokens":3,  "tools":[%s],"tool_choice":"auto",' \
                  b'"messages":[{"role":"user","content":"Hi"}]}' % orjson.dumps(TOOL)
            r = await gw.request("POST", "/v1/chat/completions", raw, headers={"content-type": "application/json"})
            assert r.status == 200 and received[-1][1] == raw


def test_normalise_and_needs() -> None:
    assert normalise_tools("chat", {"tools": [TOOL], "tool_choice": "auto"}) is None
    assert normalise_tools("embeddings", {"tools": []}) is None
    out = normalise_tools("messages", {"tools": [], "tool_choice": {"type": "auto"}, "x": 1})
    assert out is not None and out[0] == {"x": 1}
    out = normalise_tools("chat", {"functions": [], "function_call": "auto", "parallel_tool_calls": True})
    assert out is not None and out[0] == {}
    assert capabilities_needed("chat", {"tools": [TOOL]}, b"") == {"tools"}
    assert capabilities_needed("chat", {"tools": []}, b"") == set()
    assert capabilities_needed("completions", {"tools": [TOOL]}, b"") == set()


# /props of the pinned llama-server with SmolLM2 (its template drops tools), abridged
SMOL_PROPS = {"total_slots": 1, "modalities": {"vision": False, "video": False, "audio": False},
              "chat_template": "{% for message in messages %}<|im_start|>...",
              "chat_template_caps": {"supports_tools": False, "supports_tool_calls": False}}


def test_traits_from_props_and_the_rendered_probe() -> None:
    from passerelle.runtimes.llama_server import PROBE_TOOL, traits_of

    rendered_without = "<|im_start|>user\nWhat is the weather?<|im_end|>\n<|im_start|>assistant\n"
    assert traits_of(SMOL_PROPS, rendered_without) == {"vision": False, "audio": False, "reasoning": False,
                                                       "tools": False}
    # the template renders the tool: whatever chat_template_caps says, the rendering decides
    assert traits_of(SMOL_PROPS, f"<tools>{PROBE_TOOL}</tools>")["tools"] is True
    # no answer from /apply-template: chat_template_caps decides
    lying = {**SMOL_PROPS, "chat_template_caps": {"supports_tools": True}}
    assert traits_of(lying, None)["tools"] is True
    thinking = {**SMOL_PROPS, "chat_template": "{% if enable_thinking %}<think>{% endif %}"}
    assert traits_of(thinking, None)["reasoning"] is True
    assert traits_of({}, None) == {}


def test_model_capabilities_are_true_false_or_unknown() -> None:
    from passerelle.config import BackendConfig, TimeoutConfig
    from passerelle.runtimes.kinds import make_backend
    from passerelle.runtimes.model_caps import model_capabilities, replica_has

    a = make_backend(BackendConfig(name="a", kind="llama-server", url="http://h:1", models=("m",)), TimeoutConfig())
    b = make_backend(BackendConfig(name="b", kind="llama-server", url="http://h:2", models=("m",)), TimeoutConfig())
    plain = ModelConfig(name="m")
    assert model_capabilities(plain, [a, b])["tools"] is None  # nobody said
    a.traits = {"tools": False}
    assert model_capabilities(plain, [a, b])["tools"] is None  # b has not said
    b.traits = {"tools": True}
    assert model_capabilities(plain, [a, b])["tools"] is True
    assert not replica_has(plain, a, "tools") and replica_has(plain, b, "tools")
    b.traits = {"tools": False}
    assert model_capabilities(plain, [a, b])["tools"] is False
    declared = ModelConfig(name="m", capabilities=("chat", "tools"))  # the catalogue's word wins
    assert model_capabilities(declared, [a, b])["tools"] is True and replica_has(declared, a, "tools")
    assert model_capabilities(declared, [a, b])["vision"] is False


async def test_a_stream_served_without_its_tools_carries_the_warning_too() -> None:
    async with fake_runtime() as fake:
        models = (ModelConfig(name="fake-model", capabilities=("chat",), tools="ignore"),)
        async with gateway(fake.backend_config(endpoints=ENDPOINTS), models=models) as gw:
            r = await gw.post("/v1/chat/completions", {**WITH_TOOLS["/v1/chat/completions"], "stream": True})
            assert r.status == 200 and r.events()[-1] == b"[DONE]"
            assert r.headers.get(b"x-passerelle-warning") == b"tools ignored: model fake-model cannot use tools"
