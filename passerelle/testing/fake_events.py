"""The fake runtime's Responses and Anthropic Messages streams: the same tokens on the same
schedule as its chat completions, in those APIs' events (pre-encoded, as the chat chunks are).

    head(api, ...)      response.created / message_start + content_block_start
    token(api, i)       response.output_text.delta / content_block_delta (text_delta)
    tail(api, ...)      response.completed with usage / content_block_stop, message_delta, message_stop
    full_body(api, ...) the non-streaming answer

Example::

    >>> Events((" a", " b")).token("messages", 1)[:40]
    b'event: content_block_delta\\ndata: {"type'
"""

from __future__ import annotations

import time
from typing import Any

import orjson


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **obj}) + b"\n\n"


class Events:
    """The events of both APIs for one vocabulary (the fake's words, one per token)."""

    def __init__(self, vocab: tuple[str, ...]) -> None:
        self.vocab = vocab
        self.deltas = {
            "responses": tuple(b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                               b'"item_id":"msg_fake","output_index":0,"content_index":0,"delta":'
                               + orjson.dumps(w) + b"}\n\n" for w in vocab),
            "messages": tuple(b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                              b'"delta":{"type":"text_delta","text":' + orjson.dumps(w) + b"}}\n\n" for w in vocab),
        }

    def token(self, api: str, i: int) -> bytes:
        return self.deltas[api][i % len(self.vocab)]

    def text(self, n: int) -> str:
        return "".join(self.vocab[i % len(self.vocab)] for i in range(n))

    def head(self, api: str, rid: str, model: str, prompt_tokens: int) -> bytes:
        if api == "responses":
            return _event("response.created", {"response": self._response(rid, model, "in_progress")})
        return (_event("message_start", {"message": self._message(rid, model, 0, prompt_tokens, False)})
                + _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))

    def tail(self, api: str, rid: str, model: str, n: int, prompt_tokens: int) -> bytes:
        if api == "responses":
            return _event("response.completed",
                          {"response": self._response(rid, model, "completed", n, prompt_tokens)})
        return (_event("content_block_stop", {"index": 0})
                + _event("message_delta", {"delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                                           "usage": {"output_tokens": n}})
                + _event("message_stop", {}))

    def full_body(self, api: str, rid: str, model: str, n: int, prompt_tokens: int) -> bytes:
        if api == "responses":
            return orjson.dumps(self._response(rid, model, "completed", n, prompt_tokens))
        return orjson.dumps(self._message(rid, model, n, prompt_tokens, True))

    def _response(self, rid: str, model: str, status: str, n: int = 0, prompt_tokens: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
                               "status": status, "output": []}
        if status != "in_progress":
            out["output"] = [{"type": "message", "id": "msg_fake", "status": "completed", "role": "assistant",
                              "content": [{"type": "output_text", "text": self.text(n), "annotations": []}]}]
            out["usage"] = {"input_tokens": prompt_tokens, "output_tokens": n, "total_tokens": prompt_tokens + n}
        return out

    def _message(self, rid: str, model: str, n: int, prompt_tokens: int, done: bool) -> dict[str, Any]:
        return {"id": rid, "type": "message", "role": "assistant", "model": model,
                "content": [{"type": "text", "text": self.text(n)}] if done else [],
                "stop_reason": "max_tokens" if done else None, "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": n if done else 0}}

