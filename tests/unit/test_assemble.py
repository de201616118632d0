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


def test_text_kept_encoded_renders_the_same_json_as_the_strings_would():
    import tracemalloc

    from passerelle.proxy.answer import SLICE, Items, Text, encode, render

    parts = ['He said "hi"\n', "\\ é 中文 🎉", "\x00\x1f", "x" * (3 * SLICE + 5)]
    text = Text()
    for p in parts:
        text.add(p)
    items = Items()
    items.add([{"t": 1}])
    items.add([{"t": "two"}, 3])
    value = {"a": text, "b": [1, {"c": items, "d": Text()}], "e": "plain", "long": "y" * (SLICE + 1)}
    out = orjson.loads(b"".join(render(value)))
    assert out == {"a": "".join(parts), "b": [1, {"c": [{"t": 1}, {"t": "two"}, 3], "d": ""}], "e": "plain",
                   "long": "y" * (SLICE + 1)}
    assert orjson.loads(encode({"k": "z" * (2 * SLICE)})) == {"k": "z" * (2 * SLICE)}
    # a long string costs about its size to encode (orjson alone reserves ~15 bytes a character);
    # render() takes the value as its own (long strings are replaced in place)
    big = {"content": "é" * (4 * 1024 * 1024)}
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        pieces = render(big)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    size = sum(len(p) for p in pieces)
    assert orjson.loads(b"".join(pieces)) == {"content": "é" * (4 * 1024 * 1024)} and peak < 1.5 * size


def test_a_tool_calls_input_is_kept_as_its_json_text_when_valid_and_empty_when_not():
    from passerelle.proxy.assemble_events import assemble_events

    def messages(*partials):
        out = [b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","role":"assistant",'
               b'"content":[]}}\n\n']
        for i, p in enumerate(partials):
            out.append(ev({"type": "content_block_start", "index": i,
                           "content_block": {"type": "tool_use", "id": f"t{i}", "name": "f", "input": {}}}))
            for piece in p:
                out.append(ev({"type": "content_block_delta", "index": i,
                               "delta": {"type": "input_json_delta", "partial_json": piece}}))
        return b"".join(out)

    msg = orjson.loads(assemble_events(messages(['{"path": "a', '.txt", "n": [1, 2]}'], ['{"broken']), "messages"))
    assert [b["input"] for b in msg["content"]] == [{"path": "a.txt", "n": [1, 2]}, {}]
