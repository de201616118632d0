"""Tool-call repair of a Responses or an Anthropic Messages stream (repair_stream.py says how a
stream is repaired; repair.py what and when).

* Responses: a message item is opened with the client only once it has text to say, closed
  before a call's ``function_call`` item, opened again, as a new item, for text after it;
  reasoning found in the text is a reasoning item of its own; every event is numbered again once
  one was held, dropped or added, and ``response.completed`` lists the items the client was sent.
* Messages: a text block likewise, a ``tool_use`` block per call, a thinking block for
  reasoning, blocks numbered again, ``stop_reason: "tool_use"``.
"""

from __future__ import annotations

from typing import Any

from passerelle.proxy.repair import (
    Channel,
    Piece,
    StreamRepair,
    Thought,
    ToolRepair,
    as_dict,
    event_object,
    function_call_item,
    new_id,
    object_arguments,
    reasoning_item,
    sse_event,
)
from passerelle.proxy.toolcalls import ToolCall

# a message item's own events (by its item_id; a runtime that leaves the id out: while it is open)
_MESSAGE_EVENTS = frozenset(("response.content_part.added", "response.content_part.done", "response.output_text.delta",
                             "response.output_text.done", "response.output_text.annotation.added"))


# -- Responses ------------------------------------------------------------------------------------
class ResponsesRepair(StreamRepair):
    def __init__(self, repair: ToolRepair) -> None:
        self.repair = repair
        self.seq = 0
        self.native = False
        self.outputs: dict[int, dict[str, Any]] = {}  # the items the client was sent, done, by output_index
        self.index: dict[int, int] = {}  # the runtime's output_index -> the client's
        self.next_out = 0
        self.changed = False  # a call was made of text: completed's output is rebuilt
        # the runtime's message item being repaired
        self.msg: dict[str, Any] | None = None  # its item, as the runtime added it
        self.part: dict[str, Any] | None = None  # its content part, as added
        self.channel: Channel | None = None
        self.open: dict[str, Any] | None = None  # the message item open with the client: id, out, text
        self.pieces = 0  # messages opened for the runtime's one
        self.thinking: dict[str, Any] | None = None  # a reasoning item open with the client (Harmony's analysis)
        self.by_id: dict[str, int] = {}  # the runtime's items passed on, by id -> the client's output_index
        self.diverged = False  # an event held, dropped or added: from then on every event is numbered again

    def _emit(self, kind: str, obj: dict[str, Any]) -> bytes:
        obj = {"type": kind, **{k: v for k, v in obj.items() if k not in ("type", "sequence_number")},
               "sequence_number": self.seq}
        self.seq += 1
        return sse_event(obj, kind.encode())

    def feed(self, events: list[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for ev in events:
            obj = event_object(ev)
            kind = obj.get("type") if obj is not None else None
            if obj is None or not isinstance(kind, str) or not kind.startswith("response."):
                out.append(ev)  # (a comment, an error event)
                continue
            out += self._event(ev, kind, obj)
        return out

    def _pass(self, ev: bytes, kind: str, obj: dict[str, Any], out: int | None = None) -> list[bytes]:
        """A runtime's event to the client: its bytes while nothing was held, dropped or added
        before it (and its numbers are the client's), else written again with the client's."""
        if out is None and ("output_index" in obj or "item_id" in obj):
            out = self._out_index(obj)
        if not self.diverged and obj.get("sequence_number") == self.seq and (
                out is None or obj.get("output_index") == out):
            self.seq += 1
            return [ev]
        return [self._emit(kind, obj if out is None else {**obj, "output_index": out})]

    def _out_index(self, obj: dict[str, Any]) -> int:
        """The client's output_index of the item an event is about: by its id, else by the
        runtime's index, else the item added last."""
        item = obj.get("item")
        named = obj.get("item_id", item.get("id") if isinstance(item, dict) else None)
        if isinstance(named, str) and named in self.by_id:
            return self.by_id[named]
        at = obj.get("output_index")
        return self.index.get(at, self.next_out - 1) if isinstance(at, int) else max(self.next_out - 1, 0)

    def _end_message(self, done: dict[str, Any] | None = None) -> list[bytes]:
        """The runtime's message item is over: what its parser held, then its items closed."""
        if self.msg is None or self.channel is None:
            return []
        out = self._pieces(self.channel.finish())
        out += self._close_thinking()
        out += self._close(done)
        self.msg = self.channel = None
        return out

    def _event(self, ev: bytes, kind: str, obj: dict[str, Any]) -> list[bytes]:
        item = obj.get("item") if isinstance(obj.get("item"), dict) else None
        if kind == "response.output_item.added" and item is not None:
            at = obj.get("output_index")
            ended = self._end_message()  # (one the runtime never said was done)
            if item.get("type") == "message" and not self.native:
                self.msg, self.part, self.channel, self.open = item, None, Channel(self.repair), None
                self.pieces = 0
                self.diverged = True
                if isinstance(at, int):
                    self.index[at] = -1  # (its events follow the message open with the client)
                return ended
            if item.get("type") == "function_call":
                self.native = True
            if isinstance(at, int):
                self.index[at] = self.next_out
            if isinstance(item.get("id"), str):
                self.by_id[item["id"]] = self.next_out
            self.next_out += 1
            return ended + self._pass(ev, kind, obj, self.next_out - 1)
        mine = self.msg is not None and (obj.get("item_id") == self.msg.get("id") or (
            "item_id" not in obj and kind in _MESSAGE_EVENTS))
        if mine and kind == "response.content_part.added":
            part = obj.get("part")
            self.part = part if isinstance(part, dict) else {"type": "output_text", "text": "", "annotations": []}
            return []
        if mine and kind == "response.output_text.delta":
            delta = obj.get("delta")
            assert self.channel is not None
            return self._pieces(self.channel.feed(delta) if isinstance(delta, str) else [])
        if kind == "response.output_item.done" and item is not None and self.msg is not None \
                and item.get("id") == self.msg.get("id"):
            return self._end_message(item)
        if mine:  # (its text's done, its part's done: said by _close, with the text the client got)
            return []
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            ended = self._end_message()  # (a runtime that ends without its message's done events)
            resp = obj.get("response")
            if self.changed and isinstance(resp, dict):
                output = [self.outputs[i] for i in sorted(self.outputs)]
                return [*ended, self._emit(kind, {**obj, "response": {**resp, "output": output}})]
            return ended + self._pass(ev, kind, obj)
        if kind == "response.output_item.done" and item is not None:
            self.outputs[self._out_index(obj)] = item
        return self._pass(ev, kind, obj)

    def _pieces(self, pieces: list[Piece]) -> list[bytes]:
        out: list[bytes] = []
        for p in pieces:
            if isinstance(p, str):
                out += self._say(p)
            elif isinstance(p, Thought):
                out += self._think(p.text)
            else:
                out += self._call(p)
        return out

    def _think(self, text: str) -> list[bytes]:
        self.changed = True
        out = self._close()
        th = self.thinking
        if th is None:
            item = reasoning_item("")
            th = self.thinking = {"item": item, "out": self.next_out, "text": []}
            self.next_out += 1
            out.append(self._emit("response.output_item.added", {
                "output_index": th["out"], "item": {**item, "content": [], "status": "in_progress"}}))
        th["text"].append(text)
        out.append(self._emit("response.reasoning_text.delta", {
            "item_id": th["item"]["id"], "output_index": th["out"], "content_index": 0, "delta": text}))
        return out

    def _close_thinking(self) -> list[bytes]:
        th = self.thinking
        if th is None:
            return []
        self.thinking = None
        text = "".join(th["text"])
        item = {**th["item"], "content": [{"type": "reasoning_text", "text": text}]}
        self.outputs[th["out"]] = item
        return [self._emit("response.reasoning_text.done", {
                    "item_id": item["id"], "output_index": th["out"], "content_index": 0, "text": text}),
                self._emit("response.output_item.done", {"output_index": th["out"], "item": item})]

    def _say(self, text: str) -> list[bytes]:
        out = self._close_thinking()
        msg = self.msg
        assert msg is not None
        if self.open is None:
            item_id = msg.get("id") if self.pieces == 0 else new_id("msg_")
            self.pieces += 1
            self.open = {"id": item_id, "out": self.next_out, "text": []}
            self.next_out += 1
            out.append(self._emit("response.output_item.added", {
                "output_index": self.open["out"], "item": {**msg, "id": item_id, "content": []}}))
            part = {**(self.part or {"type": "output_text", "annotations": []}), "text": ""}
            out.append(self._emit("response.content_part.added", {
                "item_id": item_id, "output_index": self.open["out"], "content_index": 0, "part": part}))
        self.open["text"].append(text)
        out.append(self._emit("response.output_text.delta", {
            "item_id": self.open["id"], "output_index": self.open["out"], "content_index": 0, "delta": text,
            "logprobs": []}))
        return out

    def _close(self, done: dict[str, Any] | None = None) -> list[bytes]:
        op = self.open
        if op is None:
            return []
        self.open = None
        text = "".join(op["text"])
        part = {**(self.part or {"type": "output_text", "annotations": []}), "text": text}
        where = {"item_id": op["id"], "output_index": op["out"], "content_index": 0}
        item = {**(done or self.msg or {}), "id": op["id"], "status": "completed", "content": [part]}
        self.outputs[op["out"]] = item
        return [self._emit("response.output_text.done", {**where, "text": text, "logprobs": []}),
                self._emit("response.content_part.done", {**where, "part": part}),
                self._emit("response.output_item.done", {"output_index": op["out"], "item": item})]

    def _call(self, call: ToolCall) -> list[bytes]:
        self.changed = True
        out = self._close_thinking() + self._close()
        item = function_call_item(call)
        at = self.next_out
        self.next_out += 1
        where = {"item_id": item["id"], "output_index": at}
        out.append(self._emit("response.output_item.added", {
            "output_index": at, "item": {**item, "arguments": "", "status": "in_progress"}}))
        out.append(self._emit("response.function_call_arguments.delta", {**where, "delta": item["arguments"]}))
        out.append(self._emit("response.function_call_arguments.done", {
            **where, "name": item["name"], "arguments": item["arguments"]}))
        out.append(self._emit("response.output_item.done", {"output_index": at, "item": item}))
        self.outputs[at] = item
        return out


# -- Anthropic Messages ---------------------------------------------------------------------------
class MessagesRepair(StreamRepair):
    def __init__(self, repair: ToolRepair) -> None:
        self.repair = repair
        self.native = False
        self.index: dict[int, int] = {}  # the runtime's block index -> the client's
        self.blocks = 0  # blocks started with the client
        self.started = 0  # blocks the runtime started
        self.text_at: int | None = None  # the runtime's text block being repaired
        self.channel: Channel | None = None
        self.open: int | None = None  # the text (or thinking) block open with the client
        self.open_kind = "text"
        self.calls = 0

    def feed(self, events: list[bytes]) -> list[bytes]:
        out: list[bytes] = []
        for ev in events:
            obj = event_object(ev)
            kind = obj.get("type") if obj is not None else None
            if obj is None or not isinstance(kind, str):
                out.append(ev)
                continue
            out += self._event(ev, kind, obj)
        return out

    def _event(self, ev: bytes, kind: str, obj: dict[str, Any]) -> list[bytes]:
        at = obj.get("index")
        if not isinstance(at, int):  # (llama-server leaves it out: the block started last, or the next)
            at = self.started if kind == "content_block_start" else max(self.started - 1, 0)
        if kind == "content_block_start":
            self.started = max(self.started, at + 1)
            block = as_dict(obj.get("content_block"))
            if block.get("type") == "text" and not self.native:
                self.text_at, self.channel, self.open = at, Channel(self.repair), None
                return []
            if block.get("type") == "tool_use":
                self.native = True
            self.index[at] = self.blocks
            self.blocks += 1
            if obj.get("index") == self.blocks - 1:
                return [ev]
            return [sse_event({**obj, "index": self.blocks - 1}, b"content_block_start")]
        if at == self.text_at and self.channel is not None:
            if kind == "content_block_delta":
                delta = as_dict(obj.get("delta"))
                text = delta.get("text")
                if delta.get("type") == "text_delta" and isinstance(text, str):
                    return self._pieces(self.channel.feed(text))
                return []
            if kind == "content_block_stop":
                out = self._pieces(self.channel.finish())
                out += self._stop()
                self.text_at = self.channel = None
                return out
        ended: list[bytes] = []
        if kind in ("message_delta", "message_stop") and self.channel is not None:
            # (a runtime that ends without its text block's stop)
            ended = self._pieces(self.channel.finish()) + self._stop()
            self.text_at = self.channel = None
        if kind == "message_delta" and self.calls:
            delta = as_dict(obj.get("delta"))
            if delta.get("stop_reason") in ("end_turn", None):
                return [*ended, sse_event({**obj, "delta": {**delta, "stop_reason": "tool_use"}}, b"message_delta")]
        if ended:
            return [*ended, ev]
        if kind in ("content_block_delta", "content_block_stop"):
            new = self.index.get(at, at)
            return [ev] if new == obj.get("index") else [sse_event({**obj, "index": new}, kind.encode())]
        return [ev]

    def _pieces(self, pieces: list[Piece]) -> list[bytes]:
        out: list[bytes] = []
        for p in pieces:
            if isinstance(p, str | Thought):
                kind = "text" if isinstance(p, str) else "thinking"
                if self.open is not None and self.open_kind != kind:
                    out += self._stop()
                if self.open is None:
                    self.open, self.open_kind = self.blocks, kind
                    self.blocks += 1
                    start = {"type": "text", "text": ""} if kind == "text" else \
                        {"type": "thinking", "thinking": "", "signature": ""}
                    out.append(sse_event({"type": "content_block_start", "index": self.open,
                                     "content_block": start}, b"content_block_start"))
                delta = {"type": "text_delta", "text": p} if isinstance(p, str) else \
                    {"type": "thinking_delta", "thinking": p.text}
                out.append(sse_event({"type": "content_block_delta", "index": self.open, "delta": delta},
                                b"content_block_delta"))
            elif object_arguments(p):
                out += self._stop()
                self.calls += 1
                at = self.blocks
                self.blocks += 1
                out.append(sse_event({"type": "content_block_start", "index": at, "content_block": {
                    "type": "tool_use", "id": new_id("toolu_"), "name": p.name, "input": {}}}, b"content_block_start"))
                out.append(sse_event({"type": "content_block_delta", "index": at, "delta": {
                    "type": "input_json_delta", "partial_json": p.arguments}}, b"content_block_delta"))
                out.append(sse_event({"type": "content_block_stop", "index": at}, b"content_block_stop"))
            else:  # (arguments that are no object: a tool_use cannot carry them; said as they came)
                out += self._pieces([p.arguments])
        return out

    def _stop(self) -> list[bytes]:
        if self.open is None:
            return []
        at, self.open = self.open, None
        return [sse_event({"type": "content_block_stop", "index": at}, b"content_block_stop")]
