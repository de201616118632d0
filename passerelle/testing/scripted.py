"""Plausible answers for every generating API, so that a real client keeps talking: the recorder
(recorder.py) answers with these while it writes down what the client sent.

The script is an agent turn. A request that offers tools and carries no tool result yet is
answered with a call of one of them (a shell-like tool first, asked to write ``hello.txt``;
otherwise the first tool), its arguments made from the tool's own JSON schema; any other request is
answered with text, or with an instance of its structured-output schema (``response_format``,
Responses' ``text.format``), so that the SDKs' ``parse`` helpers get what they validate.

    >>> example_of({"type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"},
    ...             "b": {"type": ["string", "null"]}}})
    {'a': 1, 'b': None}
    >>> answer("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}).body[:9]
    b'{"id":"ch'
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

TEXT = "Done: hello.txt holds the greeting."
SHELL_LINE = "echo hello > hello.txt"
# A tool the script prefers to call, so a coding agent runs something harmless in its sandbox.
PREFERRED_TOOLS = ("Bash", "bash", "shell", "shell_command", "exec_command", "local_shell", "run_command",
                   "Write", "write", "get_weather")
# Values for well-known argument names; everything else comes from the schema.
KNOWN_ARGS: dict[str, Any] = {
    "command": SHELL_LINE, "cmd": SHELL_LINE, "description": "write hello.txt",
    "file_path": "hello.txt", "filePath": "hello.txt", "path": "hello.txt", "content": "hello\n",
    "city": "Paris", "location": "Paris",
}


@dataclass
class Answer:
    status: int = 200
    content_type: str = "application/json"
    body: bytes = b""
    events: list[bytes] = field(default_factory=list)  # a stream's SSE events, when it streams


def example_of(schema: Any, root: Any = None, depth: int = 0, name: str = "") -> Any:
    """A small instance of a JSON schema: every required property (all of them under ``strict``),
    the first enum value, the first non-null branch of ``anyOf`` / a type list, ``$ref`` followed."""
    root = schema if root is None else root
    if depth > 12 or not isinstance(schema, dict):
        return None
    if "$ref" in schema and isinstance(schema["$ref"], str) and schema["$ref"].startswith("#/"):
        target: Any = root
        for part in schema["$ref"][2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return example_of(target, root, depth + 1, name)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if "default" in schema and schema["default"] is not None:
        return schema["default"]
    for key in ("anyOf", "oneOf"):
        options = [b for b in schema.get(key) or () if isinstance(b, dict)]
        branches = [b for b in options if b.get("type") != "null"]
        if len(branches) < len(options) and name not in KNOWN_ARGS:
            return None  # nullable: the least to make (and the end of a recursive model)
        if branches:
            return example_of(branches[0], root, depth + 1, name)
    if isinstance(schema.get("allOf"), list):
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            if isinstance(part, dict):
                merged.update(part)
        return example_of({**merged, **{k: v for k, v in schema.items() if k != "allOf"}}, root, depth + 1, name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = "null" if "null" in kind and name not in KNOWN_ARGS else next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if name in KNOWN_ARGS:
        known = KNOWN_ARGS[name]
        if kind == "string" and isinstance(known, str):
            return known
        if kind == "array" and isinstance(known, str) and name in ("command", "cmd"):
            return ["bash", "-lc", known]
    if kind == "object":
        props = p if isinstance(p := schema.get("properties"), dict) else {}
        required = r if isinstance(r := schema.get("required"), list) else list(props)
        return {k: example_of(props.get(k, {}), root, depth + 1, k) for k in required if isinstance(k, str)}
    if kind == "array":
        n = m if isinstance(m := schema.get("minItems"), int) else 0
        return [example_of(schema.get("items", {}), root, depth + 1) for _ in range(min(n, 3))]
    if kind == "integer":
        low = schema.get("minimum")
        return max(1, low) if isinstance(low, int) else 1
    if kind == "number":
        return 1.0
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return {"date-time": "2026-01-01T00:00:00Z", "date": "2026-01-01", "uri": "https://example.com/",
            "email": "a@example.com"}.get(schema.get("format", ""), "x")


# -- what the request asks for ------------------------------------------------------------------
def _tools(api: str, body: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(kind, name, schema) of each tool the request offers: kind "function" or "custom"."""
    out = []
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
        # (built-in tools, e.g. web search, are never called by the script)
    return out


def _has_tool_result(api: str, body: dict[str, Any]) -> bool:
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


def _choose_tool(api: str, body: dict[str, Any]) -> tuple[str, str, Any] | None:
    tools = _tools(api, body)
    choice = body.get("tool_choice")
    if not tools or choice == "none":
        return None
    kind = choice.get("type") if isinstance(choice, dict) else choice
    forced = choice.get("name") or (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    by_name = {t[1]: t for t in tools}
    if forced in by_name:
        return by_name[forced]
    if _has_tool_result(api, body):
        if kind not in ("required", "any"):
            return None
        # a tool must be called again: an output tool (pydantic-ai's final_result) ends the run
        return next((t for t in tools if t[1].startswith("final_result")), tools[-1])
    return next((by_name[n] for n in PREFERRED_TOOLS if n in by_name), tools[0])


def _structured(api: str, body: dict[str, Any]) -> str | None:
    """The text of a structured answer, when the request asks for one."""
    fmt: Any = body.get("response_format") if api == "chat" else (body.get("text") or {}).get("format")
    if not isinstance(fmt, dict):
        return None
    schema = fmt.get("json_schema", {}).get("schema") if api == "chat" else fmt.get("schema")
    if fmt.get("type") == "json_schema" and isinstance(schema, dict):
        return orjson.dumps(example_of(schema)).decode()
    return "{}" if fmt.get("type") == "json_object" else None


def _call(tool: tuple[str, str, Any]) -> tuple[str, str]:
    """(name, arguments as JSON text, or a custom tool's free-form input)."""
    kind, name, schema = tool
    if kind == "custom":
        return name, SHELL_LINE
    return name, orjson.dumps(example_of(schema) if schema else {}).decode()


def _wants_thinking(body: dict[str, Any]) -> bool:
    thinking = body.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


# -- the answers, per API -------------------------------------------------------------------------
def _sse(obj: Any, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(obj) + b"\n\n"


def _words(text: str) -> list[str]:
    parts = text.split(" ")
    return [p if i == 0 else " " + p for i, p in enumerate(parts)]


def answer(api: str, body: dict[str, Any]) -> Answer:
    """The answer to one request of ``api`` (the gateway's endpoint names: chat, responses...)."""
    handler = {"chat": _chat, "completions": _completions, "responses": _responses, "messages": _messages,
               "count_tokens": _count_tokens, "responses_input_tokens": _count_tokens,
               "embeddings": _embeddings}.get(api)
    if handler is None:
        return Answer(404, body=orjson.dumps({"error": {"message": f"no scripted answer for {api}",
                                                        "type": "invalid_request_error", "code": 404}}))
    return handler(api, body)


def _stream(body: dict[str, Any]) -> bool:
    return bool(body.get("stream"))


def _chat(api: str, body: dict[str, Any]) -> Answer:
    model, created, rid = str(body.get("model", "m")), int(time.time()), "chatcmpl-rec1"
    tool = _choose_tool(api, body)
    text = _structured(api, body) or TEXT
    usage = {"prompt_tokens": 20, "completion_tokens": 8, "total_tokens": 28}
    finish = "tool_calls" if tool else "stop"
    calls: list[dict[str, Any]] = []
    if tool:
        name, args = _call(tool)
        calls = [{"id": "call_rec1", "type": "function", "function": {"name": name, "arguments": args}}]
    if not _stream(body):
        message: dict[str, Any] = {"role": "assistant", "content": None if tool else text}
        if calls:
            message["tool_calls"] = calls
        return Answer(body=orjson.dumps({"id": rid, "object": "chat.completion", "created": created, "model": model,
                                         "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                      "logprobs": None}], "usage": usage}))
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return _sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                          "logprobs": None}]})

    events = [chunk({"role": "assistant", "content": ""})]
    if calls:
        fn = calls[0]["function"]
        events.append(chunk({"tool_calls": [{"index": 0, "id": "call_rec1", "type": "function",
                                             "function": {"name": fn["name"], "arguments": ""}}]}))
        events.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": fn["arguments"]}}]}))
    else:
        events += [chunk({"content": w}) for w in _words(text)]
    events.append(chunk({}, finish))
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(_sse({**head, "choices": [], "usage": usage}))
    events.append(b"data: [DONE]\n\n")
    return Answer(content_type="text/event-stream", events=events)


def _completions(api: str, body: dict[str, Any]) -> Answer:
    out = {"id": "cmpl-rec1", "object": "text_completion", "created": int(time.time()),
           "model": str(body.get("model", "m")),
           "choices": [{"index": 0, "text": TEXT, "finish_reason": "stop", "logprobs": None}],
           "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}}
    if not _stream(body):
        return Answer(body=orjson.dumps(out))
    return Answer(content_type="text/event-stream", events=[_sse(out), b"data: [DONE]\n\n"])


def _responses(api: str, body: dict[str, Any]) -> Answer:
    tool = _choose_tool(api, body)
    text = _structured(api, body) or TEXT
    items: list[dict[str, Any]] = []
    if isinstance(body.get("reasoning"), dict):  # a reasoning item, which agents send back (Codex)
        items.append({"type": "reasoning", "id": "rs_rec1", "summary": [
            {"type": "summary_text", "text": "**Writing the file**"}], "encrypted_content": "ZW5jcnlwdGVk"})
    if tool:
        name, args = _call(tool)
        items.append({"type": "custom_tool_call", "id": "ctc_rec1", "call_id": "call_rec1", "name": name,
                      "input": args, "status": "completed"} if tool[0] == "custom" else
                     {"type": "function_call", "id": "fc_rec1", "call_id": "call_rec1", "name": name,
                      "arguments": args, "status": "completed"})
    else:
        items.append({"type": "message", "id": "msg_rec1", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    base: dict[str, Any] = {
            "id": "resp_rec1", "object": "response", "created_at": int(time.time()), "model": str(body.get("model")),
            "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
            "parallel_tool_calls": True, "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto", "tools": [],
            "text": body.get("text") or {"format": {"type": "text"}}}
    usage = {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 8,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 28}
    done = {**base, "status": "completed", "output": items, "usage": usage}
    if not _stream(body):
        return Answer(body=orjson.dumps(done))
    seq = iter(range(1_000_000))

    def ev(kind: str, **fields: Any) -> bytes:
        return _sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

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


def _messages(api: str, body: dict[str, Any]) -> Answer:
    tool = _choose_tool(api, body)
    blocks: list[dict[str, Any]] = []
    if _wants_thinking(body):
        blocks.append({"type": "thinking", "thinking": "The user wants a file written.", "signature": "c2lnbmF0dXJl"})
    if tool:
        name, args = _call(tool)
        blocks.append({"type": "tool_use", "id": "toolu_rec1", "name": name, "input": orjson.loads(args)})
    else:
        blocks.append({"type": "text", "text": TEXT})
    stop = "tool_use" if tool else "end_turn"
    usage = {"input_tokens": 20, "output_tokens": 8, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    msg = {"id": "msg_rec1", "type": "message", "role": "assistant", "model": str(body.get("model")),
           "content": blocks, "stop_reason": stop, "stop_sequence": None, "usage": usage}
    if not _stream(body):
        return Answer(body=orjson.dumps(msg))
    events = [_sse({"type": "message_start", "message": {**msg, "content": [], "stop_reason": None,
                                                         "usage": {**usage, "output_tokens": 1}}}, "message_start")]
    for i, block in enumerate(blocks):
        kind = block["type"]
        start = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                 "tool_use": {**block, "input": {}}, "text": {"type": "text", "text": ""}}[kind]
        events.append(_sse({"type": "content_block_start", "index": i, "content_block": start}, "content_block_start"))
        deltas: Iterator[dict[str, Any]]
        if kind == "thinking":
            deltas = iter([{"type": "thinking_delta", "thinking": block["thinking"]},
                           {"type": "signature_delta", "signature": block["signature"]}])
        elif kind == "tool_use":
            deltas = iter([{"type": "input_json_delta", "partial_json": orjson.dumps(block["input"]).decode()}])
        else:
            deltas = ({"type": "text_delta", "text": w} for w in _words(block["text"]))
        events += [_sse({"type": "content_block_delta", "index": i, "delta": d}, "content_block_delta") for d in deltas]
        events.append(_sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
    events.append(_sse({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                        "usage": {"output_tokens": 8}}, "message_delta"))
    events.append(_sse({"type": "message_stop"}, "message_stop"))
    return Answer(content_type="text/event-stream", events=events)


def _count_tokens(api: str, body: dict[str, Any]) -> Answer:
    return Answer(body=orjson.dumps({"input_tokens": max(1, len(orjson.dumps(body)) // 4)}))


def _embeddings(api: str, body: dict[str, Any]) -> Answer:
    inputs = body.get("input")
    count = len(inputs) if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int) else 1
    dims = d if isinstance(d := body.get("dimensions"), int) else 8
    vector = [round(1.0 / (i + 1), 4) for i in range(dims)]
    encoded: Any = vector
    if body.get("encoding_format") == "base64":
        encoded = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
    return Answer(body=orjson.dumps({"object": "list", "model": str(body.get("model")),
                                     "data": [{"object": "embedding", "index": i, "embedding": encoded}
                                              for i in range(count)],
                                     "usage": {"prompt_tokens": 4, "total_tokens": 4}}))
