"""How each API's event stream speaks: which event is content, which carries usage, which ends the
stream, which reports an error, and the error event the gateway sends in that API's own words.

The relay (relay.py) scans OpenAI chat/completions chunks itself; every other stream is read
through one of these grammars, one instance per stream (Anthropic's usage comes in two events).
Nothing is buffered and only usage-carrying events are decoded as JSON. Which event is content is
defined once for the gateway and the benchmark (passerelle/chunks.py):

* Responses (``/v1/responses``): every ``response.*.delta`` is content (output text, reasoning
  text and summaries, refusals, function-call arguments); ``response.completed`` /
  ``response.incomplete`` carry usage and end the stream; ``response.failed`` and ``error`` are
  errors.
* Anthropic Messages (``/v1/messages``): ``content_block_delta`` with ``text_delta``,
  ``thinking_delta`` or ``input_json_delta`` is content; usage comes from ``message_start``
  (input) and ``message_delta`` (output); ``message_stop`` ends it; ``event: error`` is an error.
* llama-server's native chunks (``/infill``): a non-empty ``content`` is content; the chunk with
  ``"stop": true`` carries ``tokens_evaluated`` / ``tokens_predicted`` and ends the stream.
* Transcriptions: ``transcript.text.delta`` is content, ``transcript.text.done`` carries usage.
* Generic (operator-added routes): every data event is content; ``[DONE]`` or the close ends it.

An event's type is its ``event:`` line, or else the first ``"type"`` of its data.

Example::

    >>> g = make("messages")
    >>> g.scan(b'event: content_block_delta\\ndata: {"type":"content_block_delta","index":0,'
    ...        b'"delta":{"type":"text_delta","text":"Hi"}}\\n\\n') == CONTENT
    True
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from passerelle.chunks import LLAMA, MESSAGES, RESPONSES, TRANSCRIPTION
from passerelle.errors import GatewayError
from passerelle.proxy.protocols import anthropic_body

CONTENT, END, ERROR = 1, 2, 4

_EVENT = re.compile(rb"^event:[ \t]*([^\r\n]*)", re.M)
_TYPE = re.compile(rb'"type"\s*:\s*"([^"]*)"')
_DATA_ERROR = re.compile(rb'^data:\s*\{\s*"error"', re.M)
_DONE = re.compile(rb"^data:\s*\[DONE\]\s*$", re.M)
_LLAMA_STOP = re.compile(rb'"stop"\s*:\s*true')


def event_type(ev: bytes) -> bytes:
    """``ev``'s type: its ``event:`` line, else the first ``"type"`` in its data."""
    m = _EVENT.search(ev) if b"event:" in ev else None
    if m is not None:
        return m.group(1).strip()
    m = _TYPE.search(ev)
    return m.group(1) if m is not None else b""


def data_json(ev: bytes) -> Any:
    """The JSON of ``ev``'s data lines (joined as SSE says), or None."""
    lines = [line[5:].strip() for line in ev.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        return orjson.loads(b"\n".join(lines))
    except orjson.JSONDecodeError:
        return None


def usage_of(obj: Any) -> tuple[int | None, int | None]:
    """(prompt, completion) tokens from any of the runtimes' answers: OpenAI's ``usage``
    (``prompt_tokens``/``completion_tokens``), Responses' and Anthropic's (``input_tokens``/
    ``output_tokens``, Anthropic's cached input added back), llama-server's native fields."""
    if not isinstance(obj, dict):
        return None, None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        resp = obj.get("response") if isinstance(obj.get("response"), dict) else obj.get("message")
        usage = resp.get("usage") if isinstance(resp, dict) else None
    if isinstance(usage, dict):
        p = usage.get("prompt_tokens", usage.get("input_tokens"))
        c = usage.get("completion_tokens", usage.get("output_tokens"))
        if isinstance(p, int) and "input_tokens" in usage:
            p += sum(v for k in ("cache_read_input_tokens", "cache_creation_input_tokens")
                     if isinstance(v := usage.get(k), int))
        if c is None and isinstance(p, int) and isinstance(usage.get("total_tokens"), int):
            c = usage["total_tokens"] - p  # rerank and embeddings: input only
        return (p if isinstance(p, int) else None), (c if isinstance(c, int) else None)
    p, c = obj.get("tokens_evaluated"), obj.get("tokens_predicted")
    return (p if isinstance(p, int) else None), (c if isinstance(c, int) else None)


def cached_of(obj: Any) -> int | None:
    """Prompt tokens the runtime says it took from its cache, in any API's usage shape: chat's
    ``prompt_tokens_details.cached_tokens``, Responses' ``input_tokens_details.cached_tokens``,
    Anthropic's ``cache_read_input_tokens``; else llama-server's ``timings.cache_n``; None when it
    says nothing."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        resp = obj.get("response") if isinstance(obj.get("response"), dict) else obj.get("message")
        usage = resp.get("usage") if isinstance(resp, dict) else None
    if isinstance(usage, dict):
        for details in ("prompt_tokens_details", "input_tokens_details"):
            d = usage.get(details)
            if isinstance(d, dict) and isinstance(n := d.get("cached_tokens"), int):
                return n
        if isinstance(n := usage.get("cache_read_input_tokens"), int):
            return n
    timings = obj.get("timings")
    n = timings.get("cache_n") if isinstance(timings, dict) else None
    return n if isinstance(n, int) else None


class Grammar:
    """The generic grammar; subclasses know one API. ``scan`` returns CONTENT | END | ERROR flags
    and keeps the usage it read in ``prompt_tokens`` / ``completion_tokens``."""

    ends_at_close = True  # no end marker to miss: a clean close is a complete stream

    def __init__(self) -> None:
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None

    def scan(self, ev: bytes) -> int:
        if ev.startswith(b":") or b"data:" not in ev:
            return 0
        if _DONE.search(ev):
            return END
        if _DATA_ERROR.search(ev):
            return ERROR
        return CONTENT

    def _take_usage(self, obj: Any) -> None:
        p, c = usage_of(obj)
        if p is not None:
            self.prompt_tokens = p
        if c is not None:
            self.completion_tokens = c
        if (n := cached_of(obj)) is not None:
            self.cached_tokens = n

    def error_event(self, err: GatewayError) -> bytes:
        """The event that tells this API's client the stream failed."""
        return err.sse_event()


class ResponsesGrammar(Grammar):
    ends_at_close = False

    def scan(self, ev: bytes) -> int:
        if RESPONSES.search(ev):
            return CONTENT
        t = event_type(ev)
        if t in (b"response.completed", b"response.incomplete", b"response.failed"):
            self._take_usage(data_json(ev))
            return END | (ERROR if t == b"response.failed" else 0)
        if t == b"error" or (not t.startswith(b"response.") and _DATA_ERROR.search(ev)):
            return END | ERROR
        return 0

    def error_event(self, err: GatewayError) -> bytes:
        # Responses' `error` event (type, code, message, param); the `error` object is there too
        # so that the openai SDKs, which raise on a streamed event carrying one, raise.
        body = {"type": "error", "code": err.code, "message": err.message, "param": None,
                "error": {"type": err.type, "code": err.code, "message": err.message}}
        return b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"


class MessagesGrammar(Grammar):
    ends_at_close = False

    def scan(self, ev: bytes) -> int:
        t = event_type(ev)
        if t == b"content_block_delta":
            return CONTENT if MESSAGES.search(ev) else 0
        if t == b"message_start":
            self._take_usage(data_json(ev))
            return 0
        if t == b"message_delta":
            p, c = usage_of(data_json(ev))
            if c is not None:
                self.completion_tokens = c
            if p and not self.prompt_tokens:  # (newer servers repeat the input count here)
                self.prompt_tokens = p
            return 0
        if t == b"message_stop":
            return END
        if t == b"error" or _DATA_ERROR.search(ev):
            return END | ERROR
        return 0

    def error_event(self, err: GatewayError) -> bytes:
        return b"event: error\ndata: " + anthropic_body(err) + b"\n\n"


class LlamaGrammar(Grammar):
    """llama-server's own chunks (``/infill``, ``/completion``)."""

    ends_at_close = False

    def scan(self, ev: bytes) -> int:
        if _DATA_ERROR.search(ev):
            return END | ERROR
        flags = CONTENT if LLAMA.search(ev) else 0
        if _LLAMA_STOP.search(ev):
            self._take_usage(data_json(ev))
            flags |= END
        elif _DONE.search(ev):
            flags |= END
        return flags


class TranscriptionGrammar(Grammar):
    ends_at_close = False

    def scan(self, ev: bytes) -> int:
        if TRANSCRIPTION.search(ev):
            return CONTENT
        t = event_type(ev)
        if t == b"transcript.text.done":
            self._take_usage(data_json(ev))
            return END
        if _DONE.search(ev):
            return END
        if t == b"error" or _DATA_ERROR.search(ev):
            return END | ERROR
        return 0


_GRAMMARS: dict[str, type[Grammar]] = {"generic": Grammar, "responses": ResponsesGrammar,
                                       "messages": MessagesGrammar, "llama": LlamaGrammar,
                                       "transcription": TranscriptionGrammar}


def make(name: str) -> Grammar | None:
    """A fresh grammar for one stream; None for OpenAI chat/completions (the relay's own scan)."""
    cls = _GRAMMARS.get(name)
    return cls() if cls is not None else None


def error_event(name: str, err: GatewayError) -> bytes:
    g = make(name)
    return g.error_event(err) if g is not None else err.sse_event()
