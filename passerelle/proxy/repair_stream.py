"""Tool-call repair of a stream (repair.py says what and when), one repairer per API: chat's
here, Responses' and Messages' in repair_events.py.

The relay (relay.py) hands a repairer each read's complete events, before it scans them; the
repairer returns the events the client gets instead. An event with no generated text passes as
its bytes; an event whose text the parser gives back unchanged passes as its bytes too; the rest
are written again in the API's words:

* chat: text deltas (``content``, ``reasoning_content``, ``reasoning``) minus the markup, and per
  call a ``delta.tool_calls`` chunk with its id, type and name, then one with its arguments;
  ``finish_reason: "tool_calls"``.
* Responses: a message item is opened only once it has text to say (its ``output_item.added`` and
  ``content_part.added`` held until then), closed before a call's ``function_call`` item (added,
  arguments delta and done, item done), opened again, as a new item, for text after it; every
  event is numbered again (``sequence_number``, ``output_index``), and ``response.completed``
  lists the items the client was sent.
* Messages: a text block likewise, a ``tool_use`` block per call (start, ``input_json_delta``,
  stop), blocks numbered again, ``stop_reason: "tool_use"``.

Once the runtime sends a tool call of its own, its parser did the work: from there the stream
passes as it comes (Responses and Messages still renumbered after what was inserted before).
"""

from __future__ import annotations

from typing import Any

import orjson

from passerelle.proxy.repair import Channel, Piece, StreamRepair, ToolRepair, as_dict, event_data, new_id, sse_event
from passerelle.proxy.repair_events import MessagesRepair, ResponsesRepair
from passerelle.proxy.toolcalls import ToolCall

_CHAT_TEXT = ("content", "reasoning_content", "reasoning")
_MAX_CHOICES = 128  # choices repaired in one stream (n); each holds a parser


def stream_repair(repair: ToolRepair, grammar: str) -> StreamRepair:
    """A repairer for one stream (one attempt) of ``grammar`` ("chat", "responses", "messages")."""
    repair.start_attempt()
    if grammar == "responses":
        return ResponsesRepair(repair)
    if grammar == "messages":
        return MessagesRepair(repair)
    return ChatRepair(repair)


# -- chat completions -----------------------------------------------------------------------------
class _Choice:
    __slots__ = ("calls", "channels", "done")

    def __init__(self) -> None:
        self.channels: dict[str, Channel] = {}
        self.calls = 0
        self.done = False


class ChatRepair(StreamRepair):
    def __init__(self, repair: ToolRepair) -> None:
        self.repair = repair
        self.choices: dict[int, _Choice] = {}
        self.native = False  # the runtime sent tool calls itself
        self.last: dict[str, Any] = {}  # the last chunk (its id, created, model... for what is flushed)

    def feed(self, events: list[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for ev in events:
            if self.native:
                out.append(ev)
                continue
            data = event_data(ev)
            if data is None:
                out.append(ev)
                continue
            if data == b"[DONE]":
                out += self._flush_all()
                out.append(ev)
                continue
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                out.append(ev)
                continue
            choices = obj.get("choices") if isinstance(obj, dict) else None
            if not isinstance(choices, list) or not choices:
                out.append(ev)  # (the usage chunk, an error)
                continue
            self.last = obj
            out += self._event(ev, obj, choices)
        return out

    def _event(self, ev: bytes, obj: dict[str, Any], choices: list[Any]) -> list[bytes]:
        # First what each choice's text gives; the event is written again only when that is not
        # the text it carries (the common case, text without markup, passes as its bytes).
        said: list[tuple[dict[str, Any], int, _Choice, dict[str, Any], list[dict[str, Any]], Any]] = []
        same = True
        for ch in choices:
            if not isinstance(ch, dict):
                same = False
                continue
            idx = ch.get("index", 0)
            idx = idx if isinstance(idx, int) else 0
            delta = as_dict(ch.get("delta"))
            if delta.get("tool_calls"):
                self.native = True
                return [*self._flush_all(), ev]
            state = self.choices.get(idx)
            if state is None:
                if len(self.choices) >= _MAX_CHOICES:  # (a runtime inventing choices: passed on as they come)
                    return [ev]
                state = self.choices[idx] = _Choice()
            deltas: list[dict[str, Any]] = []
            for field in _CHAT_TEXT:
                text = delta.get(field)
                if not isinstance(text, str) or not text:
                    continue
                channel = state.channels.get(field)
                if channel is None:
                    channel = state.channels[field] = Channel(self.repair)
                pieces = channel.feed(text)
                if len(pieces) != 1 or pieces[0] != text:
                    same = False
                deltas += self._deltas(state, field, pieces)
            finish = ch.get("finish_reason")
            if finish:
                flushed = self._finish(state)
                if flushed:
                    deltas += flushed
                    same = False
                if state.calls and finish == "stop":
                    finish = "tool_calls"
                    same = False
            said.append((ch, idx, state, delta, deltas, finish))
        if same:
            return [ev]  # (nothing repaired: the runtime's bytes)
        out: list[bytes] = []
        first = True
        for ch, idx, _, delta, deltas, finish in said:
            rest = {k: v for k, v in delta.items() if k not in _CHAT_TEXT or not isinstance(v, str)}
            if not deltas or rest:
                deltas.insert(0, {})
            deltas[0] = {**rest, **deltas[0]}
            others = {k: v for k, v in ch.items() if k not in ("delta", "finish_reason", "logprobs")}
            for i, d in enumerate(deltas):
                last = i == len(deltas) - 1
                logprobs = ch.get("logprobs") if i == 0 else None
                if not d and not (last and finish) and not logprobs:
                    continue  # (all of it held back, or markup alone)
                chunk = {**obj, "choices": [{**others, "index": idx, "delta": d, "logprobs": logprobs,
                                             "finish_reason": finish if last else None}]}
                if not first:
                    chunk.pop("usage", None)
                first = False
                out.append(sse_event(chunk))
        if not out and "usage" in obj:
            out.append(sse_event({**obj, "choices": []}))
        return out

    def _deltas(self, state: _Choice, field: str, pieces: list[Piece]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for p in pieces:
            if not isinstance(p, ToolCall):
                into, text = (field, p) if isinstance(p, str) else (
                    "reasoning_content" if field == "content" else field, p.text)
                if out and into in out[-1] and len(out[-1]) == 1:
                    out[-1][into] += text
                else:
                    out.append({into: text})
                continue
            i = state.calls
            state.calls += 1
            out.append({"tool_calls": [{"index": i, "id": new_id("call_"), "type": "function",
                                        "function": {"name": p.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": p.arguments}}]})
        return out

    def _finish(self, state: _Choice) -> list[dict[str, Any]]:
        if state.done:
            return []
        state.done = True
        out: list[dict[str, Any]] = []
        for field, channel in state.channels.items():
            out += self._deltas(state, field, channel.finish())
        return out

    def _flush_all(self) -> list[bytes]:
        """What is still held, before [DONE] (a runtime that sent no finish_reason) or a native call."""
        out: list[bytes] = []
        template = {k: v for k, v in self.last.items() if k not in ("choices", "usage")}
        for idx, state in self.choices.items():
            for d in self._finish(state):
                out.append(sse_event({**template, "choices": [{"index": idx, "delta": d, "logprobs": None,
                                                               "finish_reason": None}]}))
        return out
