"""One agent turn in each generating API's own words, JSON or SSE: the tools a request offers,
whether it already carries a tool's result, and the answer (text, or a call of one tool) as chat
completions, Responses and Messages write it. The recorder's script (scripted.py) and the runtime
that makes a real agent run its tool (tool_runtime.py) decide what to say; this module says it.

    >>> turn = Turn(call=Call("bash", '{"command": "ls"}', "call_1"))
    >>> orjson.loads(build("chat", {"model": "m"}, turn).body)["choices"][0]["finish_reason"]
    'tool_calls'
    >>> build("messages", {"model": "m", "stream": True}, Turn("hi")).events[0][:20]
    b'event: message_start'
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

Tool = tuple[str, str, Any]  # (kind "function" or "custom", name, JSON schema of the arguments)


@dataclass
class Answer:
    status: int = 200
    content_type: str = "application/json"
    body: bytes = b""
    events: list[bytes] = field(default_factory=list)  # a stream's SSE events, when it streams


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # the arguments as JSON text, or a custom tool's free-form input
    id: str  # chat's tool_calls id, Responses' call_id, Messages' tool_use id
    custom: bool = False  # a Responses custom (free-form) tool


@dataclass(frozen=True)
class Turn:
    """What one answer says: ``call`` when set, else ``text``; ``thinking`` puts a reasoning item
    (Responses) or a thinking block (Messages) first, which agents send back on their next turn."""

    text: str = ""
    call: Call | None = None
    thinking: bool = False
    tag: str = "rec1"  # the ids' suffix: chatcmpl-rec1, resp_rec1, msg_rec1...


# -- what the request carries -----------------------------------------------------------------
def tools(body: dict[str, Any]) -> list[Tool]:
    """The tools a request offers, in any API's shape (built-in tools, e.g. web search, left out)."""
    out: list[Tool] = []
    for tool in body.get("tools") or ():
        if not isinstance(tool, dict):
            continue
        if isinstance(tool.get("function"), dict):  # chat
            fn = tool["function"]
            out.append(("function", str(fn.get("name")), fn.get("parameters") or {}))
        elif "input_schema" in tool:  # Messages (whose "type", when given, is "custom")
            out.append(("function", str(tool.get("name")), tool["input_schema"]))
        elif tool.get("type") == "function":  # Responses
            out.append(("function", str(tool.get("name")), tool.get("parameters") or {}))
        elif tool.get("type") == "custom" and "name" in tool:  # Responses' free-form tool
            out.append(("custom", str(tool.get("name")), None))
    return out


def has_tool_result(api: str, body: dict[str, Any]) -> bool:
    """Does the conversation already carry a tool's result?"""
    if api == "chat":
        return any(isinstance(m, dict) and m.get("role") in ("tool", "function") for m in body.get("messages") or ())
    if api == "responses":
        items = i if isinstance(i := body.get("input"), list) else []
        return any(isinstance(i, dict) and str(i.get("type", "")).endswith("_output") for i in items)
    for m in body.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content):
            return True
    return False


# -- the answers, per API ---------------------------------------------------------------------
def sse(obj: Any, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


def _words(text: str) -> list[str]:
    parts = text.split(" ")
    return [p if i == 0 else " " + p for i, p in enumerate(parts)]


def build(api: str, body: dict[str, Any], turn: Turn) -> Answer:
    """``turn`` as an answer to ``body`` on ``api`` (chat, responses or messages), streamed when
    the request asks for a stream."""
    return {"chat": _chat, "responses": _responses, "messages": _messages}[api](body, turn)


def count_tokens(body: dict[str, Any]) -> Answer:
    return Answer(body=orjson.dumps({"input_tokens": max(1, len(orjson.dumps(body)) // 4)}))


def _chat(body: dict[str, Any], turn: Turn) -> Answer:
    model, created, rid = str(body.get("model", "m")), int(time.time()), f"chatcmpl-{turn.tag}"
    call, text = turn.call, turn.text
    usage = {"prompt_tokens": 20, "completion_tokens": 8, "total_tokens": 28}
    finish = "tool_calls" if call else "stop"
    if not body.get("stream"):
        message: dict[str, Any] = {"role": "assistant", "content": None if call else text}
        if call:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.name, "arguments": call.arguments}}]
        return Answer(body=orjson.dumps({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                         "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                      "logprobs": None}], "usage": usage}))
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                         "logprobs": None}]})

    events = [chunk({"role": "assistant", "content": ""})]
    if call:
        events.append(chunk({"tool_calls": [{"index": 0, "id": call.id, "type": "function",
                                             "function": {"name": call.name, "arguments": ""}}]}))
        events.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": call.arguments}}]}))
    else:
        events += [chunk({"content": w}) for w in _words(text)]
    events.append(chunk({}, finish))
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        events.append(sse({**head, "choices": [], "usage": usage}))
    events.append(b"data: [DONE]\n\n")
    return Answer(content_type="text/event-stream", events=events)


def _responses(body: dict[str, Any], turn: Turn) -> Answer:
    call, text, tag = turn.call, turn.text, turn.tag
    items: list[dict[str, Any]] = []
    if turn.thinking:
        items.append({"type": "reasoning", "id": f"rs_{tag}", "summary": [
            {"type": "summary_text", "text": "**Writing the file**"}], "encrypted_content": "ZW5jcnlwdGVk"})
    if call:
        items.append({"type": "custom_tool_call", "id": f"ctc_{tag}", "call_id": call.id, "name": call.name,
                      "input": call.arguments, "status": "completed"} if call.custom else
                     {"type": "function_call", "id": f"fc_{tag}", "call_id": call.id, "name": call.name,
                      "arguments": call.arguments, "status": "completed"})
    else:
        items.append({"type": "message", "id": f"msg_{tag}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    base: dict[str, Any] = {
            "id": f"resp_{tag}", "object": "response", "created_at": int(time.time()),
            "model": str(body.get("model")), "error": None, "incomplete_details": None, "instructions": None,
            "metadata": {}, "parallel_tool_calls": True, "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto",
            "tools": [], "text": body.get("text") or {"format": {"type": "text"}}}
    usage = {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 8,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 28}
    done = {**base, "status": "completed", "output": items, "usage": usage}
    if not body.get("stream"):
        return Answer(body=orjson.dumps(done))
    seq = iter(range(1_000_000))

    def ev(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

    events = [ev("response.created", response={**base, "status": "in_progress", "output": []}),
              ev("response.in_progress", response={**base, "status": "in_progress", "output": []})]
    for at, item in enumerate(items):
        where = {"item_id": item["id"], "output_index": at}
        if item["type"] == "message":
            events.append(ev("response.output_item.added", output_index=at,
                             item={**item, "status": "in_progress", "content": []}))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(ev("response.content_part.added", **where, content_index=0, part=part))
            events += [ev("response.output_text.delta", **where, content_index=0, delta=w, logprobs=[])
                       for w in _words(text)]
            events.append(ev("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            events.append(ev("response.content_part.done", **where, content_index=0, part=item["content"][0]))
        elif item["type"] == "function_call":
            events.append(ev("response.output_item.added", output_index=at,
                             item={**item, "arguments": "", "status": "in_progress"}))
            events.append(ev("response.function_call_arguments.delta", **where, delta=item["arguments"]))
            events.append(ev("response.function_call_arguments.done", **where, arguments=item["arguments"],
                             name=item["name"]))
        elif item["type"] == "custom_tool_call":
            events.append(ev("response.output_item.added", output_index=at,
                             item={**item, "input": "", "status": "in_progress"}))
            events.append(ev("response.custom_tool_call_input.delta", **where, delta=item["input"]))
            events.append(ev("response.custom_tool_call_input.done", **where, input=item["input"]))
        else:  # reasoning
            events.append(ev("response.output_item.added", output_index=at, item={**item, "summary": []}))
            summary = item["summary"][0]
            events.append(ev("response.reasoning_summary_part.added", **where, summary_index=0,
                             part={"type": "summary_text", "text": ""}))
            events.append(ev("response.reasoning_summary_text.delta", **where, summary_index=0,
                             delta=summary["text"]))
            events.append(ev("response.reasoning_summary_text.done", **where, summary_index=0, text=summary["text"]))
            events.append(ev("response.reasoning_summary_part.done", **where, summary_index=0, part=summary))
        events.append(ev("response.output_item.done", output_index=at, item=item))
    events.append(ev("response.completed", response=done))
    return Answer(content_type="text/event-stream", events=events)


def _messages(body: dict[str, Any], turn: Turn) -> Answer:
    call = turn.call
    blocks: list[dict[str, Any]] = []
    if turn.thinking:
        blocks.append({"type": "thinking", "thinking": "The user wants a file written.", "signature": "c2lnbmF0dXJl"})
    if call:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": orjson.loads(call.arguments)})
    else:
        blocks.append({"type": "text", "text": turn.text})
    stop = "tool_use" if call else "end_turn"
    usage = {"input_tokens": 20, "output_tokens": 8, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    msg = {"id": f"msg_{turn.tag}", "type": "message", "role": "assistant", "model": str(body.get("model")),
           "content": blocks, "stop_reason": stop, "stop_sequence": None, "usage": usage}
    if not body.get("stream"):
        return Answer(body=orjson.dumps(msg))
    events = [sse({"type": "message_start", "message": {**msg, "content": [], "stop_reason": None,
                                                        "usage": {**usage, "output_tokens": 1}}}, "message_start")]
    for i, block in enumerate(blocks):
        kind = block["type"]
        start = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                 "tool_use": {**block, "input": {}}, "text": {"type": "text", "text": ""}}[kind]
        events.append(sse({"type": "content_block_start", "index": i, "content_block": start}, "content_block_start"))
        deltas: Iterator[dict[str, Any]]
        if kind == "thinking":
            deltas = iter([{"type": "thinking_delta", "thinking": block["thinking"]},
                           {"type": "signature_delta", "signature": block["signature"]}])
        elif kind == "tool_use":
            deltas = iter([{"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}])
        else:
            deltas = ({"type": "text_delta", "text": w} for w in _words(block["text"]))
        events += [sse({"type": "content_block_delta", "index": i, "delta": d}, "content_block_delta") for d in deltas]
        events.append(sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
    events.append(sse({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                       "usage": {"output_tokens": 8}}, "message_delta"))
    events.append(sse({"type": "message_stop"}, "message_stop"))
    return Answer(content_type="text/event-stream", events=events)
