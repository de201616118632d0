"""Tool calls a runtime left as text, delivered as each API's own (proxy/repair.py, repair_stream.py).

For each format, a runtime's text with its calls (:data:`SAMPLES`) goes through the relay on the
three APIs, the text cut between every two characters (two deltas) and one character a delta, the
runtime's bytes read one byte at a time: every call arrives as a tool call with valid arguments,
no markup is left in the text, and the client's view is the same whatever the cuts. Then through
the gateway (in-process, a scripted runtime): streamed, whole, and assembled from a stream; the
official SDKs' stream helpers; repair off (byte-identical) and a runtime that parsed the calls itself
(untouched); markup that cannot be repaired (passed through, counted).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from passerelle.config import TimeoutConfig
from passerelle.errors import UpstreamError
from passerelle.observe.record import RequestRecord, State
from passerelle.proxy.assemble import assemble
from passerelle.proxy.assemble_events import assemble_events
from passerelle.proxy.grammars import make
from passerelle.proxy.relay import StreamRelay
from passerelle.proxy.repair import ToolRepair, repair_body, repair_for
from passerelle.proxy.repair_stream import stream_repair
from passerelle.proxy.sse_scan import SSEScanner
from passerelle.proxy.toolcalls import FORMATS, Reasoning, Text, ToolCall, Unrepaired
from passerelle.testing import tool_markup
from tests.jsonvalues import STREAMS_OUT, decoded, encode, mutated, sse
from tests.unit.test_fuzz_readers import FUZZ, request_body
from tests.unit.test_relay import Client, FakeResponse, deadline
from tests.unit.toolcalls_cases import CASES
from tests.unit.toolcalls_cases import TOOLS as CASE_TOOLS

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "required": ["city"], "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
MESSAGES_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                   "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
ASK = {"chat": {"model": "m", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS},
       "responses": {"model": "m", "input": "Weather?", "tools": RESPONSES_TOOLS},
       "messages": {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Weather?"}],
                    "tools": MESSAGES_TOOLS}}
PARIS, LYON = {"city": "Paris", "days": 2}, {"city": "Lyon", "days": 1}

# What a model writes in each format (from the formats' documentation), the text the client
# should see of it, and its calls. The XML formats' values are untyped: "2" is coerced to 2.
SAMPLES: dict[str, tuple[str, str, list[dict[str, Any]]]] = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "days": 1}}\n'
               "</tool_call>", "Let me check.", [PARIS, LYON]),
    "qwen3-xml": ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>", "Checking.", [PARIS]),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_weather", "arguments": {"city": "Lyon", "days": 1}}]', "", [PARIS, LYON]),
    "llama3": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "", [PARIS]),
    "harmony": ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Paris", "days": 2}<|call|>', "", [PARIS]),
}
FORMATS_HERE = [f for f in SAMPLES if f in FORMATS]
MARKUP = ("<tool_call", "</tool_call", "<function=", "<parameter", "[TOOL_CALLS]", "<|python_tag|>", "<|channel|>",
          "<|call|>", "<|message|>", '"arguments"', '"parameters"')


def record(api: str, stream: bool = True) -> RequestRecord:
    rec = RequestRecord(id="r", endpoint=api, stream=stream, backend="b")
    rec.to(State.DISPATCHED)
    return rec


def repair_of(fmt: str, api: str, rec: RequestRecord) -> ToolRepair:
    repair = repair_for(fmt, api, ASK[api], rec)
    assert repair is not None
    return repair


def events_of(body: bytes) -> list[dict[str, Any]]:
    out = []
    for ev in body.split(b"\n\n"):
        data = [line[5:].strip() for line in ev.split(b"\n") if line.startswith(b"data:")]
        if data and data[0] != b"[DONE]":
            out.append(orjson.loads(b"\n".join(data)))
    return out


# -- what a client makes of an answer -------------------------------------------------------------
@dataclasses.dataclass
class View:
    text: str
    calls: list[tuple[str, Any]]  # (name, arguments decoded)
    ids: list[str]
    end: Any  # finish_reason / the completed response's status / stop_reason


def chat_view(body: bytes, stream: bool) -> View:
    if not stream:
        obj = orjson.loads(body)
        choice = obj["choices"][0]
        msg = choice["message"]
        calls = msg.get("tool_calls") or []
        if calls:
            assert msg["content"] is None or msg["content"].strip()
        return View(msg["content"] or "", [(c["function"]["name"], orjson.loads(c["function"]["arguments"]))
                                           for c in calls], [c["id"] for c in calls], choice["finish_reason"])
    text, calls, finish = [], {}, None
    for ev in events_of(body):
        for ch in ev.get("choices") or ():
            delta = ch["delta"]
            text.append(delta.get("content") or "")
            for tc in delta.get("tool_calls") or ():
                if tc["index"] not in calls:
                    assert tc["id"].startswith("call_") and tc["type"] == "function" and tc["function"]["name"]
                    calls[tc["index"]] = [tc["id"], tc["function"]["name"], ""]
                calls[tc["index"]][2] += tc["function"].get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    ordered = [calls[i] for i in sorted(calls)]
    assert sorted(calls) == list(range(len(calls)))
    return View("".join(text), [(n, orjson.loads(a)) for _, n, a in ordered], [i for i, _, _ in ordered], finish)


def responses_output_view(output: list[dict[str, Any]], status: Any) -> View:
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [item for item in output if item["type"] == "function_call"]
    return View(text, [(c["name"], orjson.loads(c["arguments"])) for c in calls], [c["call_id"] for c in calls],
                status)


def responses_view(body: bytes, stream: bool) -> View:
    if not stream:
        obj = orjson.loads(body)
        return responses_output_view(obj["output"], obj["status"])
    events = events_of(body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done: dict[int, dict[str, Any]] = {}
    added: dict[int, str] = {}
    deltas: dict[str, list[str]] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(added)  # items numbered in the order they come
            added[e["output_index"]] = e["item"]["id"]
        elif e["type"] == "response.output_item.done":
            assert added[e["output_index"]] == e["item"]["id"]
            done[e["output_index"]] = e["item"]
        elif e["type"].endswith(".delta"):
            assert added[e["output_index"]] == e["item_id"]
            deltas.setdefault(e["item_id"], []).append(e["delta"])
    completed = events[-1]
    assert completed["type"] == "response.completed"
    output = [done[i] for i in sorted(done)]
    assert completed["response"]["output"] == output
    for item in output:  # the deltas say what the item says
        said = "".join(deltas.get(item["id"], []))
        assert said == (item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"])
    return responses_output_view(output, completed["response"]["status"])


def messages_blocks_view(blocks: list[dict[str, Any]], stop: Any) -> View:
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    calls = [b for b in blocks if b["type"] == "tool_use"]
    assert all(c["id"].startswith("toolu_") for c in calls)
    return View(text, [(c["name"], c["input"]) for c in calls], [c["id"] for c in calls], stop)


def messages_view(body: bytes, stream: bool) -> View:
    if not stream:
        obj = orjson.loads(body)
        return messages_blocks_view(obj["content"], obj["stop_reason"])
    blocks: dict[int, dict[str, Any]] = {}
    stop, open_ = None, set()
    for e in events_of(body):
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks) and not open_
            blocks[e["index"]] = {**e["content_block"], "json": ""}
            open_.add(e["index"])
        elif e["type"] == "content_block_delta":
            assert e["index"] in open_
            d = e["delta"]
            if d["type"] == "text_delta":
                blocks[e["index"]]["text"] += d["text"]
            elif d["type"] == "input_json_delta":
                blocks[e["index"]]["json"] += d["partial_json"]
        elif e["type"] == "content_block_stop":
            open_.remove(e["index"])
        elif e["type"] == "message_delta":
            stop = e["delta"]["stop_reason"]
    assert not open_
    for b in blocks.values():
        if b["type"] == "tool_use":
            b["input"] = orjson.loads(b["json"])
    return messages_blocks_view([blocks[i] for i in sorted(blocks)], stop)


VIEWS = {"chat": chat_view, "responses": responses_view, "messages": messages_view}
ENDS = {"chat": "tool_calls", "responses": "completed", "messages": "tool_use"}


def check(api: str, view: View, fmt: str) -> None:
    _, said, calls = SAMPLES[fmt]
    assert [c for _, c in view.calls] == calls and all(n == "get_weather" for n, _ in view.calls)
    assert len(set(view.ids)) == len(view.ids)
    assert view.text.strip() == said
    assert not [m for m in MARKUP if m in view.text]
    assert view.end == ENDS[api]


async def relayed(api: str, events: list[bytes], repair: ToolRepair | None, rec: RequestRecord,
                  parts: list[bytes] | None = None) -> bytes:
    whole = b"".join(events)
    client = Client()
    relay = StreamRelay(rec, client, TimeoutConfig(), strip_usage=False, grammar=make(api),
                        repair=stream_repair(repair, api) if repair is not None else None)
    await relay.run(FakeResponse(parts if parts is not None else [whole]), deadline(rec, TimeoutConfig()))
    return client.body


# -- the relay, cut everywhere ----------------------------------------------------------------------
@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize("fmt", FORMATS_HERE)
async def test_every_call_arrives_as_a_tool_call_wherever_the_text_is_cut(fmt, api):
    text, _, calls = SAMPLES[fmt]
    cuts = [[text[:k], text[k:]] for k in range(1, len(text))] + [list(text)]
    seen = set()
    for deltas in cuts:
        rec = record(api)
        body = await relayed(api, tool_markup.stream(api, deltas), repair_of(fmt, api, rec), rec)
        view = VIEWS[api](body, True)
        check(api, view, fmt)
        assert rec.tool_calls_repaired == len(calls) and rec.tool_calls_unrepaired == 0
        seen.add((view.text, repr(view.calls)))
    assert len(seen) == 1  # the same answer, whatever the cuts


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize("fmt", FORMATS_HERE)
async def test_the_runtimes_bytes_read_one_at_a_time(fmt, api):
    text, _, _ = SAMPLES[fmt]
    events = tool_markup.stream(api, [text[i:i + 3] for i in range(0, len(text), 3)])
    whole = b"".join(events)
    rec = record(api)
    body = await relayed(api, events, repair_of(fmt, api, rec), rec, [whole[i:i + 1] for i in range(len(whole))])
    check(api, VIEWS[api](body, True), fmt)
    assert rec.content_chunks > 0 and rec.state is State.STREAMING


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize("fmt", FORMATS_HERE)
def test_a_whole_answer_is_repaired(fmt, api):
    rec = record(api, stream=False)
    raw = tool_markup.body(api, SAMPLES[fmt][0])
    check(api, VIEWS[api](repair_body(repair_of(fmt, api, rec), api, raw), False), fmt)
    assert rec.tool_calls_repaired == len(SAMPLES[fmt][2])


def test_calls_in_reasoning_are_repaired_too():
    text, _, calls = SAMPLES["hermes"]
    for where in ("reasoning_content", "reasoning"):
        rec = record("chat", stream=False)
        out = orjson.loads(repair_body(repair_of("hermes", "chat", rec), "chat", tool_markup.body(
            "chat", text, where=where)))["choices"][0]
        assert [orjson.loads(c["function"]["arguments"]) for c in out["message"]["tool_calls"]] == calls
        assert out["message"][where] == "Let me check." and out["finish_reason"] == "tool_calls"


async def test_calls_in_a_reasoning_stream_are_repaired():
    text, _, calls = SAMPLES["hermes"]
    rec = record("chat")
    body = await relayed("chat", tool_markup.stream("chat", list(text), where="reasoning_content"),
                         repair_of("hermes", "chat", rec), rec)
    view = chat_view(body, True)
    assert [c for _, c in view.calls] == calls and view.end == "tool_calls"
    reasoning = "".join(ch["delta"].get("reasoning_content") or "" for e in events_of(body)
                        for ch in e.get("choices") or ())
    assert reasoning == "Let me check."


# -- what is left alone -------------------------------------------------------------------------------
def test_no_repair_without_tools_or_when_off():
    rec = record("chat")
    assert repair_for("off", "chat", ASK["chat"], rec) is None
    assert repair_for("hermes", "chat", {**ASK["chat"], "tools": []}, rec) is None
    assert repair_for("hermes", "completions", ASK["chat"], rec) is None
    assert repair_for("hermes", "chat", {**ASK["chat"], "tool_choice": "none"}, rec) is None  # (no call may be made)
    assert repair_for("hermes", "messages", {**ASK["messages"], "tool_choice": {"type": "none"}}, rec) is None
    assert rec.tool_call_format == ""


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_text_without_markup_passes_as_the_runtimes_bytes(api):
    rec = record(api)
    events = tool_markup.stream(api, ["The weather", " is fine", " today."])
    off = await relayed(api, events, None, record(api))
    on = await relayed(api, events, repair_of("hermes", api, rec), rec)
    assert VIEWS[api](on, True).text == "The weather is fine today."
    if api == "chat":
        assert on == off  # (no event's text changed: each passes as it came)
    assert rec.tool_calls_repaired == rec.tool_calls_unrepaired == 0


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_markup_that_cannot_be_repaired_passes_through_as_text(api):
    bad = '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>'
    rec = record(api)
    body = await relayed(api, tool_markup.stream(api, [bad[:9], bad[9:]]), repair_of("hermes", api, rec), rec)
    view = VIEWS[api](body, True)
    assert view.text == bad and not view.calls
    assert rec.tool_calls_unrepaired == 1 and rec.tool_calls_repaired == 0 and rec.tool_call_failure
    rec = record(api, stream=False)
    out = repair_body(repair_of("hermes", api, rec), api, tool_markup.body(api, bad))
    assert out == tool_markup.body(api, bad) and rec.tool_calls_unrepaired == 1


async def test_a_runtime_that_made_the_calls_itself_is_left_untouched():
    from passerelle.testing.answers import Call, Turn, build
    turn = Turn(call=Call("get_weather", '{"city": "Paris"}', "call_rt1"))
    for api in ("chat", "responses", "messages"):
        events = build(api, {**ASK[api], "stream": True}, turn).events
        rec = record(api)
        assert await relayed(api, events, repair_of("hermes", api, rec), rec) == \
            await relayed(api, events, None, record(api))
        whole = build(api, ASK[api], turn).body
        assert repair_body(repair_of("hermes", api, record(api, False)), api, whole) == whole


HARMONY = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
           'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>')


def said_as_reasoning(api: str, body: bytes, stream: bool) -> str:
    """The reasoning a client gets: chat's reasoning_content, Responses' reasoning items, Messages' thinking."""
    if not stream:
        obj = orjson.loads(body)
        if api == "chat":
            return str(obj["choices"][0]["message"].get("reasoning_content"))
        if api == "responses":
            return "".join(c["text"] for i in obj["output"] if i["type"] == "reasoning" for c in i["content"])
        return "".join(b["thinking"] for b in obj["content"] if b["type"] == "thinking")
    if api == "chat":
        return "".join(ch["delta"].get("reasoning_content") or "" for e in events_of(body) for ch in e["choices"])
    if api == "responses":
        done = [e["item"] for e in events_of(body) if e["type"] == "response.output_item.done"]
        deltas = "".join(e["delta"] for e in events_of(body) if e["type"] == "response.reasoning_text.delta")
        assert deltas == "".join(c["text"] for i in done if i["type"] == "reasoning" for c in i["content"])
        return deltas
    return "".join(e["delta"]["thinking"] for e in events_of(body) if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "thinking_delta")


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_harmonys_analysis_is_said_as_reasoning_and_its_call_as_a_call(api):
    for deltas in ([HARMONY[:k], HARMONY[k:]] for k in range(1, len(HARMONY), 7)):
        rec = record(api)
        body = await relayed(api, tool_markup.stream(api, deltas), repair_of("harmony", api, rec), rec)
        view = VIEWS[api](body, True)
        assert [c for _, c in view.calls] == [PARIS] and view.text == "" and view.end == ENDS[api]
        assert said_as_reasoning(api, body, True) == "Need the weather."
    rec = record(api, stream=False)
    body = repair_body(repair_of("auto", api, rec), api, tool_markup.body(api, HARMONY))
    assert [c for _, c in VIEWS[api](body, False).calls] == [PARIS]
    assert said_as_reasoning(api, body, False) == "Need the weather." and rec.tool_call_format == "harmony"


# -- any runtime output: never a gateway exception -----------------------------------------------------
REPAIR_FUZZ = settings(FUZZ, max_examples=int(os.environ.get("FUZZ_EXAMPLES", "40")))


def _template(api: str) -> list[list[Any]]:
    """The scripted stream (with calls in its text) as a [event, data] template, plus the runtimes'
    usual events of that API (tool calls of their own, thinking, usage)."""
    out: list[list[Any]] = []
    for ev in tool_markup.stream(api, [SAMPLES["hermes"][0][:30], SAMPLES["hermes"][0][30:]]):
        name = ev.split(b"\n")[0][7:].decode() if ev.startswith(b"event:") else ""
        data = ev.split(b"data: ", 1)[1].strip()
        out.append([name, data.decode() if data == b"[DONE]" else orjson.loads(data)])
    return out + STREAMS_OUT.get(api, [])


@REPAIR_FUZZ
@given(data=st.data())
def test_any_runtime_stream_is_repaired_or_passed_never_an_exception(data):
    for api in ("chat", "responses", "messages"):
        raw = sse(data.draw(mutated(_template(api), most=4)))
        events = SSEScanner().feed(raw)
        repairer = stream_repair(repair_of("auto", api, record(api)), api)
        out: list[bytes] = []
        try:
            for ev in events:
                out += repairer.feed([ev])
        except UpstreamError:  # (the runtime's fault, told as such: JSON nested past what can be written)
            continue
        assert all(isinstance(ev, bytes) and ev.endswith(b"\n\n") for ev in out)
        grammar = make(api)
        for ev in out:
            assert isinstance(grammar.scan(ev) if grammar is not None else 0, int)
        try:
            body = assemble(b"".join(out), api) if api == "chat" else assemble_events(b"".join(out), api)
        except UpstreamError:
            continue
        assert isinstance(orjson.loads(body), dict)


@REPAIR_FUZZ
@given(data=st.data())
def test_any_whole_answer_is_repaired_or_passed_never_an_exception(data):
    for api in ("chat", "responses", "messages"):
        obj = data.draw(mutated(orjson.loads(tool_markup.body(api, SAMPLES["hermes"][0])), most=4))
        raw = encode(obj)
        out = repair_body(repair_of("auto", api, record(api, False)), api, raw)
        assert out == raw or isinstance(orjson.loads(out), dict)


@REPAIR_FUZZ
@given(data=st.data())
async def test_any_cuts_give_the_same_answer(data):
    """Hypothesis over the cuts: the text in deltas cut anywhere, the bytes read in pieces cut anywhere."""
    fmt = data.draw(st.sampled_from(FORMATS_HERE))
    api = data.draw(st.sampled_from(["chat", "responses", "messages"]))
    text = SAMPLES[fmt][0]
    at = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12)))
    deltas = [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)]
    whole = b"".join(tool_markup.stream(api, deltas))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(whole) - 1), max_size=40)))
    parts = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=True)]
    rec = record(api)
    body = await relayed(api, [whole], repair_of(fmt, api, rec), rec, parts)
    check(api, VIEWS[api](body, True), fmt)


# -- what clients really send: every request of the corpus, and any request ----------------------------
CORPUS = sorted((Path(__file__).resolve().parent.parent / "corpus").glob("*/*.json"))


def test_the_tools_real_clients_offer_are_read_for_repair():
    """Claude Code's, Codex's (custom and built-in tools too), opencode's, the SDKs' and frameworks'
    tools: each request offering tools gets a repair, whose parser takes text."""
    offered = 0
    for path in CORPUS:
        rec = orjson.loads(path.read_bytes())
        body = rec.get("body")
        if rec.get("api") not in ("chat", "responses", "messages") or not isinstance(body, dict):
            continue
        repair = repair_for("auto", rec["api"], body, record(rec["api"]))
        if repair is not None:
            offered += 1
            channel = repair.channel()
            assert "".join(map(str, channel.feed("Hello <tool") + channel.finish())) == "Hello <tool"
    assert offered >= 10


@REPAIR_FUZZ
@given(data=st.data())
def test_any_request_gets_a_repair_or_none_never_an_exception(data):
    for api in ("chat", "responses", "messages"):
        body = data.draw(request_body(api))
        try:
            body = decoded(body)
        except orjson.JSONDecodeError:
            continue
        if isinstance(body, dict):
            repair = repair_for("auto", api, body, record(api))
            assert repair is None or isinstance(repair.tools, list)


def llama_responses(text: str, *, ended: bool = True) -> list[bytes]:
    """A Responses stream as llama-server writes one: no sequence numbers nor indexes, ``item_id``
    alone on deltas and parts, a reasoning item whose done comes last, ``response.completed`` with
    no output; ``ended=False``: the message's done events left out."""
    def ev(kind: str, **fields: Any) -> bytes:
        return tool_markup.sse({"type": kind, **fields}, kind)

    rid = {"id": "resp_x", "object": "response", "status": "in_progress"}
    reasoning = {"id": "rs_1", "type": "reasoning", "summary": [], "content": [], "encrypted_content": ""}
    message = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": text, "annotations": []}
    out = [ev("response.created", response=rid), ev("response.output_item.added", item=reasoning),
           ev("response.reasoning_text.delta", item_id="rs_1", delta="Hmm"),
           ev("response.output_item.added", item=message),
           ev("response.content_part.added", item_id="msg_1", part={**part, "text": ""}),
           *(ev("response.output_text.delta", item_id="msg_1", delta=text[i:i + 5]) for i in range(0, len(text), 5))]
    if ended:
        out += [ev("response.output_text.done", item_id="msg_1", text=text),
                ev("response.content_part.done", item_id="msg_1", part=part),
                ev("response.output_item.done", item={**message, "status": "completed", "content": [part]})]
    return [*out, ev("response.output_item.done", item={**reasoning, "content": [{"type": "reasoning_text",
                                                                                  "text": "Hmm"}]}),
            ev("response.completed", response={**rid, "status": "completed", "output": [],
                                               "usage": {"input_tokens": 4, "output_tokens": 6}})]


@pytest.mark.parametrize("ended", [True, False], ids=["ended", "message-never-done"])
async def test_llama_servers_responses_stream_is_repaired_into_a_consistent_one(ended):
    rec = record("responses")
    body = await relayed("responses", llama_responses(SAMPLES["hermes"][0], ended=ended),
                         repair_of("hermes", "responses", rec), rec)
    check("responses", responses_view(body, True), "hermes")
    done = [e["item"]["type"] for e in events_of(body) if e["type"] == "response.output_item.done"]
    assert done == ["message", "function_call", "function_call", "reasoning"]


async def test_a_messages_stream_without_its_text_blocks_stop_is_repaired():
    events = [ev for ev in tool_markup.stream("messages", list(SAMPLES["hermes"][0]))
              if b"content_block_stop" not in ev]
    rec = record("messages")
    body = await relayed("messages", events, repair_of("hermes", "messages", rec), rec)
    check("messages", messages_view(body, True), "hermes")


async def test_the_counts_are_those_of_the_attempt_the_client_gets():
    """A retry (another replica, before the client got a byte) repairs its own answer: the record
    counts its calls, not those of both attempts."""
    rec = record("chat")
    repair = repair_of("hermes", "chat", rec)
    for _ in range(2):
        await relayed("chat", tool_markup.stream("chat", [SAMPLES["hermes"][0]]), repair, record("chat"))
    assert rec.tool_calls_repaired == 2
    repair_body(repair, "chat", tool_markup.body("chat", SAMPLES["hermes"][0]))
    assert rec.tool_calls_repaired == 2 and rec.tool_call_format == "hermes"


async def test_each_choice_of_a_chat_stream_is_repaired_on_its_own():
    text = SAMPLES["hermes"][0]
    one = tool_markup.stream("chat", [text[i:i + 6] for i in range(0, len(text), 6)])
    events = []
    for ev in one:  # the same deltas for choice 0 and choice 1, interleaved
        events.append(ev)
        if b'"choices":[{' in ev:
            events.append(ev.replace(b'"index":0', b'"index":1'))
    rec = record("chat")
    body = await relayed("chat", events, repair_of("hermes", "chat", rec), rec)
    for n in (0, 1):
        mine = b"".join(b"data: " + orjson.dumps({**e, "choices": [c for c in e["choices"] if c["index"] == n]})
                        + b"\n\n" for e in events_of(body) if e.get("choices"))
        check("chat", chat_view(mine, True), "hermes")
    assert rec.tool_calls_repaired == 4


async def test_a_call_held_longer_than_the_between_tokens_limit_is_not_a_timeout():
    """A long call (an agent writing a file) is held until its markup ends, and nothing goes to the
    client meanwhile: the runtime's text still counts as tokens for the between-tokens deadline."""
    text = SAMPLES["hermes"][0]
    events = tool_markup.stream("chat", [text[i:i + 10] for i in range(0, len(text), 10)])
    timeouts = TimeoutConfig(first_token_s=5.0, between_tokens_s=0.2)
    rec = record("chat")
    client = Client()
    relay = StreamRelay(rec, client, timeouts, strip_usage=False, grammar=None,
                        repair=stream_repair(repair_of("hermes", "chat", rec), "chat"))
    # one event every 0.05 s: 1.3 s in all, far past 0.2 s between two events the client gets
    await relay.run(FakeResponse(events, delays=[0.05] * len(events)), deadline(rec, timeouts))
    check("chat", chat_view(client.body, True), "hermes")


# -- every model output of the parsers' cases (tests/unit/toolcalls_cases.py) on the three APIs ------------
def asked(api: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    shaped = {"chat": [{"type": "function", "function": t} for t in tools],
              "responses": [{"type": "function", **t} for t in tools],
              "messages": [{"name": t["name"], "input_schema": t["parameters"]} for t in tools]}[api]
    return {**ASK[api], "tools": shaped}


def _bare(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_every_case_of_every_format_on_every_api(case, api):
    """The calls a case means arrive as the API's calls (Messages: those whose arguments are an
    object), its text and its markup that could not be repaired as text (whitespace next to a call
    aside), its reasoning as reasoning; streamed one character a delta, and whole, alike."""
    calls = [(p.name, orjson.loads(p.arguments)) for p in case.pieces if isinstance(p, ToolCall)]
    text = _bare("".join(p.text for p in case.pieces if isinstance(p, Text | Unrepaired)))
    thought = _bare("".join(p.text for p in case.pieces if isinstance(p, Reasoning)))
    ask = asked(api, CASE_TOOLS)
    views = []
    for stream in (True, False):
        rec = record(api, stream)
        repair = repair_for(case.fmt, api, ask, rec)
        assert repair is not None
        if stream:
            body = await relayed(api, tool_markup.stream(api, list(case.text)), repair, rec)
        else:
            body = repair_body(repair, api, tool_markup.body(api, case.text))
        view = VIEWS[api](body, stream)
        assert view.calls == calls and len(set(view.ids)) == len(view.ids)
        assert _bare(view.text) == text
        assert _bare(said_as_reasoning(api, body, stream).replace("None", "")) == thought
        assert rec.tool_calls_repaired == len(calls)
        assert rec.tool_calls_unrepaired == sum(isinstance(p, Unrepaired) for p in case.pieces)
        views.append((view.text.strip(), view.calls, view.end))
    assert views[0] == views[1]
