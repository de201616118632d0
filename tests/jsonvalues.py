"""Hypothesis strategies for JSON a client or a runtime may send: any value in any position.

Everything orjson parses is in reach: null, booleans, integers across orjson's whole range (a signed
64-bit negative to an unsigned 64-bit positive), finite floats, strings (``data:`` URLs and the
words the gateway looks for among them), lists and objects whose keys are the field names the
gateway reads, and values nested as deep as orjson's parser allows (1,024 levels: a :class:`Deep`,
written by :func:`encode`, since orjson writes 254 at most). :func:`mutated` puts such values at
random places of a well-formed template (a real request, a runtime's events), where a reader that
trusts a field's type breaks.

    @given(mutated(CHAT_REQUEST))
    def test_...(body):
        raw = encode(body)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import orjson
from hypothesis import strategies as st

# Field names the gateway (or a runtime's answer) reads: arbitrary values land where they matter.
KEYS = ("model", "messages", "role", "content", "type", "text", "image_url", "url", "input_audio", "tools",
        "function", "name", "arguments", "parameters", "properties", "input_schema", "tool_calls", "delta",
        "index", "id", "usage", "prompt_tokens", "completion_tokens", "input_tokens", "output_tokens",
        "total_tokens", "choices", "finish_reason", "logprobs", "stream", "stream_options", "include_usage",
        "max_tokens", "n", "user", "input", "prompt", "system", "instructions", "message", "response",
        "content_block", "partial_json", "thinking", "signature", "stop", "tokens_evaluated", "tokens_predicted",
        "timings", "predicted_n", "prompt_n", "cache_n", "reasoning_content", "reasoning", "error", "created",
        "data", "documents", "query", "tokens", "input_prefix", "input_suffix", "anyOf", "enum", "items")
WORDS = ("user", "assistant", "system", "tool", "function", "text", "image_url", "input_image", "image",
         "input_audio", "audio", "input_file", "file", "document", "text_delta", "thinking_delta",
         "input_json_delta", "signature_delta", "message_start", "content_block_start", "content_block_delta",
         "message_delta", "message_stop", "response.completed", "response.output_text.delta", "error", "object",
         "string", "null", "fake-model", "[DONE]", "data:image/png;base64,AAAA", "data:audio/wav;base64,AAAA",
         "data:", "")

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class Deep:
    """``inner`` wrapped ``depth`` times in alternating objects (``{key: …}``) and lists."""

    inner: Any
    depth: int
    key: str = "content"


def encode(value: Any) -> bytes:
    """``value`` as JSON bytes, :class:`Deep` values included (a stack, not recursion)."""
    out: list[bytes] = []
    stack: list[Any] = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, bytes):  # (punctuation queued below)
            out.append(v)
        elif isinstance(v, Deep):
            opening = b"".join(b"[" if i % 2 else b'{"' + v.key.encode() + b'":' for i in range(v.depth))
            closing = b"".join(b"]" if i % 2 else b"}" for i in reversed(range(v.depth)))
            out.append(opening)
            stack += [closing, v.inner]
        elif isinstance(v, dict):
            items: list[Any] = [b"{"]
            for i, (k, item) in enumerate(v.items()):
                items += [(b"," if i else b"") + orjson.dumps(k) + b":", item]
            items.append(b"}")
            stack += reversed(items)
        elif isinstance(v, list):
            items = [b"["]
            for i, item in enumerate(v):
                items += [b"," if i else b"", item]
            items.append(b"]")
            stack += reversed(items)
        else:
            out.append(orjson.dumps(v))
    return b"".join(out)


def decoded(value: Any) -> Any:
    """``value`` as the gateway would hold it once parsed (a :class:`Deep` made real)."""
    return orjson.loads(encode(value))


scalars = (st.none() | st.booleans() | st.integers(INT64_MIN, UINT64_MAX) | st.integers(-3, 300)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12) | st.sampled_from(WORDS))
keys = st.sampled_from(KEYS) | st.text(max_size=6)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=5)


shallow = st.recursive(scalars, _containers, max_leaves=16)
#: 200 to 1,000 levels: past Python's recursion limit and orjson's encoder, within its parser.
deep = st.builds(Deep, shallow, st.integers(200, 1000), st.sampled_from(KEYS))
json_values = st.one_of(scalars, scalars, shallow, shallow, shallow, deep)


def _paths(value: Any) -> list[tuple[Any, ...]]:
    """Every position in ``value`` (the root excepted), as key/index paths."""
    out: list[tuple[Any, ...]] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), value)]
    while stack:
        path, v = stack.pop()
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, item in items:
            out.append((*path, k))
            stack.append(((*path, k), item))
    return out


@st.composite
def mutated(draw: st.DrawFn, template: Any, most: int = 3) -> Any:
    """``template`` with 1 to ``most`` of its positions replaced by arbitrary JSON (or dropped)."""
    value = copy.deepcopy(template)
    for _ in range(draw(st.integers(1, most))):
        paths = _paths(value)
        if not paths:
            break
        *parent_path, last = draw(st.sampled_from(paths))
        parent = value
        for k in parent_path:
            parent = parent[k]
        if isinstance(parent, dict) and draw(st.integers(0, 5)) == 0:
            del parent[last]
        else:
            parent[last] = draw(json_values)
    return value


# -- templates: what agents send, and what runtimes answer -------------------------------------------
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["type"],
          "properties": {"type": {"type": "string", "enum": ["a", "b"]}, "note": {"type": ["string", "null"]},
                         "items": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}
IMAGE = "data:image/png;base64,iVBORw0KGgo="
MESSAGES_TURNS = [
    {"role": "user", "content": [{"type": "text", "text": "hi"},
                                 {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                              "data": "iVBORw0KGgo="}}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                      {"type": "tool_use", "id": "t1", "name": "f", "input": {"type": "a"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]
REQUESTS: dict[str, dict[str, Any]] = {
    "chat": {"model": "fake-model", "max_tokens": 4, "user": "u1", "n": 1, "tool_choice": "auto",
             "stream_options": {"include_usage": True}, "response_format": {"type": "text"},
             "messages": [{"role": "system", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "hi"},
                                                       {"type": "image_url", "image_url": {"url": IMAGE}},
                                                       {"type": "input_audio",
                                                        "input_audio": {"data": "AAAA", "format": "wav"}}]},
                          {"role": "assistant", "content": None,
                           "tool_calls": [{"id": "c1", "type": "function",
                                           "function": {"name": "f", "arguments": "{}"}}]},
                          {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
             "tools": [{"type": "function", "function": {"name": "f", "description": "d", "strict": True,
                                                         "parameters": SCHEMA}}]},
    "completions": {"model": "fake-model", "prompt": "Once", "max_tokens": 4, "n": 1, "best_of": 1,
                    "echo": False, "logprobs": None, "suffix": None, "user": "u1"},
    "embeddings": {"model": "fake-model", "input": ["a", "b"], "encoding_format": "float", "user": "u1"},
    "responses": {"model": "fake-model", "instructions": "be brief", "max_output_tokens": 4, "store": False,
                  "prompt_cache_key": "k1", "reasoning": {"effort": "low"},
                  "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                                         {"type": "input_image", "image_url": IMAGE}]},
                            {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
                            {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
                  "tools": [{"type": "function", "name": "shell", "strict": True, "parameters": SCHEMA}]},
    "messages": {"model": "fake-model", "max_tokens": 4, "metadata": {"user_id": "u1"},
                 "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
                 "messages": MESSAGES_TURNS, "tools": [{"name": "f", "description": "d", "input_schema": SCHEMA}],
                 "thinking": {"type": "enabled", "budget_tokens": 1024}},
    "count_tokens": {"model": "fake-model", "system": "be brief", "messages": MESSAGES_TURNS,
                     "tools": [{"name": "f", "input_schema": SCHEMA}]},
    "rerank": {"model": "fake-model", "query": "q", "documents": ["a", "b"], "top_n": 2},
    "tokenize": {"model": "fake-model", "content": "hi", "add_special": True, "with_pieces": False},
    "detokenize": {"model": "fake-model", "tokens": [1, 2, 3]},
    "infill": {"model": "fake-model", "input_prefix": "def f(", "input_suffix": ")", "prompt": "", "n_predict": 4,
               "input_extra": [{"filename": "a.py", "text": "x = 1"}]},
}
#: Whether the API's answer may stream (the template above then also comes with "stream": true).
STREAMS = {"chat": True, "completions": True, "responses": True, "messages": True, "infill": True}

# A runtime's stream: [event name or "", data object] per event, as each API's runtimes send it.
_TOOL = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\""}}
STREAMS_OUT: dict[str, list[list[Any]]] = {
    "chat": [["", {"id": "c1", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                               "content": ""}}]}],
             ["", {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": {"content": [
                 {"token": "Hi", "logprob": -0.1}]}}]}],
             ["", {"id": "c1", "choices": [{"index": 0, "delta": {"reasoning_content": "r", "reasoning": "r"}}]}],
             ["", {"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [_TOOL]}}]}],
             ["", {"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [
                 {"index": 0, "function": {"arguments": ":1}"}}]}}]}],
             ["", {"id": "c1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                   "timings": {"predicted_n": 2, "prompt_n": 3, "cache_n": 0}}],
             ["", {"id": "c1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                                        "total_tokens": 5,
                                                        "prompt_tokens_details": {"cached_tokens": 0}}}],
             ["", "[DONE]"]],
    "completions": [["", {"id": "c1", "choices": [{"index": 0, "text": "Hi", "logprobs": None}]}],
                    ["", {"id": "c1", "choices": [{"index": 0, "text": "!", "finish_reason": "length"}]}],
                    ["", {"id": "c1", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}],
                    ["", "[DONE]"]],
    "responses": [["response.created", {"type": "response.created", "response": {"id": "r1", "output": []}}],
                  ["response.output_text.delta", {"type": "response.output_text.delta", "item_id": "i1",
                                                  "output_index": 0, "content_index": 0, "delta": "Hi"}],
                  ["response.completed", {"type": "response.completed", "response": {
                      "id": "r1", "status": "completed", "output": [{"type": "message", "content": [
                          {"type": "output_text", "text": "Hi"}]}],
                      "usage": {"input_tokens": 3, "output_tokens": 1, "total_tokens": 4}}}]],
    "messages": [["message_start", {"type": "message_start", "message": {
                     "id": "m1", "type": "message", "role": "assistant", "content": [], "model": "m",
                     "usage": {"input_tokens": 3, "output_tokens": 1, "cache_read_input_tokens": 0}}}],
                 ["content_block_start", {"type": "content_block_start", "index": 0,
                                          "content_block": {"type": "text", "text": ""}}],
                 ["content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": "Hi"}}],
                 ["content_block_start", {"type": "content_block_start", "index": 1,
                                          "content_block": {"type": "thinking", "thinking": ""}}],
                 ["content_block_delta", {"type": "content_block_delta", "index": 1,
                                          "delta": {"type": "thinking_delta", "thinking": "t"}}],
                 ["content_block_delta", {"type": "content_block_delta", "index": 1,
                                          "delta": {"type": "signature_delta", "signature": "s"}}],
                 ["content_block_start", {"type": "content_block_start", "index": 2, "content_block": {
                     "type": "tool_use", "id": "t1", "name": "f", "input": {}}}],
                 ["content_block_delta", {"type": "content_block_delta", "index": 2,
                                          "delta": {"type": "input_json_delta", "partial_json": "{\"a\": 1}"}}],
                 ["content_block_stop", {"type": "content_block_stop", "index": 2}],
                 ["message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                    "usage": {"output_tokens": 3}}],
                 ["message_stop", {"type": "message_stop"}]],
    "llama": [["", {"content": "Hi", "stop": False}],
              ["", {"content": "", "stop": True, "tokens_evaluated": 3, "tokens_predicted": 1,
                    "timings": {"predicted_n": 1}}]],
}


def sse(events: Any) -> bytes:
    """A (mutated) stream template as the runtime's bytes: each ``[name, data]`` an event (a string
    data as it is, anything else as JSON), anything else a data line of its JSON."""
    out = []
    for ev in events if isinstance(events, list) else [events]:
        if isinstance(ev, list) and len(ev) == 2 and isinstance(ev[0], str):
            name, data = ev
            head = f"event: {name}\n".encode() if name and "\n" not in name and "\r" not in name else b""
            body = data.encode() if isinstance(data, str) and "\n" not in data else encode(data)
            out.append(head + b"data: " + body + b"\n\n")
        else:
            out.append(b"data: " + encode(ev) + b"\n\n")
    return b"".join(out)
