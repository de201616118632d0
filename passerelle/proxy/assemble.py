"""Build a non-streaming OpenAI response from the chunks of a stream.

llama-server notices a departed client only between streamed chunks: a non-streaming request
keeps its slot busy until the whole answer is generated, even when nobody waits for it. So the
gateway asks llama-server for a stream, relays nothing, and assembles the answer here; a client
that leaves then frees the slot at once, and the request gets the same first-token and
between-token timeouts as a stream. What is collected is capped (``[limits] max_answer_bytes``)
by the gateway before it gets here, and held as it will be sent (answer.py): the events are read
one by one as they arrive (:class:`ChatAssembler`), the text kept encoded, so an answer costs
about its own size in memory, not several times that.

Example::

    body = assemble(b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hi"}}]}\\n\\n'
                    b'data: [DONE]\\n\\n', "chat")
    # {"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",
    #  "content":"Hi"},"finish_reason":null,"logprobs":null}], ...}
"""

from __future__ import annotations

from typing import Any

import orjson

from passerelle.errors import UpstreamError
from passerelle.proxy.answer import Items, Piece, Text, render
from passerelle.proxy.sse_scan import SSEScanner

_META = ("id", "created", "model", "system_fingerprint")


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


class ChatAssembler:
    """An OpenAI chat or completions answer built from its stream's events, fed one at a time
    (:meth:`feed`); :attr:`held` is the bytes of text it holds, :meth:`finish` the body's pieces."""

    __slots__ = ("chat", "choices", "extra", "held", "meta", "over")

    def __init__(self, endpoint: str) -> None:
        self.chat = endpoint == "chat"
        self.meta: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.held = 0
        self.over = False  # [DONE] seen: nothing after it counts

    def feed(self, ev: bytes) -> None:
        if self.over:
            return
        line = ev.strip()
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.over = True
            return
        if not payload:
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise UpstreamError("The model runtime sent a stream event that is not JSON; the answer cannot be "
                                "assembled.") from None
        if isinstance(obj, dict):
            self._take(obj)

    def _take(self, obj: dict[str, Any]) -> None:
        meta = self.meta
        for k in _META:
            if k in obj and k not in meta:
                meta[k] = obj[k]
        for k in ("usage", "timings"):
            if obj.get(k):
                self.extra[k] = obj[k]
        choices = obj.get("choices")
        for ch in choices if isinstance(choices, list) else ():
            if not isinstance(ch, dict):
                continue
            idx = ch.get("index", 0)
            if not isinstance(idx, int) or isinstance(idx, bool):
                continue
            c = self.choices.get(idx)
            if c is None:
                if len(self.choices) >= 1024:
                    continue  # (a runtime inventing choices would make a dict of any size)
                c = self.choices[idx] = {"index": idx, "text": Text(), "reasoning": Text(),
                                         "reasoning_field": Text(), "tools": [], "role": "assistant",
                                         "finish_reason": None, "logprobs": None}
            if self.chat:
                delta = ch.get("delta")
                delta = delta if isinstance(delta, dict) else {}
                role = delta.get("role")
                if isinstance(role, str) and role:
                    c["role"] = role
                if text := _text(delta.get("content")):
                    self.held += c["text"].add(text)
                if reasoning := _text(delta.get("reasoning_content")):
                    self.held += c["reasoning"].add(reasoning)
                if reasoning := _text(delta.get("reasoning")):  # vLLM >= 0.16's name
                    self.held += c["reasoning_field"].add(reasoning)
                if isinstance(delta.get("tool_calls"), list):
                    self._merge_tool_calls(c["tools"], delta["tool_calls"])
            elif text := _text(ch.get("text")):
                self.held += c["text"].add(text)
            if isinstance(ch.get("logprobs"), dict) and ch["logprobs"]:
                c["logprobs"] = self._merge_logprobs(c["logprobs"], ch["logprobs"])
            if ch.get("finish_reason"):
                c["finish_reason"] = ch["finish_reason"]

    def _merge_tool_calls(self, into: list[dict[str, Any]], deltas: list[Any]) -> None:
        """Tool-call deltas into ``into``; a call's name and arguments are kept encoded."""
        for d in deltas:
            if not isinstance(d, dict):
                continue
            idx = d.get("index", len(into))
            if not isinstance(idx, int) or not 0 <= idx <= len(into) + 1024:
                continue  # (an index from nowhere would make a list of that length)
            while len(into) <= idx:
                into.append({"id": None, "type": "function", "function": {"name": Text(), "arguments": Text()}})
            call = into[idx]
            if d.get("id"):
                call["id"] = d["id"]
            if d.get("type"):
                call["type"] = d["type"]
            fn = d.get("function")
            fn = fn if isinstance(fn, dict) else {}
            if name := _text(fn.get("name")):
                self.held += call["function"]["name"].add(name)
            if arguments := _text(fn.get("arguments")):
                self.held += call["function"]["arguments"].add(arguments)

    def _merge_logprobs(self, into: dict[str, Any] | None, lp: dict[str, Any]) -> dict[str, Any]:
        into = {} if into is None else into
        for k, v in lp.items():
            if isinstance(v, list):
                items = into.get(k)
                if not isinstance(items, Items):
                    items = into[k] = Items()
                self.held += items.add(v)
            else:
                into[k] = v
        return into

    def finish(self) -> list[Piece]:
        """The JSON body a non-streaming request would have received, as pieces to write in order."""
        out_choices = []
        for idx in sorted(self.choices):
            c = self.choices[idx]
            text: Text = c["text"]
            if self.chat:
                tools = c["tools"]
                message: dict[str, Any] = {"role": c["role"], "content": text if text or not tools else None}
                if c["reasoning"]:
                    message["reasoning_content"] = c["reasoning"]
                if c["reasoning_field"]:
                    message["reasoning"] = c["reasoning_field"]
                if tools:
                    message["tool_calls"] = tools
                out_choices.append({"index": idx, "message": message, "finish_reason": c["finish_reason"],
                                    "logprobs": c["logprobs"]})
            else:
                out_choices.append({"index": idx, "text": text, "finish_reason": c["finish_reason"],
                                    "logprobs": c["logprobs"]})
        body = {**self.meta, "object": "chat.completion" if self.chat else "text_completion",
                "choices": out_choices, **self.extra}
        return render(body)


def assemble(sse: bytes, endpoint: str) -> bytes:
    """The JSON body a non-streaming request would have received, from a full SSE stream."""
    asm = ChatAssembler(endpoint)
    for ev in SSEScanner(max_event=max(len(sse) + 2, 1 << 20)).feed(sse + b"\n\n"):
        asm.feed(ev)
    return b"".join(asm.finish())
