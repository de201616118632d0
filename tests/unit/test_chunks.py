"""One definition of a content chunk (passerelle/chunks.py), per API, and both sides of a
measurement reading it the same way: the gateway's relay and grammars, and the benchmark's client.
Events as llama-server, vLLM and the OpenAI / Anthropic APIs send them."""

from __future__ import annotations

import orjson
import pytest

from passerelle import chunks
from passerelle.bench.client import StreamScanner
from passerelle.proxy import grammars
from passerelle.proxy.grammars import CONTENT
from tests.unit.test_relay import relay


def data(obj: object, event: str | None = None) -> bytes:
    """One SSE event, without the blank line that ends it."""
    return (f"event: {event}\n".encode() if event else b"") + b"data: " + orjson.dumps(obj)


def delta(**fields: object) -> bytes:
    return data({"id": "c1", "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": fields, "finish_reason": None}]})


# (event, is it content?) per API
CHAT = [
    (delta(role="assistant", content=""), False),  # the role chunk
    (delta(role="assistant", content=None), False),  # llama-server's role chunk
    (delta(content="Hel"), True),
    (delta(content=" \"quoted\" \\ text"), True),
    (delta(reasoning_content="Let me think"), True),  # llama-server, older vLLM
    (delta(reasoning="Let me think", content=None), True),  # vLLM >= 0.16
    (delta(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}]), True),
    (delta(), False),
    (data({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}), False),
    (data({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}), False),
    (data({"error": {"message": "boom", "type": "server_error"}}), False),
    (b"data: [DONE]", False),
    (b": ping", False),
]
COMPLETIONS = [
    (data({"choices": [{"index": 0, "text": "Once", "finish_reason": None}]}), True),
    (data({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}), False),
]


def typed(t: str, **fields: object) -> bytes:
    return data({"type": t, **fields}, event=t)


RESPONSES = [
    (typed("response.created", response={"id": "resp_1", "status": "in_progress"}), False),
    (typed("response.output_item.added", item={"type": "message", "content": []}), False),
    (typed("response.content_part.added", part={"type": "output_text", "text": ""}), False),
    (typed("response.output_text.delta", delta="Hel"), True),
    (typed("response.reasoning_text.delta", delta="hmm"), True),
    (typed("response.reasoning_summary_text.delta", delta="hmm"), True),
    (typed("response.function_call_arguments.delta", delta='{"city"'), True),
    (typed("response.refusal.delta", delta="I can't"), True),
    (data({"type": "response.output_text.delta", "delta": "no event line"}), True),
    (b"event: response.output_text.delta\ndata: {\"delta\":\"no type in the data\"}", True),
    (typed("response.output_text.done", text="Hello"), False),
    # the final event repeats the whole text, whose quotes are escaped: not a delta
    (typed("response.completed", response={"output": [{"type": "message", "content": [
        {"type": "output_text", "text": '"type":"response.output_text.delta"'}]}],
        "usage": {"input_tokens": 9, "output_tokens": 2}}), False),
    (typed("error", code="server_error", message="boom"), False),
]


def block_delta(kind: str, **fields: object) -> bytes:
    return typed("content_block_delta", index=0, delta={"type": kind, **fields})


MESSAGES = [
    (typed("message_start", message={"id": "msg_1", "role": "assistant", "content": [],
                                     "usage": {"input_tokens": 5, "output_tokens": 0}}), False),
    (typed("content_block_start", index=0, content_block={"type": "text", "text": ""}), False),
    (typed("content_block_start", index=0, content_block={"type": "thinking", "thinking": ""}), False),
    (block_delta("text_delta", text="Hel"), True),
    (block_delta("thinking_delta", thinking="hmm"), True),
    (block_delta("input_json_delta", partial_json='{"city":'), True),
    (block_delta("signature_delta", signature="EqQBCgIYAhIM"), False),
    (typed("ping"), False),
    # a block's text quoting a delta type is escaped: not a delta
    (typed("content_block_start", index=1, content_block={"type": "text", "text": '"type":"text_delta"'}), False),
    (typed("content_block_stop", index=0), False),
    (typed("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 7}), False),
    (typed("message_stop"), False),
]
LLAMA = [
    (data({"content": "Once", "stop": False, "index": 0}), True),
    (data({"content": "", "stop": True, "tokens_evaluated": 4, "tokens_predicted": 8}), False),
]
TRANSCRIPTION = [
    (data({"type": "transcript.text.delta", "delta": "Hello"}), True),
    (data({"type": "transcript.text.done", "text": "Hello", "usage": {"input_tokens": 3}}), False),
]
CASES = {"chat": CHAT, "completions": COMPLETIONS, "responses": RESPONSES, "messages": MESSAGES, "llama": LLAMA,
         "transcription": TRANSCRIPTION}
GRAMMAR = {"responses": "responses", "messages": "messages", "llama": "llama", "transcription": "transcription"}


@pytest.mark.parametrize("api", sorted(CASES))
def test_what_is_a_content_event_per_api(api):
    wrong = [(ev, want) for ev, want in CASES[api] if chunks.is_content(api, ev) != want]
    assert not wrong


@pytest.mark.parametrize("api", sorted(GRAMMAR))
def test_the_gateways_grammar_counts_the_same_events(api):
    for ev, want in CASES[api]:
        g = grammars.make(GRAMMAR[api])
        assert g is not None
        assert bool(g.scan(ev + b"\n\n") & CONTENT) == want, ev


async def test_the_relay_counts_the_same_chat_events():
    # (the error event would end the relay with an error: it is left out; it is no content either)
    events = [ev for ev, _ in CHAT + COMPLETIONS if ev != b"data: [DONE]" and b'"error"' not in ev]
    rec, _ = await relay([b"".join(ev + b"\n\n" for ev in events) + b"data: [DONE]\n\n"])
    assert rec.content_chunks == sum(want for ev, want in CHAT + COMPLETIONS) == 6


@pytest.mark.parametrize("api", ["chat", "completions", "responses", "messages"])
def test_the_benchmark_client_counts_the_same_events(api):
    s = StreamScanner(api)
    for i, (ev, _) in enumerate(CASES[api]):
        s.feed(ev + b"\n\n", float(i))
    assert s.chunks == sum(want for _, want in CASES[api])


def test_count_events_counts_an_event_once_and_leaves_an_incomplete_one():
    two_fields = delta(content="a", reasoning_content="b")
    stream = b"".join(ev + b"\n\n" for ev in (delta(role="assistant", content=""), two_fields, delta(content="c")))
    assert chunks.count_events(chunks.CHAT, stream) == 2
    assert chunks.count_events(chunks.CHAT, stream + delta(content="d")) == 2  # no end yet: not counted
    crlf = stream.replace(b"\n\n", b"\r\n\r\n")
    assert chunks.count_events(chunks.CHAT, crlf, sep=b"\r\n\r\n") == 2
    typed_stream = b"".join(ev + b"\n\n" for ev, _ in RESPONSES)
    assert chunks.count_events(chunks.RESPONSES, typed_stream) == sum(want for _, want in RESPONSES)
