"""Tool calls a runtime left as text, delivered as the API's own tool calls (``[[models]] tool_calls``).

A runtime whose parser missed a model's tool-call markup (Hermes' ``<tool_call>``, Qwen3's XML,
Mistral's ``[TOOL_CALLS]``, Llama 3's JSON, Harmony's channels: the parsers are
proxy/toolcalls/) answers with that markup as text, in content or in reasoning. With repair on for
the model and tools in the request, the gateway reads that text and answers with what the client
asked for: chat ``tool_calls`` (``finish_reason: "tool_calls"``), Responses ``function_call``
items, Messages ``tool_use`` blocks (``stop_reason: "tool_use"``). Streams are repaired event by
event (repair_stream.py), holding back only what may be the start of a tag; answers the runtime
sends whole are repaired here (:func:`repair_body`); answers assembled from a stream are
assembled from the repaired events (attempt.py).

* Off (the default), or a request without tools: nothing here runs (:func:`repair_for` is None),
  and the client gets the runtime's bytes.
* A runtime that made the tool calls itself: its answer is left as it is.
* Markup that cannot be repaired (unknown tool, arguments that do not fit the schema, a call cut
  short) passes through as the text it was, and is counted.
* Whitespace next to a repaired call is not text the client needs (``content`` is ``null`` when
  nothing else was said): it is dropped, whatever the stream's splits were.

Every call repaired and every failure is counted on the request's record (the access log's
``tool_calls_repaired`` / ``tool_calls_unrepaired``, ``passerelle_tool_call_repairs_total``).

Example::

    repair = repair_for("hermes", "chat", {"tools": [...], "messages": [...]}, rec)
    body = repair_body(repair, raw)          # a whole chat answer with its markup made tool_calls
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import orjson

from passerelle.errors import UpstreamError
from passerelle.observe.record import RequestRecord, clip
from passerelle.proxy.toolcalls import Reasoning, ToolCall, Unrepaired, parser_for, tool_schemas
from passerelle.proxy.toolcalls import Text as Said

_APIS = ("chat", "responses", "messages")
_MAX_BLANK = 4096  # whitespace held back after text, in characters


@dataclass(frozen=True, slots=True)
class Thought:
    """Reasoning found in the text itself (Harmony's ``analysis`` channel): said as the API's reasoning."""

    text: str


Piece = str | ToolCall | Thought  # what a channel gives: text to say, a call, reasoning


def new_id(prefix: str) -> str:
    """A fresh tool-call id: ``call_…`` (chat, Responses' call_id), ``toolu_…``, ``fc_…``."""
    return prefix + os.urandom(12).hex()


class ToolRepair:
    """One request's repair: the format, the tools it offered, and where its counts go."""

    __slots__ = ("fed", "fmt", "rec", "tools")

    def __init__(self, fmt: str, tools: list[Any], rec: RequestRecord) -> None:
        self.fmt, self.tools, self.rec = fmt, tools, rec
        self.fed = 0  # text deltas taken from the runtime's streams
        rec.tool_call_format = fmt

    def channel(self) -> Channel:
        return Channel(self)

    def start_attempt(self) -> None:
        """A new attempt's answer: the counts are of the answer the client gets (a retry's, not
        those of an attempt that failed before its first byte)."""
        rec = self.rec
        rec.tool_calls_repaired = rec.tool_calls_unrepaired = 0
        rec.tool_call_failure = ""

    def repaired(self, fmt: str) -> None:
        self.rec.tool_calls_repaired += 1
        if fmt and fmt != self.fmt:  # ("auto": the format it found)
            self.rec.tool_call_format = fmt

    def unrepaired(self, reason: str) -> None:
        rec = self.rec
        rec.tool_calls_unrepaired += 1
        if not rec.tool_call_failure:
            rec.tool_call_failure = clip(reason, 200)


def repair_for(fmt: str, api: str, data: dict[str, Any] | None, rec: RequestRecord) -> ToolRepair | None:
    """The request's repair; None when it is off, for an API without tool calls, or a request that
    offered no tool (nothing can be a call of one) or said none may be called (``tool_choice``)."""
    if fmt == "off" or api not in _APIS or data is None or not data.get("tools"):
        return None
    choice = data.get("tool_choice")
    if choice == "none" or (isinstance(choice, dict) and choice.get("type") == "none"):
        return None
    tools = tool_schemas(api, data)
    if not tools:
        return None
    return ToolRepair(fmt, tools, rec)


class Channel:
    """One run of text (a choice's content, its reasoning, a message item, a text block) through
    the format's parser: :meth:`feed` and :meth:`finish` give text to say and calls. Whitespace
    next to a call is dropped: the text's trailing whitespace is held until more text comes, and
    what follows a call starts at its first non-blank character, so the result does not depend on
    where the runtime's chunks were cut."""

    __slots__ = ("after_call", "blank", "calls", "parser", "repair")

    def __init__(self, repair: ToolRepair) -> None:
        self.repair = repair
        self.parser = parser_for(repair.fmt, repair.tools)
        self.blank = ""  # trailing whitespace held back
        self.after_call = False
        self.calls = 0

    def feed(self, text: str) -> list[Piece]:
        self.repair.fed += 1
        if self.parser is None:
            return self._text(text, [])
        return self._take(self.parser.feed(text))

    def finish(self) -> list[Piece]:
        out = self._take(self.parser.finish()) if self.parser is not None else []
        if self.blank and not self.calls:
            out.append(self.blank)
        self.blank = ""
        return out

    def _take(self, pieces: list[Any]) -> list[Piece]:
        out: list[Piece] = []
        for p in pieces:
            if isinstance(p, ToolCall):
                self.repair.repaired(self.parser.format if self.parser is not None else "")
                self.calls += 1
                self.blank, self.after_call = "", True
                out.append(p)
            elif isinstance(p, Unrepaired):
                self.repair.unrepaired(p.reason)
                self._text(p.text, out, strip=False)
            elif isinstance(p, Said):
                self._text(p.text, out)
            elif isinstance(p, Reasoning) and p.text:
                if out and isinstance(out[-1], Thought):
                    out[-1] = Thought(out[-1].text + p.text)
                else:
                    out.append(Thought(p.text))
        return out

    def _text(self, text: str, out: list[Piece], *, strip: bool = True) -> list[Piece]:
        if self.after_call and strip:
            text = text.lstrip()
            if not text:
                return out
        self.after_call = False
        body = text.rstrip() if strip else text
        if body:
            said = self.blank + body
            self.blank = text[len(body):]
            if out and isinstance(out[-1], str):
                out[-1] += said
            else:
                out.append(said)
        else:
            self.blank += text
            if len(self.blank) > _MAX_BLANK:  # (whitespace without end: said, rather than held without bound)
                out.append(self.blank)
                self.blank = ""
        return out


def split_text(repair: ToolRepair, text: str) -> list[Piece]:
    """A whole text's pieces: its text and its calls, in order."""
    ch = Channel(repair)
    out = ch.feed(text)
    for p in ch.finish():
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out


def object_arguments(call: ToolCall) -> bool:
    """Are the call's arguments a JSON object (what a Messages tool_use input must be)?"""
    try:
        return isinstance(orjson.loads(call.arguments), dict)
    except orjson.JSONDecodeError:
        return False


# -- answers the runtime sent whole ---------------------------------------------------------------
def repair_body(repair: ToolRepair, api: str, raw: bytes) -> bytes:
    """``raw`` (a whole answer of ``api``) with the tool calls its text holds made the API's own;
    ``raw`` itself when it holds none, was not JSON, or has tool calls of the runtime's already."""
    repair.start_attempt()
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw
    if not isinstance(obj, dict):
        return raw
    fix = {"chat": _chat_body, "responses": _responses_body, "messages": _messages_body}[api]
    if not fix(repair, obj):
        return raw
    try:
        return orjson.dumps(obj)
    except TypeError:  # (nested past what orjson writes: the runtime's answer as it came)
        return raw


def _chat_body(repair: ToolRepair, obj: dict[str, Any]) -> bool:
    changed = False
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        msg = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(msg, dict) or msg.get("tool_calls"):
            continue
        calls: list[dict[str, Any]] = []
        for field in ("content", "reasoning_content", "reasoning"):
            text = msg.get(field)
            if not isinstance(text, str) or not text:
                continue
            pieces = split_text(repair, text)
            if all(isinstance(p, str) for p in pieces):
                continue
            said = "".join(p for p in pieces if isinstance(p, str))
            msg[field] = said if said or field != "content" else None
            if field != "content" and not said:
                del msg[field]
            if thought := "".join(p.text for p in pieces if isinstance(p, Thought)):
                into = "reasoning_content" if field == "content" else field
                before = msg.get(into)
                msg[into] = (before if isinstance(before, str) else "") + thought
                changed = True
            calls += [{"id": new_id("call_"), "type": "function",
                       "function": {"name": p.name, "arguments": p.arguments}}
                      for p in pieces if isinstance(p, ToolCall)]
        if calls:
            changed = True
            msg["tool_calls"] = calls
            if msg.get("content") == "":
                msg["content"] = None
            if choice.get("finish_reason") in ("stop", None):
                choice["finish_reason"] = "tool_calls"
    return changed


def function_call_item(call: ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "id": new_id("fc_"), "call_id": new_id("call_"), "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": new_id("rs_"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _responses_body(repair: ToolRepair, obj: dict[str, Any]) -> bool:
    output = obj.get("output")
    if not isinstance(output, list) or any(isinstance(i, dict) and i.get("type") == "function_call"
                                           for i in output):
        return False
    out: list[Any] = []
    changed = False
    for item in output:
        parts = item.get("content") if isinstance(item, dict) and item.get("type") == "message" else None
        if not isinstance(parts, list):
            out.append(item)
            continue
        current: list[Any] = []  # the parts of the message being rebuilt
        for part in parts:
            text = part.get("text") if isinstance(part, dict) and part.get("type") == "output_text" else None
            pieces = split_text(repair, text) if isinstance(text, str) and text else []
            if all(isinstance(p, str) for p in pieces):
                current.append(part)
                continue
            changed = True
            for p in pieces:
                if isinstance(p, str):
                    current.append({**part, "text": p, "annotations": []})
                    continue
                if current:
                    out.append({**item, "content": current})
                    current = []
                out.append(function_call_item(p) if isinstance(p, ToolCall) else reasoning_item(p.text))
        if current:
            again = any(o.get("id") == item.get("id") for o in out if isinstance(o, dict))
            out.append({**item, "content": current, **({"id": new_id("msg_")} if again else {})})
    if changed:
        obj["output"] = out
    return changed


def _messages_body(repair: ToolRepair, obj: dict[str, Any]) -> bool:
    content = obj.get("content")
    if not isinstance(content, list) or any(isinstance(b, dict) and b.get("type") == "tool_use" for b in content):
        return False
    out: list[Any] = []
    changed = False
    for block in content:
        text = block.get("text") if isinstance(block, dict) and block.get("type") == "text" else None
        pieces = split_text(repair, text) if isinstance(text, str) and text else []
        if all(isinstance(p, str) for p in pieces):
            out.append(block)
            continue
        changed = True
        for p in pieces:
            if isinstance(p, str):
                out.append({**block, "text": p})
            elif isinstance(p, Thought):
                out.append({"type": "thinking", "thinking": p.text, "signature": ""})
            elif object_arguments(p):
                out.append({"type": "tool_use", "id": new_id("toolu_"), "name": p.name,
                            "input": orjson.loads(p.arguments)})
            else:  # (not an object: no tool_use can carry it)
                out.append({"type": "text", "text": p.arguments})
    if changed:
        obj["content"] = out
        if obj.get("stop_reason") in ("end_turn", None) and any(
                isinstance(b, dict) and b.get("type") == "tool_use" for b in out):
            obj["stop_reason"] = "tool_use"
    return changed


# -- streams: what the repairers of repair_stream.py and repair_events.py share -----------------------
def event_data(ev: bytes) -> bytes | None:
    """The data of one event (its ``data:`` lines joined), or None."""
    if ev.startswith(b"data: ") and ev.find(b"\n", 6) == len(ev) - 2:  # (one data line: the usual)
        return ev[6:-2]
    lines = [line[5:].strip() for line in ev.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def event_object(ev: bytes) -> dict[str, Any] | None:
    """The JSON object one event carries, or None (a comment, ``[DONE]``, data that is no object)."""
    data = event_data(ev)
    if data is None:
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def sse_event(obj: Any, event: bytes = b"") -> bytes:
    head = b"event: " + event + b"\n" if event else b""
    try:
        return head + b"data: " + orjson.dumps(obj) + b"\n\n"
    except TypeError:  # the runtime's JSON nested past what orjson writes (254 levels): its fault
        raise UpstreamError("The model runtime's stream is nested too deeply to be repaired.") from None


class StreamRepair:
    """The interface the relay sees: events in, events out; ``repair.fed``, the runtime's text
    deltas taken (a call being held is generated text too: it moves the between-tokens deadline)."""

    repair: ToolRepair

    def feed(self, events: list[bytes]) -> list[bytes]:
        raise NotImplementedError
