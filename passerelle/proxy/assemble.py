"""Build a non-streaming OpenAI response from the chunks of a stream.

llama-server notices a departed client only between streamed chunks: a non-streaming request
keeps its slot busy until the whole answer is generated, even when nobody waits for it. So the
gateway asks llama-server for a stream, relays nothing, and assembles the answer here; a client
that leaves then frees the slot at once, and the request gets the same first-token and
between-token timeouts as a stream. What is collected is capped (``[limits] max_answer_bytes``)
by the gateway before it gets here.

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
from passerelle.proxy.relay import SSEScanner

_META = ("id", "created", "model", "system_fingerprint")


def _merge_tool_calls(into: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    """Tool-call deltas into ``into``; a call's name and arguments are kept as lists of parts,
    joined once at the end (see :func:`_finish_tool_calls`)."""
    for d in deltas:
        if not isinstance(d, dict):
            continue
        idx = d.get("index", len(into))
        if not isinstance(idx, int) or not 0 <= idx <= len(into) + 1024:
            continue  # (an index from nowhere would make a list of that length)
        while len(into) <= idx:
            into.append({"id": None, "type": "function", "function": {"name": [], "arguments": []}})
        call = into[idx]
        if d.get("id"):
            call["id"] = d["id"]
        if d.get("type"):
            call["type"] = d["type"]
        fn = d.get("function")
        if not isinstance(fn, dict):
            continue
        if name := _text(fn.get("name")):
            call["function"]["name"].append(name)
        if arguments := _text(fn.get("arguments")):
            call["function"]["arguments"].append(arguments)


def _finish_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for call in calls:
        fn = call["function"]
        fn["name"], fn["arguments"] = "".join(fn["name"]), "".join(fn["arguments"])
    return calls


def _merge_logprobs(into: dict[str, Any] | None, lp: dict[str, Any]) -> dict[str, Any]:
    if into is None:
        return {k: list(v) if isinstance(v, list) else v for k, v in lp.items()}
    for k, v in lp.items():
        if isinstance(v, list) and isinstance(into.get(k), list):
            into[k].extend(v)
        else:
            into[k] = v
    return into


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def assemble(sse: bytes, endpoint: str) -> bytes:
    """The JSON body a non-streaming request would have received, from a full SSE stream.

    Linear in the size of the stream: text arrives as parts that are joined once at the end (a
    string grown with ``+=`` costs quadratic time on a long answer and froze the event loop)."""
    meta: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    chat = endpoint == "chat"
    scanner = SSEScanner(max_event=max(len(sse) + 2, 1 << 20))  # (the caller capped the whole stream)
    events = scanner.feed(sse + b"\n\n")
    for ev in events:
        line = ev.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break  # the end: nothing after it counts
        if not payload:
            continue
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise UpstreamError("The model runtime sent a stream event that is not JSON; the answer cannot be "
                                "assembled.") from None
        if not isinstance(obj, dict):
            continue
        for k in _META:
            if k in obj and k not in meta:
                meta[k] = obj[k]
        for k in ("usage", "timings"):
            if obj.get(k):
                extra[k] = obj[k]
        choices_in = obj.get("choices")
        for ch in choices_in if isinstance(choices_in, list) else ():
            if not isinstance(ch, dict):
                continue
            idx = ch.get("index", 0)
            if not isinstance(idx, int):
                continue
            c = choices.get(idx)
            if c is None:
                c = choices[idx] = {"index": idx, "text": [], "reasoning": [], "reasoning_field": [], "tools": [],
                                    "role": "assistant", "finish_reason": None, "logprobs": None}
            if chat:
                delta = ch.get("delta")
                if not isinstance(delta, dict):
                    delta = {}
                c["role"] = delta.get("role") or c["role"]
                if text := _text(delta.get("content")):
                    c["text"].append(text)
                if reasoning := _text(delta.get("reasoning_content")):
                    c["reasoning"].append(reasoning)
                if reasoning := _text(delta.get("reasoning")):  # vLLM >= 0.16's name
                    c["reasoning_field"].append(reasoning)
                if isinstance(delta.get("tool_calls"), list):
                    _merge_tool_calls(c["tools"], delta["tool_calls"])
            elif text := _text(ch.get("text")):
                c["text"].append(text)
            if ch.get("logprobs") and isinstance(ch["logprobs"], dict):
                c["logprobs"] = _merge_logprobs(c["logprobs"], ch["logprobs"])
            if ch.get("finish_reason"):
                c["finish_reason"] = ch["finish_reason"]
    out_choices = []
    for idx in sorted(choices):
        c = choices[idx]
        text = "".join(c["text"])
        if chat:
            tools = _finish_tool_calls(c["tools"])
            message: dict[str, Any] = {"role": c["role"], "content": text or (None if tools else "")}
            if c["reasoning"]:
                message["reasoning_content"] = "".join(c["reasoning"])
            if c["reasoning_field"]:
                message["reasoning"] = "".join(c["reasoning_field"])
            if tools:
                message["tool_calls"] = tools
            out_choices.append({"index": idx, "message": message, "finish_reason": c["finish_reason"],
                                "logprobs": c["logprobs"]})
        else:
            out_choices.append({"index": idx, "text": text, "finish_reason": c["finish_reason"],
                                "logprobs": c["logprobs"]})
    body = {**meta, "object": "chat.completion" if chat else "text_completion", "choices": out_choices, **extra}
    return dumps_answer(body)


def dumps_answer(body: dict[str, Any]) -> bytes:
    """An assembled answer as JSON; the runtime's JSON nested past what orjson writes (254 levels)
    is the runtime's fault."""
    try:
        return orjson.dumps(body)
    except TypeError:
        raise UpstreamError("The model runtime's answer is nested too deeply to be assembled.") from None
