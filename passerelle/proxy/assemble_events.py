"""Non-streaming answers of the Responses, Anthropic Messages and llama-server native APIs, built
from the stream the gateway asked for instead (see assemble.py for why: llama-server frees a
slot of a departed client only while it streams).

* Responses: the ``response`` object of ``response.completed`` (or ``.incomplete`` / ``.failed``)
  is the whole answer already.
* Messages: ``message_start``'s message, each content block from its ``content_block_start`` and
  deltas (text, thinking and its signature, tool input as JSON), ``message_delta``'s stop reason
  and usage.
* llama-server native (``/infill``): the chunks' ``content`` joined into the last chunk, which
  carries the stop reason, counts and timings.

Each event is read as it arrives (:class:`EventsAssembler`) and only what the answer keeps is held,
its text encoded as it will be sent (answer.py).

Example::

    >>> body = assemble_events(b'event: message_start\\ndata: {"type":"message_start","message":'
    ...     b'{"id":"m1","type":"message","role":"assistant","content":[],"usage":{"input_tokens":3}}}\\n\\n'
    ...     b'event: content_block_start\\ndata: {"type":"content_block_start","index":0,'
    ...     b'"content_block":{"type":"text","text":""}}\\n\\n'
    ...     b'event: content_block_delta\\ndata: {"type":"content_block_delta","index":0,'
    ...     b'"delta":{"type":"text_delta","text":"Hi"}}\\n\\n', "messages")
    >>> orjson.loads(body)["content"]
    [{'type': 'text', 'text': 'Hi'}]
"""

from __future__ import annotations

from typing import Any

import orjson

from passerelle.errors import UpstreamError
from passerelle.proxy.answer import Piece, Raw, Text, render
from passerelle.proxy.grammars import data_json
from passerelle.proxy.sse_scan import SSEScanner

_FINAL = ("response.completed", "response.incomplete", "response.failed")
_DELTAS = {"text_delta": ("text", "text"), "thinking_delta": ("thinking", "thinking"),
           "signature_delta": ("signature", "signature")}
_MAX_BLOCKS = 1024  # (a runtime inventing block indexes would make a dict of any size)


class EventsAssembler:
    """A Responses, Messages or llama-server native answer built from its stream's events, fed one
    at a time (:meth:`feed`); :attr:`held` is about the bytes it holds, :meth:`finish` the body's pieces."""

    __slots__ = ("blocks", "final", "grammar", "held", "last", "message", "partial_json", "text")

    def __init__(self, grammar: str) -> None:
        self.grammar = grammar
        self.held = 0
        self.final: dict[str, Any] | None = None  # responses: the final response object
        self.message: dict[str, Any] | None = None  # messages
        self.blocks: dict[int, dict[str, Any]] = {}
        self.partial_json: dict[int, bytearray] = {}
        self.last: dict[str, Any] | None = None  # llama: the last chunk
        self.text = Text()  # llama: the chunks' content

    def feed(self, ev: bytes) -> None:
        obj = data_json(ev)
        if not isinstance(obj, dict):
            return
        if self.grammar == "responses":
            if obj.get("type") in _FINAL and isinstance(obj.get("response"), dict):
                self.final = obj["response"]
                self.held = len(ev)  # (the last one replaces the one before)
        elif self.grammar == "messages":
            self._message_event(obj, len(ev))
        else:
            content = obj.get("content")
            if isinstance(content, str) and content:
                self.held += self.text.add(content)
            self.last = obj

    def _message_event(self, obj: dict[str, Any], size: int) -> None:
        kind = obj.get("type")
        if kind == "message_start" and isinstance(obj.get("message"), dict):
            self.message = dict(obj["message"])
            self.held += size
        elif kind == "content_block_start" and isinstance(obj.get("content_block"), dict):
            idx = obj.get("index", len(self.blocks))
            if isinstance(idx, int) and (idx in self.blocks or len(self.blocks) < _MAX_BLOCKS):
                self.blocks[idx] = self._block(dict(obj["content_block"]))
                self.held += size
        elif kind == "content_block_delta":
            idx, delta = obj.get("index", 0), obj.get("delta")
            if not isinstance(idx, int) or not isinstance(delta, dict) or (
                    idx not in self.blocks and len(self.blocks) >= _MAX_BLOCKS):
                return
            block = self.blocks.get(idx)
            if block is None:
                block = self.blocks[idx] = self._block({"type": "text", "text": ""})
            dtype = delta.get("type")
            if isinstance(dtype, str) and dtype in _DELTAS:
                field, key = _DELTAS[dtype]
                part = delta.get(key)
                if isinstance(part, str) and part:
                    text = block.get(field)
                    if not isinstance(text, Text):
                        text = block[field] = self._text(text)
                    self.held += text.add(part)
            elif dtype == "input_json_delta":
                part = delta.get("partial_json")
                if isinstance(part, str) and part:
                    encoded = part.encode("utf-8", "surrogatepass")
                    self.partial_json.setdefault(idx, bytearray()).extend(encoded)
                    self.held += len(encoded)
        elif kind == "message_delta" and self.message is not None:
            delta = obj.get("delta")
            if isinstance(delta, dict):
                self.message.update(delta)
            if isinstance(obj.get("usage"), dict):
                usage = self.message.get("usage")
                self.message["usage"] = {**(usage if isinstance(usage, dict) else {}), **obj["usage"]}

    @staticmethod
    def _text(value: Any) -> Text:
        text = Text()
        if isinstance(value, str) and value:
            text.add(value)
        return text

    def _block(self, block: dict[str, Any]) -> dict[str, Any]:
        for field in ("text", "thinking", "signature"):
            if isinstance(block.get(field), str):
                block[field] = self._text(block[field])
        return block

    def finish(self) -> list[Piece]:
        """The JSON body a non-streaming request would have received, as pieces to write in order."""
        if self.grammar == "responses":
            if self.final is None:
                raise UpstreamError("The model runtime's Responses stream ended without its final response.")
            return render(self.final)
        if self.grammar == "messages":
            message = self.message
            if message is None:
                raise UpstreamError("The model runtime's Messages stream ended without message_start.")
            for idx, raw in self.partial_json.items():
                block = self.blocks.get(idx)
                if block is not None:
                    block["input"] = _json_value(raw)
            message["content"] = [self.blocks[i] for i in sorted(self.blocks)]
            return render(message)
        if self.last is None:
            raise UpstreamError("The model runtime's stream was empty.")
        last = dict(self.last)
        last["content"] = self.text
        return render(last)


def _json_value(raw: bytearray) -> Any:
    """A tool's input from its JSON text, kept as that text when it is valid (``{}`` when not)."""
    if not raw.strip():
        return {}
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    value = Raw()
    value.buf = raw
    return value


def assemble_events(sse: bytes, grammar: str) -> bytes:
    """The JSON body a non-streaming request would have received, from a complete stream."""
    asm = EventsAssembler(grammar)
    for ev in SSEScanner(max_event=max(len(sse) + 2, 1 << 20)).feed(sse + b"\n\n"):
        asm.feed(ev)
    return b"".join(asm.finish())
