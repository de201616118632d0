"""Each API's stream grammar (grammars.py), the relay reading through it, and the non-streaming
answers assembled from those streams (assemble_events.py). Events as llama-server and the
OpenAI / Anthropic APIs send them."""


import orjson
import pytest

from passerelle.config import TimeoutConfig
from passerelle.errors import UpstreamError, UpstreamStatus
from passerelle.observe.record import RequestRecord, State
from passerelle.proxy import grammars
from passerelle.proxy.assemble import assemble
from passerelle.proxy.assemble_events import assemble_events
from passerelle.proxy.grammars import AMENDED, CONTENT, END, ERROR, make
from passerelle.proxy.relay import StreamRelay
from tests.unit.test_relay import Client, FakeResponse, deadline


def sse(event: str | None, obj) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


def responses_stream(deltas=("Hel", "lo"), *, end="response.completed") -> list[bytes]:
    """Events with every field the API defines (a runtime's complete events pass untouched)."""
    resp = {"id": "resp_1", "object": "response", "status": "in_progress"}
    at = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    out = [sse("response.created", {"type": "response.created", "sequence_number": 0, "response": resp}),
           sse("response.output_item.added", {"type": "response.output_item.added", "sequence_number": 1,
                                              "output_index": 0, "item": {"type": "message", "id": "msg_1"}})]
    out += [sse("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 2 + i,
                                               **at, "delta": d}) for i, d in enumerate(deltas)]
    done = {**resp, "status": "completed", "output": [{"type": "message", "content": [
        {"type": "output_text", "text": "".join(deltas)}]}], "usage": {"input_tokens": 9, "output_tokens": 2}}
    out.append(sse(end, {"type": end, "sequence_number": 2 + len(deltas), "response": done}))
    return out


def messages_stream() -> list[bytes]:
    return [
        sse("message_start", {"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m", "stop_reason": None,
            "usage": {"input_tokens": 5, "cache_read_input_tokens": 20, "output_tokens": 0}}}),
        sse("content_block_start", {"type": "content_block_start", "index": 0,
                                    "content_block": {"type": "thinking", "thinking": ""}}),
        sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                    "delta": {"type": "thinking_delta", "thinking": "Hmm"}}),
        sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                    "delta": {"type": "signature_delta", "signature": "c2ln"}}),
        sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        sse("ping", {"type": "ping"}),
        sse("content_block_start", {"type": "content_block_start", "index": 1,
                                    "content_block": {"type": "text", "text": ""}}),
        sse("content_block_delta", {"type": "content_block_delta", "index": 1,
                                    "delta": {"type": "text_delta", "text": "Hi"}}),
        sse("content_block_start", {"type": "content_block_start", "index": 2, "content_block": {
            "type": "tool_use", "id": "t1", "name": "look", "input": {}}}),
        sse("content_block_delta", {"type": "content_block_delta", "index": 2,
                                    "delta": {"type": "input_json_delta", "partial_json": '{"q": '}}),
        sse("content_block_delta", {"type": "content_block_delta", "index": 2,
                                    "delta": {"type": "input_json_delta", "partial_json": '"x"}'}}),
        sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                              "usage": {"output_tokens": 7}}),
        sse("message_stop", {"type": "message_stop"}),
    ]


def test_responses_grammar():
    g = make("responses")
    flags = [g.scan(ev) for ev in responses_stream()]
    assert flags == [0, 0, CONTENT, CONTENT, END]
    assert (g.prompt_tokens, g.completion_tokens) == (9, 2)
    for kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta",
                 "response.function_call_arguments.delta"):
        assert make("responses").scan(sse(kind, {"type": kind, "delta": "x"})) & ~AMENDED == CONTENT
    assert make("responses").scan(sse("response.failed", {"type": "response.failed", "response": {}})) & ~AMENDED \
        == END | ERROR
    assert make("responses").scan(sse("error", {"type": "error", "message": "x"})) == END | ERROR
    # llama-server's mid-stream error on this route: OpenAI's shape, no event line
    assert make("responses").scan(sse(None, {"error": {"type": "server_error", "message": "x"}})) == END | ERROR
    # no event line at all: the type comes from the data
    assert make("responses").scan(sse(None, {"type": "response.output_text.delta", "delta": "x"})) & ~AMENDED \
        == CONTENT


def test_messages_grammar_counts_every_kind_of_content_and_both_usage_events():
    g = make("messages")
    flags = [g.scan(ev) for ev in messages_stream()]
    assert [f & CONTENT for f in flags].count(CONTENT) == 4  # thinking, text, two tool-input parts
    assert flags[3] == 0  # a signature is not content
    assert flags[-1] == END
    assert (g.prompt_tokens, g.completion_tokens) == (25, 7)  # cached input counts as prompt
    assert make("messages").scan(b'event: error\ndata: {"type":"error","error":{"type":"api_error"}}\n\n') \
        == END | ERROR


def test_llama_native_and_transcription_grammars():
    g = make("llama")
    assert g.scan(sse(None, {"content": "x", "stop": False})) == CONTENT
    assert g.scan(sse(None, {"content": "", "stop": True, "tokens_evaluated": 8, "tokens_predicted": 3,
                             "prompt": "<unused0>x"})) == END
    assert (g.prompt_tokens, g.completion_tokens) == (8, 3)
    t = make("transcription")
    assert t.scan(sse(None, {"type": "transcript.text.delta", "delta": "he"})) == CONTENT
    assert t.scan(sse(None, {"type": "transcript.text.done", "text": "he", "usage": {
        "input_tokens": 50, "output_tokens": 2}})) == END
    assert (t.prompt_tokens, t.completion_tokens) == (50, 2)
    assert make("chat") is None  # the relay's own scan


def test_error_events_speak_each_apis_language():
    err = UpstreamError("The model runtime 'b' broke the stream.")
    ev = grammars.error_event("messages", err)
    assert ev.startswith(b"event: error\ndata: ")
    assert orjson.loads(ev.split(b"data: ", 1)[1]) == {"type": "error", "error": {
        "type": "api_error", "message": "The model runtime 'b' broke the stream."}}
    ev = grammars.error_event("responses", err)
    body = orjson.loads(ev.split(b"data: ", 1)[1])
    assert ev.startswith(b"event: error\n") and body["type"] == "error" and body["code"] == "upstream_error"
    assert grammars.error_event("chat", err) == err.sse_event()


def test_usage_of_every_runtimes_answer():
    assert grammars.usage_of({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}) == (3, 4)
    assert grammars.usage_of({"usage": {"input_tokens": 3, "output_tokens": 4}}) == (3, 4)
    assert grammars.usage_of({"usage": {"input_tokens": 3, "cache_read_input_tokens": 10, "output_tokens": 4}}) \
        == (13, 4)
    assert grammars.usage_of({"usage": {"prompt_tokens": 11, "total_tokens": 11}}) == (11, 0)  # rerank
    assert grammars.usage_of({"tokens_evaluated": 8, "tokens_predicted": 2}) == (8, 2)
    assert grammars.usage_of({"input_tokens": 26}) == (None, None)  # a token count is not usage


async def run(parts, grammar, **kw):
    rec = RequestRecord(id="r", endpoint="x", stream=True, backend="b")
    rec.to(State.DISPATCHED)
    client = Client()
    relay = StreamRelay(rec, client, TimeoutConfig(), strip_usage=False, grammar=make(grammar), **kw)
    await relay.run(FakeResponse(parts), deadline(rec, TimeoutConfig()))
    return rec, client


@pytest.mark.parametrize(("grammar", "stream", "chunks", "usage"), [
    ("responses", responses_stream(("a", "b", "c")), 3, (9, 2)),
    ("messages", messages_stream(), 4, (25, 7)),
])
async def test_relay_reads_each_grammar_and_passes_bytes_untouched(grammar, stream, chunks, usage):
    whole = b"".join(stream)
    rec, client = await run([whole[:70], whole[70:300], whole[300:]], grammar)
    assert client.body == whole
    assert rec.content_chunks == chunks and len(rec.gaps) == chunks - 1 and rec.t_first > 0
    assert (rec.prompt_tokens, rec.completion_tokens) == usage and rec.usage_from_server


async def test_a_stream_cut_before_its_end_event_is_an_error():
    cut = b"".join(messages_stream()[:8])
    with pytest.raises(UpstreamError) as info:
        await run([cut], "messages")
    assert "closed the stream before it was complete" in info.value.message
    with pytest.raises(UpstreamError):
        await run([b"".join(responses_stream()[:-1])], "responses")


async def test_an_error_event_from_the_runtime_is_relayed_then_reported():
    events = [*responses_stream()[:3], sse(None, {"error": {"message": "boom", "type": "server_error"}})]
    rec = RequestRecord(id="r", endpoint="responses", stream=True, backend="b")
    rec.to(State.DISPATCHED)
    client = Client()
    relay = StreamRelay(rec, client, TimeoutConfig(), strip_usage=False, grammar=make("responses"))
    with pytest.raises(UpstreamError) as info:
        await relay.run(FakeResponse([b"".join(events)]), deadline(rec, TimeoutConfig()))
    assert "reported an error" in info.value.message
    assert client.body == b"".join(events) and rec.error == "the runtime sent an error event"


async def test_generic_grammar_ends_at_the_close():
    rec, _ = await run([b'data: {"x": 1}\n\ndata: {"x": 2}\n\n'], "generic")
    assert rec.content_chunks == 2


async def test_reasoning_deltas_are_first_tokens_on_chat():
    # vLLM >= 0.16 streams a thinking phase as `reasoning`: it starts the clock and goes out at once
    chunk = b'data: {"choices":[{"index":0,"delta":{"reasoning":"Let me think"}}]}\n\n'
    rec = RequestRecord(id="r", endpoint="chat", stream=True, backend="b")
    rec.to(State.DISPATCHED)
    client = Client()
    relay = StreamRelay(rec, client, TimeoutConfig(), strip_usage=False)
    with pytest.raises(UpstreamError):  # (no [DONE]: the stream is cut, but it was relayed)
        await relay.run(FakeResponse([chunk]), deadline(rec, TimeoutConfig()))
    assert rec.content_chunks == 1 and client.body.startswith(chunk)


def test_assembled_answers():
    body = orjson.loads(assemble_events(b"".join(responses_stream()), "responses"))
    assert body["status"] == "completed" and body["output"][0]["content"][0]["text"] == "Hello"
    msg = orjson.loads(assemble_events(b"".join(messages_stream()), "messages"))
    assert msg["content"] == [{"type": "thinking", "thinking": "Hmm", "signature": "c2ln"},
                              {"type": "text", "text": "Hi"},
                              {"type": "tool_use", "id": "t1", "name": "look", "input": {"q": "x"}}]
    assert msg["stop_reason"] == "tool_use" and msg["usage"]["output_tokens"] == 7
    assert msg["usage"]["input_tokens"] == 5
    llama = orjson.loads(assemble_events(sse(None, {"content": "a", "stop": False})
                                         + sse(None, {"content": "", "stop": True, "tokens_predicted": 1}), "llama"))
    assert llama["content"] == "a" and llama["tokens_predicted"] == 1
    with pytest.raises(UpstreamError):
        assemble_events(b"".join(responses_stream()[:-1]), "responses")


def test_chat_assembly_keeps_both_reasoning_fields():
    sse_chat = (sse(None, {"id": "c", "choices": [{"index": 0, "delta": {"reasoning_content": "a"}}]})
                + sse(None, {"id": "c", "choices": [{"index": 0, "delta": {"reasoning": "b"}}]})
                + sse(None, {"id": "c", "choices": [{"index": 0, "delta": {"content": "c"}, "finish_reason": "stop"}]}))
    msg = orjson.loads(assemble(sse_chat, "chat"))["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["reasoning"], msg["content"]) == ("a", "b", "c")


def test_upstream_status_keeps_anthropic_shaped_bodies():
    from passerelle.proxy.protocols import ANTHROPIC, error_body

    shaped = b'{"type":"error","error":{"type":"overloaded_error","message":"busy"}}'
    assert error_body(UpstreamStatus(529, shaped), ANTHROPIC)[0] == shaped
    body, _ = error_body(UpstreamStatus(400, b'{"error":{"code":400,"message":"too long","type":"x"}}'), ANTHROPIC)
    assert orjson.loads(body) == {"type": "error", "error": {"type": "invalid_request_error", "message": "too long"}}
