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
from passerelle.proxy.assemble import dumps_answer
from passerelle.proxy.grammars import data_json
from passerelle.proxy.relay import SSEScanner


def _events(sse: bytes) -> list[Any]:
    return [obj for ev in SSEScanner().feed(sse + b"\n\n") if isinstance(obj := data_json(ev), dict)]


def _responses(events: list[Any]) -> dict[str, Any]:
    for obj in reversed(events):
        if obj.get("type") in ("response.completed", "response.incomplete", "response.failed") \
                and isinstance(obj.get("response"), dict):
            final: dict[str, Any] = obj["response"]
            return final
    raise UpstreamError("The model runtime's Responses stream ended without its final response.")


def _append(block: dict[str, Any], field: str, piece: Any) -> None:
    """``piece`` added to the block's text field (a value that is no text counts as none)."""
    old = block.get(field)
    block[field] = (old if isinstance(old, str) else "") + (piece if isinstance(piece, str) else "")


def _messages(events: list[Any]) -> dict[str, Any]:
    message: dict[str, Any] | None = None
    blocks: dict[int, dict[str, Any]] = {}
    partial_json: dict[int, str] = {}
    for obj in events:
        kind = obj.get("type")
        if kind == "message_start" and isinstance(obj.get("message"), dict):
            message = dict(obj["message"])
        elif kind == "content_block_start" and isinstance(obj.get("content_block"), dict):
            idx = obj.get("index", len(blocks))
            if isinstance(idx, int):  # (a block's place: anything else cannot be ordered)
                blocks[idx] = dict(obj["content_block"])
        elif kind == "content_block_delta":
            idx, delta = obj.get("index", 0), obj.get("delta")
            if not isinstance(idx, int) or not isinstance(delta, dict):
                continue
            block = blocks.setdefault(idx, {"type": "text", "text": ""})
            dtype = delta.get("type")
            if dtype == "text_delta":
                _append(block, "text", delta.get("text"))
            elif dtype == "thinking_delta":
                _append(block, "thinking", delta.get("thinking"))
            elif dtype == "signature_delta":
                _append(block, "signature", delta.get("signature"))
            elif dtype == "input_json_delta" and isinstance(piece := delta.get("partial_json"), str):
                partial_json[idx] = partial_json.get(idx, "") + piece
        elif kind == "message_delta" and message is not None:
            if isinstance(obj.get("delta"), dict):
                message.update(obj["delta"])
            if isinstance(obj.get("usage"), dict):
                usage = message.get("usage")
                message["usage"] = {**(usage if isinstance(usage, dict) else {}), **obj["usage"]}
    if message is None:
        raise UpstreamError("The model runtime's Messages stream ended without message_start.")
    for idx, text in partial_json.items():
        try:
            blocks[idx]["input"] = orjson.loads(text) if text.strip() else {}
        except orjson.JSONDecodeError:
            blocks[idx]["input"] = {}
    message["content"] = [blocks[i] for i in sorted(blocks)]
    return message


def _llama(events: list[Any]) -> dict[str, Any]:
    if not events:
        raise UpstreamError("The model runtime's stream was empty.")
    last = dict(events[-1])
    last["content"] = "".join(e.get("content") or "" for e in events if isinstance(e.get("content"), str))
    return last


_BUILDERS = {"responses": _responses, "messages": _messages, "llama": _llama}


def assemble_events(sse: bytes, grammar: str) -> bytes:
    """The JSON body a non-streaming request would have received, from a complete stream."""
    return dumps_answer(_BUILDERS[grammar](_events(sse)))
