"""Each API's stream as its official SDK helpers read it: where a runtime leaves out fields the API
defines (Responses' ``sequence_number``, ``output_index``, ``content_index``, ``item_id``, as
llama-server does; Messages' ``index``), the relay supplies them, and touches nothing else; an event
that has them all passes byte for byte. Then the openai SDK's ``responses.stream()`` and typed
``responses.create(stream=True)`` events, and the anthropic SDK's ``messages.stream()``, accumulate
through the gateway (in-process, the fake runtime with ``bare_events``)."""

from __future__ import annotations

import anthropic
import httpx2
import openai
import orjson
import pytest

from passerelle.config import TimeoutConfig
from passerelle.observe.record import RequestRecord, State
from passerelle.proxy.grammars import AMENDED, CONTENT, make, with_fields
from passerelle.proxy.relay import StreamRelay
from passerelle.testing.fake_events import Events
from passerelle.testing.fake_runtime import VOCAB
from tests.inprocess import fake_runtime, gateway
from tests.unit.test_relay import Client, FakeResponse, deadline

SUPPLIED = ("sequence_number", "output_index", "content_index", "item_id")


def sse(event: str, obj: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps({"type": event, **obj}) + b"\n\n"


def llama_responses_stream() -> list[bytes]:
    """A Responses stream as llama-server sends one (server-task.cpp): a reasoning item, a message
    and a function call; ``item_id`` on deltas and parts, no index, no sequence number."""
    rid = {"id": "resp_x", "object": "response", "status": "in_progress"}
    reasoning = {"id": "rs_1", "type": "reasoning", "summary": [], "content": [], "encrypted_content": ""}
    message = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
    call = {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "look", "arguments": "",
            "status": "in_progress"}
    text = {"type": "output_text", "text": "Hi there", "annotations": [], "logprobs": []}
    return [
        sse("response.created", {"response": rid}),
        sse("response.in_progress", {"response": rid}),
        sse("response.output_item.added", {"item": reasoning}),
        sse("response.reasoning_text.delta", {"delta": "Hmm", "item_id": "rs_1"}),
        sse("response.reasoning_text.delta", {"delta": " ok", "item_id": "rs_1"}),
        sse("response.output_item.added", {"item": message}),
        sse("response.content_part.added", {"item_id": "msg_1", "part": {"type": "output_text", "text": ""}}),
        sse("response.output_text.delta", {"delta": "Hi", "item_id": "msg_1"}),
        sse("response.output_text.delta", {"delta": " there", "item_id": "msg_1"}),
        sse("response.output_item.added", {"item": call}),
        sse("response.function_call_arguments.delta", {"delta": '{"q":1}', "item_id": "fc_1"}),
        sse("response.output_item.done", {"item": {**reasoning, "content": [{"type": "reasoning_text",
                                                                            "text": "Hmm ok"}]}}),
        sse("response.output_text.done", {"item_id": "msg_1", "text": "Hi there"}),
        sse("response.content_part.done", {"item_id": "msg_1", "part": text}),
        sse("response.output_item.done", {"item": {**message, "status": "completed", "content": [text]}}),
        sse("response.output_item.done", {"item": {**call, "arguments": '{"q":1}', "status": "completed"}}),
        sse("response.completed", {"response": {**rid, "status": "completed", "output": [],
                                                "usage": {"input_tokens": 4, "output_tokens": 6}}}),
    ]


def data(ev: bytes) -> dict:
    return orjson.loads(ev.split(b"data: ", 1)[1])


def events_of(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e.strip()]


async def relayed(stream: list[bytes], grammar: str, *, cuts: int = 7) -> tuple[RequestRecord, bytes]:
    """``stream`` through the relay, cut into reads that split events anywhere."""
    whole = b"".join(stream)
    step = max(1, len(whole) // cuts)
    rec = RequestRecord(id="r", endpoint=grammar, stream=True, backend="b")
    rec.to(State.DISPATCHED)
    client = Client()
    relay = StreamRelay(rec, client, TimeoutConfig(), strip_usage=False, grammar=make(grammar))
    await relay.run(FakeResponse([whole[i:i + step] for i in range(0, len(whole), step)]),
                    deadline(rec, TimeoutConfig()))
    return rec, client.body


async def test_responses_events_get_the_fields_llama_server_leaves_out_and_nothing_else():
    stream = llama_responses_stream()
    rec, body = await relayed(stream, "responses")
    out = [data(e) for e in events_of(body)]
    assert len(out) == len(stream) and rec.content_chunks == 5
    expected = [  # (output_index, content_index, item_id) each event must have; None: not one it has
        (None, None, None), (None, None, None),
        (0, None, None), (0, 0, "rs_1"), (0, 0, "rs_1"),
        (1, None, None), (1, 0, "msg_1"), (1, 0, "msg_1"), (1, 0, "msg_1"),
        (2, None, None), (2, None, "fc_1"),
        (0, None, None), (1, 0, "msg_1"), (1, 0, "msg_1"), (1, None, None), (2, None, None),
        (None, None, None),
    ]
    for n, (ev, sent, (out_i, part_i, item)) in enumerate(zip(out, stream, expected, strict=True)):
        assert ev["sequence_number"] == n
        assert ev.get("output_index") == out_i and ev.get("content_index") == part_i
        assert ev.get("item_id") == item
        # everything else as the runtime sent it, in its order
        assert {k: v for k, v in ev.items() if k not in SUPPLIED} == {
            k: v for k, v in data(sent).items() if k not in SUPPLIED}
        assert sent.split(b"\ndata: ")[0] == events_of(body)[n].split(b"\ndata: ")[0]  # the event line


async def test_complete_responses_and_messages_events_pass_byte_for_byte():
    events = Events(VOCAB)
    for api in ("responses", "messages"):
        stream = [events.head(api, "r1", "m", 3), *(events.token(api, i) for i in range(5)),
                  events.tail(api, "r1", "m", 5, 3)]
        _, body = await relayed(stream, api)
        assert body == b"".join(stream)


async def test_a_delta_without_an_item_id_gets_its_items_and_a_runtime_index_is_kept():
    stream = [
        sse("response.created", {"response": {"id": "r"}}),
        sse("response.output_item.added", {"output_index": 3, "item": {"id": "m\\\"1", "type": "message"}}),
        sse("response.content_part.added", {"content_index": 1, "part": {"type": "output_text", "text": ""}}),
        sse("response.output_text.delta", {"delta": "a"}),
        sse("response.refusal.delta", {"sequence_number": 40, "delta": "no"}),
        sse("response.completed", {"response": {"id": "r"}}),
    ]
    _, body = await relayed(stream, "responses", cuts=2)
    out = [data(e) for e in events_of(body)]
    assert out[1]["output_index"] == 3 and "item_id" not in out[1]  # (an item event names its item inside)
    assert (out[2]["item_id"], out[2]["output_index"], out[2]["content_index"]) == ('m\\"1', 3, 1)
    assert (out[3]["item_id"], out[3]["output_index"], out[3]["content_index"]) == ('m\\"1', 3, 1)
    assert [e["sequence_number"] for e in out] == [0, 1, 2, 3, 40, 5]  # the runtime's own number stays


def bare_messages_stream() -> list[bytes]:
    start = {"message": {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m",
                         "stop_reason": None, "usage": {"input_tokens": 5, "output_tokens": 0}}}
    return [
        sse("message_start", start),
        sse("content_block_start", {"content_block": {"type": "thinking", "thinking": ""}}),
        sse("content_block_delta", {"delta": {"type": "thinking_delta", "thinking": "Hmm \"index\": 9"}}),
        sse("content_block_stop", {}),
        sse("content_block_start", {"content_block": {"type": "text", "text": ""}}),
        sse("content_block_delta", {"delta": {"type": "text_delta", "text": "Hi"}}),
        sse("content_block_stop", {}),
        sse("content_block_start", {"content_block": {"type": "tool_use", "id": "t1", "name": "f", "input": {}}}),
        sse("content_block_delta", {"delta": {"type": "input_json_delta", "partial_json": '{"index": 1}'}}),
        sse("content_block_stop", {}),
        sse("message_delta", {"delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 3}}),
        sse("message_stop", {}),
    ]


async def test_messages_content_block_events_get_their_index():
    stream = bare_messages_stream()
    rec, body = await relayed(stream, "messages")
    out = [data(e) for e in events_of(body)]
    assert [e.get("index") for e in out] == [None, 0, 0, 0, 1, 1, 1, 2, 2, 2, None, None]
    for ev, sent in zip(out, stream, strict=True):
        assert {k: v for k, v in ev.items() if k != "index"} == data(sent)
    assert rec.content_chunks == 3 and rec.completion_tokens == 3


def test_fields_go_first_in_the_data_object_whatever_its_shape():
    assert with_fields(b"data: {}\n\n", b'"a":1') == b'data: {"a":1}\n\n'
    assert with_fields(b"data: { }\r\n\r\n", b'"a":1') == b'data: {"a":1 }\r\n\r\n'
    assert with_fields(b'event: x\ndata:{"b":2}\n\n', b'"a":1') == b'event: x\ndata:{"a":1,"b":2}\n\n'
    assert with_fields(b'data: {\ndata: "b":2}\n\n', b'"a":1') == b'data: {"a":1,\ndata: "b":2}\n\n'
    for odd in (b"data: [DONE]\n\n", b"data: 7\n\n", b"event: x\n\n", b'data: "{"\n\n'):
        assert with_fields(odd, b'"a":1') == odd


def test_a_grammar_completes_only_what_lacks_and_checks_deltas_until_one_is_whole():
    whole = sse("content_block_delta", {"index": 4, "delta": {"type": "text_delta", "text": "x"}})
    bare = sse("content_block_delta", {"delta": {"type": "text_delta", "text": "x"}})
    g = make("messages")
    assert [g.scan(bare), g.scan(bare), g.scan(whole)] == [CONTENT | AMENDED, CONTENT | AMENDED, CONTENT]
    assert g.scan(bare) == CONTENT  # a runtime that sends a delta whole is taken to send all so (the hot path)
    r = make("responses")
    delta = sse("response.output_text.delta", {"delta": "x", "item_id": "m", "output_index": 0, "content_index": 0})
    assert r.scan(delta) == CONTENT | AMENDED  # (its sequence number)
    assert r.scan(b'data: {"sequence_number":1,' + delta.split(b"data: {")[1]) == CONTENT
    assert r.scan(delta) == CONTENT


# -- the SDKs' helpers through the gateway (in-process) ----------------------------------------
def sdk_clients(gw) -> tuple[openai.AsyncOpenAI, anthropic.AsyncAnthropic]:
    def http() -> httpx2.AsyncClient:  # (the SDKs' own HTTP package)
        return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=gw.app), base_url="http://gw")

    return (openai.AsyncOpenAI(base_url="http://gw/v1", api_key="x", http_client=http(), max_retries=0),
            anthropic.AsyncAnthropic(base_url="http://gw", api_key="x", http_client=http(), max_retries=0))


@pytest.mark.parametrize("bare", [True, False], ids=["bare-events", "complete-events"])
async def test_the_sdks_stream_helpers_accumulate_through_the_gateway(bare):
    words = "".join(VOCAB[:9])
    async with fake_runtime(itl_ms=0, bare_events=bare) as fake, \
            gateway(fake.backend_config(kind="llama-server")) as gw:
        oai, claude = sdk_clients(gw)
        async with oai.responses.stream(model="fake-model", input="Hello", max_output_tokens=9) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        assert "".join(deltas) == words and final.output_text == words and final.usage.output_tokens == 9

        typed = [e async for e in await oai.responses.create(model="fake-model", input="Hello",
                                                             max_output_tokens=9, stream=True)]
        assert [e.sequence_number for e in typed] == list(range(len(typed)))
        text = [e for e in typed if e.type == "response.output_text.delta"]
        assert len(text) == 9 and {(e.output_index, e.content_index, e.item_id) for e in text} == {(0, 0, "msg_fake")}
        assert typed[-1].type == "response.completed" and typed[-1].response.output_text == words

        async with claude.messages.stream(model="fake-model", max_tokens=9,
                                          messages=[{"role": "user", "content": "Hello"}]) as ms:
            streamed = "".join([t async for t in ms.text_stream])
            message = await ms.get_final_message()
        assert streamed == words and message.content[0].text == words and message.usage.output_tokens == 9
        assert [r.cause.value for r in gw.records] == ["ok", "ok", "ok"]
