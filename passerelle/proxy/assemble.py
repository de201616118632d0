"""Build a non-streaming OpenAI response from the chunks of a stream.

llama-server notices a departed client only between streamed chunks: a non-streaming request
keeps its slot busy until the whole answer is generated, even when nobody waits for it. So the
gateway asks llama-server for a stream, relays nothing, and assembles the answer here; a client
that leaves then frees the slot at once, and the request gets the same first-token and
between-token timeouts as a stream.

Example::

    body = assemble(b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hi"}}]}\\n\\n'
                    b'data: [DONE]\\n\\n', "chat")
    # {"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",
    #  "content":"Hi"},"finish_reason":null,"logprobs":null}], ...}
"""

from __future__ import annotations

from typing import Any

import orjson

from passerelle.proxy.relay import SSEScanner

_META = ("id", "created", "model", "system_fingerprint")


def _merge_tool_calls(into: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    for d in deltas:
        idx = d.get("index", len(into))
        while len(into) <= idx:
            into.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        call = into[idx]
        if d.get("id"):
            call["id"] = d["id"]
        if d.get("type"):
            call["type"] = d["type"]
        fn = d.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            call["function"]["arguments"] += fn["arguments"]


def _merge_logprobs(into: dict[str, Any] | None, lp: dict[str, Any]) -> dict[str, Any]:
    if into is None:
        return {k: list(v) if isinstance(v, list) else v for k, v in lp.items()}
    for k, v in lp.items():
        if isinstance(v, list) and isinstance(into.get(k), list):
            into[k].extend(v)
        else:
            into[k] = v
    return into


def assemble(sse: bytes, endpoint: str) -> bytes:
    """The JSON body a non-streaming request would have received, from a full SSE stream."""
    meta: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    chat = endpoint == "chat"
    scanner = SSEScanner()
    events = scanner.feed(sse + b"\n\n")
    for ev in events:
        line = ev.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]" or not payload:
            continue
        obj = orjson.loads(payload)
        for k in _META:
            if k in obj and k not in meta:
                meta[k] = obj[k]
        for k in ("usage", "timings"):
            if obj.get(k):
                extra[k] = obj[k]
        for ch in obj.get("choices") or []:
            idx = ch.get("index", 0)
            c = choices.setdefault(idx, {"index": idx, "text": "", "reasoning": "", "reasoning_field": "",
                                         "tools": [],
                                         "role": "assistant", "finish_reason": None, "logprobs": None})
            if chat:
                delta = ch.get("delta") or {}
                c["role"] = delta.get("role") or c["role"]
                c["text"] += delta.get("content") or ""
                c["reasoning"] += delta.get("reasoning_content") or ""
                c["reasoning_field"] += delta.get("reasoning") or ""  # vLLM >= 0.16's name
                if delta.get("tool_calls"):
                    _merge_tool_calls(c["tools"], delta["tool_calls"])
            else:
                c["text"] += ch.get("text") or ""
            if ch.get("logprobs"):
                c["logprobs"] = _merge_logprobs(c["logprobs"], ch["logprobs"])
            if ch.get("finish_reason"):
                c["finish_reason"] = ch["finish_reason"]
    out_choices = []
    for idx in sorted(choices):
        c = choices[idx]
        if chat:
            message: dict[str, Any] = {"role": c["role"], "content": c["text"] or (None if c["tools"] else "")}
            if c["reasoning"]:
                message["reasoning_content"] = c["reasoning"]
            if c["reasoning_field"]:
                message["reasoning"] = c["reasoning_field"]
            if c["tools"]:
                message["tool_calls"] = c["tools"]
            out_choices.append({"index": idx, "message": message, "finish_reason": c["finish_reason"],
                                "logprobs": c["logprobs"]})
        else:
            out_choices.append({"index": idx, "text": c["text"], "finish_reason": c["finish_reason"],
                                "logprobs": c["logprobs"]})
    body = {**meta, "object": "chat.completion" if chat else "text_completion", "choices": out_choices, **extra}
    return orjson.dumps(body)
