"""The judge of one tool-using turn: did the answer give the client a tool call it can run?

A turn passes when, read the way the API's client reads it:

1. the answer is a 200 and carries at least one tool call in the API's own shape (chat
   ``tool_calls``, Responses ``function_call`` / ``custom_tool_call`` items, Messages ``tool_use``
   blocks), each naming a tool the request offered, with unique ids;
2. each call's arguments are a JSON object that fits the tool's schema (tool_schema.py);
3. no tool-call markup is left in the text (:data:`MARKUP`: the formats models write when no
   parser took the call out, and a bare JSON call as the whole text);
4. the answer ends as the client expects: chat ``finish_reason: "tool_calls"`` and, streamed,
   ``data: [DONE]`` last; Responses ``status: "completed"`` and, streamed, ``response.completed``
   last; Messages ``stop_reason: "tool_use"`` and, streamed, ``message_stop`` last.

:func:`read_reply` assembles an answer (JSON or SSE bytes) into a :class:`Reply`; :func:`judge`
gives the :class:`Verdict`. Pure functions of bytes: the unit tests feed them crafted answers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from passerelle.bench.tool_schema import problems

# Tool-call markup that must not reach a client as text: Hermes/Qwen, Qwen3-Coder's XML, Mistral,
# Llama 3's python tag, Harmony (gpt-oss), and the other families' section tokens.
MARKUP = re.compile("|".join([
    r"</?tool_call>", r"<function=[^>\s]*>", r"<parameter=[^>\s]*>", r"\[TOOL_CALLS\]", r"\[ARGS\]",
    r"<\|python_tag\|>", r"<\|call\|>", r"<\|channel\|>", r"<\|constrain\|>", r"\bto=functions\.",
    r"<\|tool_calls?_section_begin\|>", r"<\|tool_call_begin\|>", r"<｜tool▁calls?▁begin｜>",
    r"<\|tool_call_start\|>", r"<tool_calls>", r"<function_calls?>", r"<start_function_call>",
    r"\bfunctools\[",
]))
# A bare JSON call as the whole text (Llama 3 without its tag, Hermes without its tags).
_BARE = re.compile(r'^\s*\[?\s*\{\s*"(name|type|function)"\s*:')
MAX_EVENTS = 100_000  # a stream longer than this is read no further (and fails: it did not end)

# What each API's client expects at the end: (stop field value, last stream event)
EXPECTED = {"chat": ("tool_calls", "[DONE]"), "responses": ("completed", "response.completed"),
            "messages": ("tool_use", "message_stop")}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text (Messages' input re-encoded), or a custom tool's free-form input
    id: str
    custom: bool = False


@dataclass(frozen=True)
class Reply:
    """An answer as its client assembled it."""

    status: int
    calls: tuple[ToolCall, ...] = ()
    text: str = ""  # every text the client shows: content, output_text, text blocks
    stop: str | None = None  # finish_reason, Responses' status, stop_reason
    last_event: str | None = None  # a stream's last event ([DONE], a Responses/Messages type)
    error: str = ""  # why the answer could not be read, or the error it carried


@dataclass(frozen=True)
class Verdict:
    passed: bool
    failures: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (kind, detail)

    @property
    def kinds(self) -> list[str]:
        return sorted({k for k, _ in self.failures})


# -- the request's tools --------------------------------------------------------------------------
def offered_tools(api: str, body: dict[str, Any]) -> dict[str, Any]:
    """Tool name -> its arguments' JSON schema (None for a free-form custom tool)."""
    out: dict[str, Any] = {}
    for tool in body.get("tools") or ():
        if not isinstance(tool, dict):
            continue
        if isinstance(tool.get("function"), dict):  # chat
            out[str(tool["function"].get("name"))] = tool["function"].get("parameters") or {}
        elif api == "messages" and "input_schema" in tool:
            out[str(tool.get("name"))] = tool["input_schema"] or {}
        elif tool.get("type") == "function" and "name" in tool:  # Responses
            out[str(tool["name"])] = tool.get("parameters") or {}
        elif tool.get("type") == "custom" and "name" in tool:
            out[str(tool["name"])] = None
    return out


# -- reading an answer ----------------------------------------------------------------------------
def _events(raw: bytes) -> list[tuple[str | None, str]]:
    """A stream's events as (event name, data text), in order."""
    out: list[tuple[str | None, str]] = []
    for block in re.split(r"\r?\n\r?\n", raw.decode("utf-8", errors="replace")):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
        if data:
            out.append((name, "\n".join(data)))
        if len(out) >= MAX_EVENTS:
            break
    return out


def read_reply(api: str, stream: bool, status: int, raw: bytes) -> Reply:
    """The answer ``raw`` (the whole body) to a request of ``api``, as its client assembles it."""
    if status != 200:
        return Reply(status, error=raw[:300].decode("utf-8", errors="replace"))
    try:
        if not stream:
            obj = json.loads(raw)
            return {"chat": _chat, "responses": _responses, "messages": _messages}[api](obj)
        return {"chat": _chat_stream, "responses": _responses_stream, "messages": _messages_stream}[api](_events(raw))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        return Reply(status, error=f"unreadable answer: {type(exc).__name__}: {exc}")


def _chat(obj: dict[str, Any]) -> Reply:
    choice = obj["choices"][0]
    message = choice.get("message") or {}
    calls = tuple(ToolCall(str(c["function"].get("name")), str(c["function"].get("arguments") or ""), str(c.get("id")))
                  for c in message.get("tool_calls") or ())
    return Reply(200, calls, message.get("content") or "", choice.get("finish_reason"))


def _chat_stream(events: list[tuple[str | None, str]]) -> Reply:
    text, finish, last = [], None, None
    calls: dict[int, dict[str, str]] = {}
    for _, data in events:
        last = data.strip() if data.strip() == "[DONE]" else "chunk"
        if last == "[DONE]":
            continue
        obj = json.loads(data)
        if "error" in obj:
            return Reply(200, error=f"error event: {str(obj['error'])[:200]}", last_event="error")
        for choice in obj.get("choices") or ():
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str):
                text.append(delta["content"])
            for c in delta.get("tool_calls") or ():
                slot = calls.setdefault(int(c.get("index", 0)), {"id": "", "name": "", "arguments": ""})
                slot["id"] = c.get("id") or slot["id"]
                fn = c.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    out = tuple(ToolCall(c["name"], c["arguments"], c["id"]) for _, c in sorted(calls.items()))
    return Reply(200, out, "".join(text), finish, last)


def _response_calls(items: list[dict[str, Any]]) -> tuple[ToolCall, ...]:
    out = []
    for item in items:
        if item.get("type") == "function_call":
            out.append(ToolCall(str(item.get("name")), str(item.get("arguments") or ""), str(item.get("call_id"))))
        elif item.get("type") == "custom_tool_call":
            out.append(ToolCall(str(item.get("name")), str(item.get("input") or ""), str(item.get("call_id")), True))
    return tuple(out)


def _response_text(items: list[dict[str, Any]]) -> str:
    return "".join(str(part.get("text") or "") for item in items if item.get("type") == "message"
                   for part in item.get("content") or () if isinstance(part, dict))


def _responses(obj: dict[str, Any]) -> Reply:
    items = [i for i in obj.get("output") or () if isinstance(i, dict)]
    return Reply(200, _response_calls(items), _response_text(items), obj.get("status"))


def _responses_stream(events: list[tuple[str | None, str]]) -> Reply:
    items: list[dict[str, Any]] = []
    text, status, last = [], None, None
    for name, data in events:
        obj = json.loads(data)
        last = obj.get("type") or name
        if last == "response.output_text.delta":
            text.append(str(obj.get("delta") or ""))
        elif last == "response.output_item.done":
            items.append(obj.get("item") or {})
        elif last in ("response.completed", "response.incomplete", "response.failed"):
            status = (obj.get("response") or {}).get("status")
        elif last == "error":
            return Reply(200, error=f"error event: {data[:200]}", last_event="error")
    return Reply(200, _response_calls(items), "".join(text), status, last)


def _messages(obj: dict[str, Any]) -> Reply:
    blocks = [b for b in obj.get("content") or () if isinstance(b, dict)]
    calls = tuple(ToolCall(str(b.get("name")), json.dumps(b.get("input")), str(b.get("id")))
                  for b in blocks if b.get("type") == "tool_use")
    text = "".join(str(b.get("text") or "") for b in blocks if b.get("type") == "text")
    return Reply(200, calls, text, obj.get("stop_reason"))


def _messages_stream(events: list[tuple[str | None, str]]) -> Reply:
    blocks: dict[int, dict[str, str]] = {}
    text, stop, last = [], None, None
    for name, data in events:
        obj = json.loads(data)
        last = obj.get("type") or name
        if last == "content_block_start":
            block = obj.get("content_block") or {}
            blocks[int(obj.get("index", 0))] = {"type": str(block.get("type")), "id": str(block.get("id")),
                                                "name": str(block.get("name")), "json": ""}
        elif last == "content_block_delta":
            delta = obj.get("delta") or {}
            if delta.get("type") == "text_delta":
                text.append(str(delta.get("text") or ""))
            elif delta.get("type") == "input_json_delta":
                blocks.setdefault(int(obj.get("index", 0)), {"type": "?", "id": "", "name": "", "json": ""})
                blocks[int(obj.get("index", 0))]["json"] += str(delta.get("partial_json") or "")
        elif last == "message_delta":
            stop = (obj.get("delta") or {}).get("stop_reason") or stop
        elif last == "error":
            return Reply(200, error=f"error event: {data[:200]}", last_event="error")
    calls = tuple(ToolCall(b["name"], b["json"] or "{}", b["id"]) for _, b in sorted(blocks.items())
                  if b["type"] == "tool_use")
    return Reply(200, calls, "".join(text), stop, last)


# -- the verdict ----------------------------------------------------------------------------------
def markup_in(text: str) -> str | None:
    """The first tool-call markup in ``text``, or None."""
    found = MARKUP.search(text)
    if found:
        return found.group(0)
    if _BARE.match(text):
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        first = obj[0] if isinstance(obj, list) and obj else obj
        if isinstance(first, dict) and "name" in first and ({"arguments", "parameters"} & set(first)):
            return text.strip()[:40]
    return None


def judge(api: str, request: dict[str, Any], stream: bool, reply: Reply) -> Verdict:
    """The verdict on ``reply``, the answer to ``request`` (a request of ``api`` offering tools)."""
    failures: list[tuple[str, str]] = []
    if reply.status != 200:
        return Verdict(False, (("http", f"status {reply.status}: {reply.error[:120]}"),))
    if reply.error:
        return Verdict(False, (("unreadable", reply.error[:160]),))
    tools = offered_tools(api, request)
    if not reply.calls:
        failures.append(("no_tool_call", "the answer carries no tool call"))
    ids = [c.id for c in reply.calls]
    if len(set(ids)) != len(ids) or any(not i or i == "None" for i in ids):
        failures.append(("ids", f"tool-call ids not unique or missing: {ids}"))
    for call in reply.calls:
        if call.name not in tools:
            failures.append(("unknown_tool", f"{call.name!r} is not an offered tool"))
            continue
        if call.custom or tools[call.name] is None:
            continue
        try:
            args = json.loads(call.arguments)
        except ValueError:
            failures.append(("arguments", f"{call.name}: arguments are not JSON: {call.arguments[:80]!r}"))
            continue
        if not isinstance(args, dict):
            failures.append(("arguments", f"{call.name}: arguments are not an object"))
            continue
        wrong = problems(tools[call.name], args)
        if wrong:
            failures.append(("arguments", f"{call.name}: {'; '.join(wrong[:3])}"))
    markup = markup_in(reply.text)
    if markup:
        failures.append(("markup", f"tool-call markup in the text: {markup!r}"))
    want_stop, want_last = EXPECTED[api]
    if reply.stop != want_stop:
        failures.append(("stop_reason", f"ended with {reply.stop!r}, expected {want_stop!r}"))
    if stream and reply.last_event != want_last:
        failures.append(("stream_end", f"the stream's last event is {reply.last_event!r}, expected {want_last!r}"))
    return Verdict(not failures, tuple(failures))
