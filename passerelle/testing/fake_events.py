"""The fake runtime's Responses and Anthropic Messages streams: the same tokens on the same
schedule as its chat completions, in those APIs' events (pre-encoded, as the chat chunks are).

    head(api, ...)      response.created, in_progress, output_item.added, content_part.added /
                        message_start, content_block_start
    token(api, i)       response.output_text.delta / content_block_delta (text_delta)
    tail(api, ...)      output_text.done, content_part.done, output_item.done, response.completed
                        with usage / content_block_stop, message_delta, message_stop
    full_body(api, ...) the non-streaming answer

By default every event carries every field its API defines (Responses' ``sequence_number``,
``output_index``, ``content_index``, ``item_id``; Messages' ``index``). ``bare=True`` leaves them
out the way llama-server's ``/v1/responses`` stream does (it sends ``item_id`` alone), and leaves
out Messages' ``index`` as well: a runtime whose events the gateway must complete.

Example::

    >>> Events((" a", " b")).token("messages", 1)[:62]
    b'event: content_block_delta\\ndata: {"type":"content_block_delta"'
"""

from __future__ import annotations

import time
from typing import Any

import orjson

_ITEM = "msg_fake"
_RESPONSES_HEAD = 4  # events before the first delta: its sequence number


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **obj}) + b"\n\n"


class Events:
    """The events of both APIs for one vocabulary (the fake's words, one per token)."""

    def __init__(self, vocab: tuple[str, ...], *, bare: bool = False) -> None:
        self.vocab = vocab
        self.bare = bare
        where = b'"item_id":"msg_fake",' if bare else b'"item_id":"msg_fake","output_index":0,"content_index":0,'
        logprobs = b"" if bare else b',"logprobs":[]'
        # Responses' deltas in two parts: the sequence number goes between them (not in bare events)
        self._delta_head = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        self._delta_tails = tuple(where + b'"delta":' + orjson.dumps(w) + logprobs + b"}\n\n" for w in vocab)
        index = b"" if bare else b'"index":0,'
        self._messages = tuple(b'event: content_block_delta\ndata: {"type":"content_block_delta",' + index
                               + b'"delta":{"type":"text_delta","text":' + orjson.dumps(w) + b"}}\n\n" for w in vocab)

    def token(self, api: str, i: int) -> bytes:
        if api == "messages":
            return self._messages[i % len(self.vocab)]
        tail = self._delta_tails[i % len(self.vocab)]
        if self.bare:
            return self._delta_head + tail
        return self._delta_head + b'"sequence_number":%d,' % (_RESPONSES_HEAD + i) + tail

    def text(self, n: int) -> str:
        return "".join(self.vocab[i % len(self.vocab)] for i in range(n))

    def head(self, api: str, rid: str, model: str, prompt_tokens: int) -> bytes:
        if api == "responses":
            started = self._response(rid, model, "in_progress")
            item = {"id": _ITEM, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            head: list[tuple[str, dict[str, Any]]] = [
                ("response.created", {"response": started}),
                ("response.in_progress", {"response": started}),
                ("response.output_item.added", {"output_index": 0, "item": item}),
                ("response.content_part.added", {"item_id": _ITEM, "output_index": 0, "content_index": 0,
                                                 "part": {"type": "output_text", "text": "", "annotations": []}}),
            ]
            return b"".join(self._responses_event(name, seq, fields) for seq, (name, fields) in enumerate(head))
        return (_event("message_start", {"message": self._message(rid, model, 0, prompt_tokens, False)})
                + self._block_event("content_block_start", {"content_block": {"type": "text", "text": ""}}))

    def tail(self, api: str, rid: str, model: str, n: int, prompt_tokens: int) -> bytes:
        if api == "responses":
            text = self.text(n)
            part = {"type": "output_text", "text": text, "annotations": []}
            at = {"item_id": _ITEM, "output_index": 0, "content_index": 0}
            tail: list[tuple[str, dict[str, Any]]] = [
                ("response.output_text.done", {**at, "text": text, "logprobs": []}),
                ("response.content_part.done", {**at, "part": part}),
                ("response.output_item.done", {"output_index": 0, "item": self._item(text)}),
                ("response.completed", {"response": self._response(rid, model, "completed", n, prompt_tokens)}),
            ]
            return b"".join(self._responses_event(name, _RESPONSES_HEAD + n + k, fields)
                            for k, (name, fields) in enumerate(tail))
        return (self._block_event("content_block_stop", {})
                + _event("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                           "usage": {"output_tokens": n}})
                + _event("message_stop", {}))

    def full_body(self, api: str, rid: str, model: str, n: int, prompt_tokens: int) -> bytes:
        if api == "responses":
            return orjson.dumps(self._response(rid, model, "completed", n, prompt_tokens))
        return orjson.dumps(self._message(rid, model, n, prompt_tokens, True))

    def _responses_event(self, name: str, seq: int, fields: dict[str, Any]) -> bytes:
        if self.bare:  # as llama-server: item_id stays, the indexes and the sequence number go
            fields = {k: v for k, v in fields.items() if k not in ("output_index", "content_index", "logprobs")}
            return _event(name, fields)
        return _event(name, {"sequence_number": seq, **fields})

    def _block_event(self, name: str, fields: dict[str, Any]) -> bytes:
        return _event(name, fields if self.bare else {"index": 0, **fields})

    def _item(self, text: str) -> dict[str, Any]:
        return {"type": "message", "id": _ITEM, "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    def _response(self, rid: str, model: str, status: str, n: int = 0, prompt_tokens: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
                               "status": status, "output": []}
        if status != "in_progress":
            out["output"] = [self._item(self.text(n))]
            out["usage"] = {"input_tokens": prompt_tokens, "output_tokens": n, "total_tokens": prompt_tokens + n}
        return out

    def _message(self, rid: str, model: str, n: int, prompt_tokens: int, done: bool) -> dict[str, Any]:
        return {"id": rid, "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": self.text(n)}] if done else [],
                "stop_reason": "max_tokens" if done else None, "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": n if done else 0}}
