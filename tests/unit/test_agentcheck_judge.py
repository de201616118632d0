"""agentcheck's judge (passerelle/bench/agentcheck_judge.py) on crafted answers: a call in each
API's own shape passes, streamed and not; markup left in the text, arguments that do not fit the
schema, a call of a tool not offered, ids not unique, and a stream that does not end as the client
expects each fail, for that reason."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from passerelle.bench.agentcheck_judge import Verdict, judge, markup_in, read_reply
from passerelle.testing.answers import Answer, Call, Turn, build
from passerelle.testing.tool_call_text import FORMATS, as_text

SCHEMA = {"type": "object", "required": ["command"], "additionalProperties": False,
          "properties": {"command": {"type": "string"}, "timeout": {"type": "integer", "minimum": 1}}}
APIS = ("chat", "responses", "messages")


def request(api: str, stream: bool) -> dict[str, Any]:
    if api == "chat":
        tools: list[dict[str, Any]] = [{"type": "function", "function": {"name": "bash", "parameters": SCHEMA}}]
        return {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "ls"}], "tools": tools}
    if api == "responses":
        return {"model": "m", "stream": stream, "input": "ls",
                "tools": [{"type": "function", "name": "bash", "parameters": SCHEMA}]}
    return {"model": "m", "stream": stream, "max_tokens": 64, "messages": [{"role": "user", "content": "ls"}],
            "tools": [{"name": "bash", "input_schema": SCHEMA}]}


def raw(answer: Answer) -> bytes:
    return b"".join(answer.events) if answer.events else answer.body


def verdict_of(api: str, stream: bool, answer: Answer | bytes, status: int = 200) -> Verdict:
    body = request(api, stream)
    data = answer if isinstance(answer, bytes) else raw(answer)
    return judge(api, body, stream, read_reply(api, stream, status, data))


def call_turn(arguments: str = '{"command": "ls"}', name: str = "bash") -> Turn:
    return Turn(call=Call(name, arguments, "call_1"))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", APIS)
def test_a_tool_call_in_the_apis_shape_passes(api: str, stream: bool) -> None:
    answer = build(api, request(api, stream), call_turn('{"command": "ls", "timeout": 5}'))
    assert verdict_of(api, stream, answer) == Verdict(True, ())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", APIS)
def test_markup_left_in_the_text_fails(api: str, stream: bool, fmt: str) -> None:
    """What a runtime without a parser sends: the call as text, the answer ending as text."""
    text = as_text(fmt, "bash", '{"command": "ls"}')
    verdict = verdict_of(api, stream, build(api, request(api, stream), Turn(text)))
    assert not verdict.passed
    assert "markup" in verdict.kinds and "no_tool_call" in verdict.kinds
    assert ("stop_reason" in verdict.kinds) == (api != "responses")  # a Responses text answer is "completed" too


def test_markup_beside_a_real_call_still_fails() -> None:
    """A repaired call whose markup was also left in the content is not a pass."""
    answer = json.loads(build("chat", request("chat", False), call_turn()).body)
    answer["choices"][0]["message"]["content"] = '<tool_call>{"name": "bash"'
    verdict = verdict_of("chat", False, json.dumps(answer).encode())
    assert verdict.kinds == ["markup"]


@pytest.mark.parametrize("text", [
    '{"name": "bash", "parameters": {"command": "ls"}}',  # Llama 3 without its tag
    '[{"name": "bash", "arguments": {"command": "ls"}}]',
    "<function=bash>", "[TOOL_CALLS]", "<|python_tag|>", "<|call|>", "to=functions.bash",
])
def test_markup_patterns(text: str) -> None:
    assert markup_in("Sure. " + text if not text.startswith(("{", "[{")) else text)


@pytest.mark.parametrize("text", ["Done: hello.txt holds the greeting.", '{"answer": 42}', "use a <tool> here"])
def test_plain_text_is_not_markup(text: str) -> None:
    assert markup_in(text) is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(("arguments", "why"), [
    ('{"timeout": 5}', "missing required property command"),
    ('{"command": 12}', "expected string"),
    ('{"command": "ls", "timeout": 0}', "below the minimum"),
    ('{"command": "ls", "cwd": "/"}', "unexpected property cwd"),
])
def test_arguments_that_do_not_fit_the_schema_fail(api: str, stream: bool, arguments: str, why: str) -> None:
    verdict = verdict_of(api, stream, build(api, request(api, stream), call_turn(arguments)))
    assert verdict.kinds == ["arguments"]
    assert why in verdict.failures[0][1]


@pytest.mark.parametrize("stream", [False, True])
def test_arguments_that_are_not_json_fail(stream: bool) -> None:
    verdict = verdict_of("chat", stream, build("chat", request("chat", stream), call_turn('{"command": "ls"')))
    assert verdict.kinds == ["arguments"]


def test_a_tool_not_offered_fails() -> None:
    verdict = verdict_of("responses", False, build("responses", request("responses", False), call_turn(name="rm")))
    assert verdict.kinds == ["unknown_tool"]


def test_ids_must_be_unique() -> None:
    answer = json.loads(build("chat", request("chat", False), call_turn()).body)
    message = answer["choices"][0]["message"]
    message["tool_calls"].append(message["tool_calls"][0])
    assert verdict_of("chat", False, json.dumps(answer).encode()).kinds == ["ids"]


@pytest.mark.parametrize(("api", "drop", "last"), [
    ("chat", b"data: [DONE]\n\n", "chunk"),
    ("responses", b"event: response.completed\n", "response.output_item.done"),
    ("messages", b"event: message_stop\n", "message_delta"),
])
def test_a_stream_that_does_not_end_as_the_client_expects_fails(api: str, drop: bytes, last: str) -> None:
    events = build(api, request(api, True), call_turn()).events
    cut = [e for e in events if not e.startswith(drop)]
    assert len(cut) == len(events) - 1
    verdict = verdict_of(api, True, b"".join(cut))
    assert "stream_end" in verdict.kinds
    assert repr(last) in dict(verdict.failures)["stream_end"]


def test_a_chat_call_ending_with_stop_fails() -> None:
    answer = json.loads(build("chat", request("chat", False), call_turn()).body)
    answer["choices"][0]["finish_reason"] = "stop"
    assert verdict_of("chat", False, json.dumps(answer).encode()).kinds == ["stop_reason"]


def test_an_error_answer_fails_with_its_status() -> None:
    verdict = verdict_of("messages", False, b'{"type":"error","error":{"message":"overloaded"}}', status=529)
    assert verdict.kinds == ["http"] and "529" in verdict.failures[0][1]


def test_an_unreadable_answer_fails() -> None:
    assert verdict_of("chat", False, b"<html>").kinds == ["unreadable"]
    assert verdict_of("messages", True, b"event: message_start\ndata: {not json\n\n").kinds == ["unreadable"]


def test_an_error_event_in_a_stream_fails() -> None:
    stream = b'data: {"error": {"message": "boom"}}\n\n'
    assert verdict_of("chat", True, stream).kinds == ["unreadable"]


@settings(max_examples=300, deadline=None)
@given(api=st.sampled_from(APIS), stream=st.booleans(),
       raw=st.one_of(st.binary(max_size=400),
                     st.lists(st.sampled_from([b"data: [DONE]\n\n", b'data: {"choices":[{"delta":null}]}\n\n',
                                               b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
                                               b'data: {"type":"content_block_start","index":"x"}\n\n',
                                               b'data: {"type":"response.output_item.done","item":[]}\n\n',
                                               b'data: []\n\n', b"data: 1\n\n", b'{"choices":[]}', b"\xff\n\n"]),
                              max_size=6).map(b"".join)))
def test_any_answer_gets_a_verdict_never_an_exception(api: str, stream: bool, raw: bytes) -> None:
    """Whatever a server sends, agentcheck reports it as a failing turn rather than stopping."""
    verdict = judge(api, request(api, stream), stream, read_reply(api, stream, 200, raw))
    assert not verdict.passed and verdict.failures
