import orjson

from passerelle.proxy.assemble import assemble


def ev(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_chat_answer_is_rebuilt_from_deltas():
    sse = b"".join([
        ev({"id": "c1", "created": 5, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
        ev({"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
        ev({"id": "c1", "choices": [{"index": 0, "delta": {"content": "lo"}, "logprobs": {"content": [{"t": 1}]}}]}),
        ev({"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop",
                                     "logprobs": {"content": [{"t": 2}]}}]}),
        ev({"id": "c1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}),
        b"data: [DONE]\n\n",
    ])
    out = orjson.loads(assemble(sse, "chat"))
    assert out["id"] == "c1" and out["object"] == "chat.completion" and out["created"] == 5
    assert out["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                               "finish_reason": "stop", "logprobs": {"content": [{"t": 1}, {"t": 2}]}}]
    assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 2}


def test_tool_call_arguments_are_concatenated_by_index():
    sse = b"".join([
        ev({"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get", "arguments": "{\"a\""}}]}}]}),
        ev({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}]}),
        ev({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
    ])
    msg = orjson.loads(assemble(sse, "chat"))["choices"][0]["message"]
    assert msg["content"] is None
    assert msg["tool_calls"] == [{"id": "call_1", "type": "function",
                                  "function": {"name": "get", "arguments": "{\"a\": 1}"}}]


def test_completions_text_and_usage_on_last_chunk():
    sse = ev({"id": "x", "choices": [{"index": 0, "text": "a"}]}) + ev(
        {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}], "usage": {"completion_tokens": 2}})
    out = orjson.loads(assemble(sse, "completions"))
    assert out["object"] == "text_completion"
    assert out["choices"][0]["text"] == "ab" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 2
