"""Tool-call repair through the gateway (in-process, a scripted runtime that leaves its calls as text,
passerelle/testing/tool_markup.py): on the three APIs, streamed, answered whole, and assembled from
a stream (llama-server); the official SDKs' stream helpers; the metric and the access log; and with
repair off, or without tools, the runtime's bytes exactly."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import orjson
import pytest

from passerelle.config import BackendConfig, ModelConfig
from passerelle.observe.accesslog import AccessLog
from passerelle.proxy import repair as repair_module
from passerelle.testing import tool_markup
from passerelle.testing.answers import tools as offered
from passerelle.testing.scripted import example_of
from passerelle.testing.tool_markup import Reply, scripted_runtime
from tests.inprocess import gateway
from tests.unit.test_stream_fields import sdk_clients
from tests.unit.test_tool_repair import ASK, FORMATS_HERE, SAMPLES, VIEWS, check

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
ENDPOINTS = ("chat", "responses", "messages", "count_tokens")


def script(api: str, text: str, *, cut: int = 1) -> Any:
    """Answers every request with ``text``, a stream's bytes in pieces of ``cut`` bytes."""
    def answer(path: str, body: dict[str, Any]) -> Reply:
        if not body.get("stream"):
            return Reply(json=tool_markup.body(api, text))
        whole = b"".join(tool_markup.stream(api, [text[i:i + 4] for i in range(0, len(text), 4)]))
        return Reply(chunks=[whole[i:i + cut] for i in range(0, len(whole), cut)])
    return answer


def backend(url: str, kind: str = "openai") -> BackendConfig:
    return BackendConfig("rt", kind=kind, url=url, models=("m",), endpoints=ENDPOINTS, max_concurrency=4)


@pytest.mark.parametrize("kind", ["openai", "llama-server"], ids=["whole-or-streamed", "assembled"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize("fmt", FORMATS_HERE)
async def test_calls_left_as_text_arrive_as_tool_calls_through_the_gateway(fmt, api, stream, kind):
    text, _, calls = SAMPLES[fmt]
    async with scripted_runtime(script(api, text, cut=1 if stream else 7)) as url, \
            gateway(backend(url, kind), models=(ModelConfig("m", tool_calls=fmt),)) as gw:
        resp = await gw.post(PATHS[api], {**ASK[api], "stream": stream})
        assert resp.status == 200, resp.body[:300]
        check(api, VIEWS[api](resp.body, stream), fmt)
        rec = gw.records[-1]
        assert rec.cause.value == "ok" and rec.tool_calls_repaired == len(calls) and rec.tool_call_format == fmt
        metrics = (await gw.get("/metrics")).body.decode()
        assert f'passerelle_tool_call_repairs_total{{format="{fmt}",model="m",outcome="repaired"}} ' \
               f"{float(len(calls))}" in metrics


async def test_the_access_log_notes_repairs_and_failures():
    text = SAMPLES["hermes"][0] + '\n<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    out = io.StringIO()
    async with scripted_runtime(script("chat", text)) as url, \
            gateway(backend(url), models=(ModelConfig("m", tool_calls="hermes"),)) as gw:
        gw.app.gateway.access_log = AccessLog(stream=out)
        resp = await gw.post(PATHS["chat"], {**ASK["chat"], "stream": True})
        assert resp.status == 200 and "rm_rf" in "".join(
            ch["delta"].get("content") or "" for e in resp.events()[:-1] for ch in orjson.loads(e)["choices"])
        gw.app.gateway.access_log.flush()
        metrics = (await gw.get("/metrics")).body.decode()
        assert 'passerelle_tool_call_repairs_total{format="hermes",model="m",outcome="unrepaired"} 1.0' in metrics
    line = orjson.loads(out.getvalue().splitlines()[-1])
    assert (line["tool_call_format"], line["tool_calls_repaired"], line["tool_calls_unrepaired"]) == ("hermes", 2, 1)
    assert line["tool_call_failure"]


# -- off: the runtime's bytes ---------------------------------------------------------------------
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_with_repair_off_or_no_tools_the_client_gets_the_runtimes_bytes(api, monkeypatch):
    text = SAMPLES["hermes"][0]
    runtime = b"".join(tool_markup.stream(api, [text[i:i + 4] for i in range(0, len(text), 4)]))

    def untouched(*_: Any) -> None:
        raise AssertionError("repair ran for a request it is off for")

    monkeypatch.setattr(repair_module.Channel, "__init__", untouched)  # (no parse of anything when off)
    ask = {**ASK[api], "stream": True}
    if api == "chat":
        ask["stream_options"] = {"include_usage": True}  # (else the gateway removes the usage chunk)
    no_tools = {k: v for k, v in ask.items() if k != "tools"}
    for model, body in ((ModelConfig("m"), ask), (ModelConfig("m", tool_calls="off"), ask),
                        (ModelConfig("m", tool_calls="hermes"), no_tools)):
        async with scripted_runtime(script(api, text, cut=5)) as url, gateway(backend(url), models=(model,)) as gw:
            resp = await gw.post(PATHS[api], body)
            assert resp.status == 200 and resp.body == runtime
            whole = await gw.post(PATHS[api], {**body, "stream": False})
            assert whole.body == tool_markup.body(api, text)
            assert all(r.tool_call_format == "" and r.tool_calls_repaired == 0 for r in gw.records)


# -- the SDKs' stream helpers ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS_HERE)
async def test_the_sdks_stream_helpers_take_the_repaired_calls(fmt):
    text, said, calls = SAMPLES[fmt]
    answers = {"/v1/chat/completions": script("chat", text), "/v1/responses": script("responses", text),
               "/v1/messages": script("messages", text)}
    async with scripted_runtime(lambda path, body: answers[path](path, body)) as url, \
            gateway(backend(url), models=(ModelConfig("m", tool_calls=fmt),)) as gw:
        oai, claude = sdk_clients(gw)
        async with oai.chat.completions.stream(model="m", messages=ASK["chat"]["messages"],
                                               tools=ASK["chat"]["tools"]) as cs:
            async for _ in cs:
                pass
            completion = await cs.get_final_completion()
        msg = completion.choices[0].message
        assert [orjson.loads(c.function.arguments) for c in msg.tool_calls] == calls
        assert (msg.content or "") == said and completion.choices[0].finish_reason == "tool_calls"

        async with oai.responses.stream(model="m", input="Weather?", tools=ASK["responses"]["tools"]) as rs:
            done = [e async for e in rs if e.type == "response.function_call_arguments.done"]
            final = await rs.get_final_response()
        assert [orjson.loads(e.arguments) for e in done] == calls
        assert [orjson.loads(i.arguments) for i in final.output if i.type == "function_call"] == calls
        assert final.output_text == said

        async with claude.messages.stream(model="m", max_tokens=64, messages=ASK["messages"]["messages"],
                                          tools=ASK["messages"]["tools"]) as ms:
            async for _ in ms:
                pass
            message = await ms.get_final_message()
        assert [b.input for b in message.content if b.type == "tool_use"] == calls
        assert message.stop_reason == "tool_use"
        assert [r.cause.value for r in gw.records] == ["ok", "ok", "ok"]


# -- what real clients send (the corpus), repaired ----------------------------------------------------
CORPUS = sorted((Path(__file__).resolve().parent.parent / "corpus").glob("*/*.json"))


def corpus_turns() -> list[tuple[str, str, dict[str, Any]]]:
    """(name, api, body) of every recorded request that offers a function tool and lets it be called."""
    out = []
    for path in CORPUS:
        rec = orjson.loads(path.read_bytes())
        body, api = rec.get("body"), rec.get("api")
        choice = body.get("tool_choice") if isinstance(body, dict) else None
        if choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none"):
            continue  # (no call may be made: nothing is repaired, test_tool_repair.py)
        if api in PATHS and isinstance(body, dict) and any(kind == "function" for kind, _, _ in offered(body)):
            out.append((f"{path.parent.name}/{path.name}", api, body))
    return out


TURNS = corpus_turns()


@pytest.mark.parametrize(("name", "api", "body"), TURNS, ids=[t[0] for t in TURNS])
async def test_the_tools_real_clients_offer_are_called_through_repair(name, api, body):
    """Claude Code's, Codex's, opencode's, the SDKs' and frameworks' recorded requests, to a model
    whose runtime answers with a Hermes call of the first tool offered (its arguments an instance of
    the tool's own schema): the client gets that call as its API's tool call."""
    _, tool, schema = next(t for t in offered(body) if t[0] == "function")
    args = example_of(schema) if schema else {}
    text = "<tool_call>\n" + orjson.dumps({"name": tool, "arguments": args}).decode() + "\n</tool_call>"
    async with scripted_runtime(script(api, text, cut=64)) as url, \
            gateway(backend(url), models=(ModelConfig(str(body.get("model")), served_name="m",
                                                      tool_calls="hermes"),)) as gw:
        resp = await gw.post(PATHS[api], body)
        assert resp.status == 200, resp.body[:300]
        view = VIEWS[api](resp.body, bool(body.get("stream")))
        assert view.calls == [(tool, args)] and not view.text.strip()
        assert gw.records[-1].tool_calls_repaired == 1
