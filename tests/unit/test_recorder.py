"""The corpus recorder (passerelle/testing/recorder.py) and its scripted answers (scripted.py):
what a recording keeps and cuts, and the agent turn it plays so that clients send tool results."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import orjson

from passerelle.testing.recorder import PROSE_LIMIT, Recorder, kept_headers, serving, shorten
from passerelle.testing.scripted import answer, example_of

SCHEMA = {"type": "object", "properties": {
    "type": {"type": "string", "description": "x" * 500},
    "unit": {"type": ["string", "null"], "enum": ["c", "f", None]},
    "when": {"anyOf": [{"$ref": "#/$defs/Day"}, {"type": "null"}]},
    "day": {"$ref": "#/$defs/Day"}},
    "required": ["type", "unit", "when", "day"], "$defs": {"Day": {"type": "string", "enum": ["mon", "tue"]}}}


def test_prose_is_cut_and_structure_kept() -> None:
    long = "word " * 200
    body = {"model": "m", "instructions": long, "tools": [
        {"type": "function", "name": "f", "description": long, "parameters": SCHEMA},
        {"type": "function", "function": {"name": "g", "description": "short", "parameters": SCHEMA}}],
        "input": [{"role": "user", "content": [{"type": "input_text", "text": long},
                                               {"type": "input_image", "image_url": "data:image/png;base64,"
                                                + "A" * 5000}]},
                  {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"type": "' + "y" * 300 + '"}'}]}
    out = shorten(body)
    assert out["instructions"].endswith("[1000 chars]") and len(out["instructions"]) < PROSE_LIMIT
    assert out["tools"][0]["description"].endswith("[1000 chars]")
    assert out["tools"][0]["parameters"] == SCHEMA  # schemas verbatim, long descriptions and all
    assert out["tools"][1] == body["tools"][1]
    content = out["input"][0]["content"]
    assert content[0]["text"].endswith("[1000 chars]")
    assert content[1]["image_url"].startswith("data:image/png;base64,iVBOR") and len(content[1]["image_url"]) < 200
    assert out["input"][1] == body["input"][1]  # a tool call's arguments are structure


def test_no_key_in_the_kept_headers() -> None:
    kept = kept_headers([(b"Authorization", b"Bearer sk-1"), (b"x-api-key", b"sk-2"), (b"Content-Type", b"a/b"),
                         (b"anthropic-beta", b"b1"), (b"x-stainless-os", b"Linux"), (b"X-OpenWebUI-User-Id", b"u")])
    assert kept == {"content-type": "a/b", "anthropic-beta": "b1", "x-openwebui-user-id": "u"}


def test_example_of_a_schema() -> None:
    assert example_of(SCHEMA) == {"type": "x", "unit": "c", "when": None, "day": "mon"}
    recursive = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                 "required": ["next"]}
    assert example_of(recursive) == {"next": None}


def test_the_script_calls_a_tool_then_answers() -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "bash", "parameters": {
                 "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
    first = orjson.loads(answer("chat", {"model": "m", "tools": tools,
                                         "messages": [{"role": "user", "content": "hi"}]}).body)
    call = first["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "bash" and orjson.loads(call["arguments"]) == {"command": "echo hello > hello.txt"}
    messages = [{"role": "user", "content": "hi"}, first["choices"][0]["message"],
                {"role": "tool", "tool_call_id": "call_rec1", "content": "ok"}]
    second = orjson.loads(answer("chat", {"model": "m", "tools": tools, "messages": messages}).body)
    assert second["choices"][0]["finish_reason"] == "stop"
    streamed = answer("messages", {"model": "m", "stream": True, "max_tokens": 5, "tools": [
        {"name": "lookup", "input_schema": SCHEMA}], "messages": [{"role": "user", "content": "hi"}]})
    assert streamed.events[0].startswith(b"event: message_start") and b'"stop_reason":"tool_use"' in b"".join(
        streamed.events)


async def test_a_recording(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, "probe", "1.0", literal={"/tmp/secret-place": "/tmp/corpus-work"})
    session = "0a1b2c3d-1111-4222-8333-444455556666"
    async with serving(rec) as url, httpx.AsyncClient(base_url=url) as client:
        body = {"model": "m", "max_tokens": 9, "stream": True, "messages": [{"role": "user", "content": "in "
                                                                             "/tmp/secret-place " + session}]}
        resp = await asyncio.wait_for(client.post("/v1/messages?beta=true", json=body, headers={
            "x-api-key": "sk-ant-secret", "x-claude-code-session-id": session}), 10)
        assert resp.status_code == 200 and b"message_stop" in resp.content
    [path] = sorted(tmp_path.iterdir())
    assert path.name == "001-messages.json"
    record = orjson.loads(path.read_bytes())
    assert record["api"] == "messages" and record["path"] == "/v1/messages?beta=true"
    assert record["client"] == "probe" and record["version"] == "1.0"
    stand_in = "00000000-0000-0000-0000-000000000001"
    assert record["headers"]["x-claude-code-session-id"] == stand_in
    assert record["body"]["messages"][0]["content"] == f"in /tmp/corpus-work {stand_in}"
    assert b"sk-ant" not in path.read_bytes()
