"""SSE pass-through: runtime bytes reach the client as they arrive; a byte scan learns the rest.

No event is decoded as JSON except the one carrying ``usage``. Complete events from one upstream
read are sent to the client in one write; an incomplete trailing event is held only until its end
arrives (a partial event is of no use to a client). The scan finds:

* content chunks (``"content"``/``"text"``/``"reasoning_content"``/``"reasoning"`` with a non-empty
  string, or ``tool_calls``): first-token time, inter-chunk gaps, a fallback token count (a
  reasoning model's thinking is its first tokens: vLLM >= 0.16 names it ``reasoning``);
* the usage chunk: token counts; dropped again when the gateway asked for it and the client did not;
* ``[DONE]``: a stream that ends without it was truncated, and the client gets an error event.

Other APIs' streams (Responses, Anthropic Messages, llama-server's native chunks) are read through
their grammar (grammars.py), which says the same things in their words.

Example::

    scanner = SSEScanner()
    scanner.feed(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\\n\\ndata: [DO')
    # -> [b'data: {"choices":[{"delta":{"content":"Hi"}}]}\\n\\n'], 'data: [DO' kept for later
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from passerelle.config import TimeoutConfig
from passerelle.errors import UpstreamError, UpstreamTimeout
from passerelle.observe.record import RequestRecord, State
from passerelle.proxy.grammars import CONTENT, END, ERROR, Grammar
from passerelle.upstream.client import HTTPClientError, Response

Send = Callable[[dict[str, Any]], Awaitable[None]]

_CONTENT = re.compile(
    rb'"(?:content|text|reasoning_content|reasoning)"\s*:\s*"[^"]|"tool_calls"\s*:\s*\[\s*\{')
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_ERROR = re.compile(rb'^data:\s*\{\s*"error"')
_DONE = re.compile(rb"^data:\s*\[DONE\]\s*$")


class SSEScanner:
    """Split a byte stream into complete SSE events (``\\n\\n`` or ``\\r\\n\\r\\n`` terminated)."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._tail + data if self._tail else data
        events: list[bytes] = []
        start = 0
        # Each terminator is searched again only once the split has passed it: a stream that
        # never uses one (most never send CRLF) costs one scan of the buffer, not one per event.
        lf = buf.find(b"\n\n")
        crlf = buf.find(b"\r\n\r\n")
        while lf >= 0 or crlf >= 0:
            end = lf + 2 if crlf < 0 or (0 <= lf < crlf) else crlf + 4
            events.append(buf[start:end])
            start = end
            if 0 <= lf < start:
                lf = buf.find(b"\n\n", start)
            if 0 <= crlf < start:
                crlf = buf.find(b"\r\n\r\n", start)
        self._tail = buf[start:] if start else buf
        return events

    @property
    def pending(self) -> bytes:
        return self._tail


def parse_usage(obj: Any) -> tuple[int | None, int | None]:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None, None
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (p if isinstance(p, int) else None), (c if isinstance(c, int) else None)


class StreamRelay:
    """Relay one upstream SSE response to an ASGI client, timing it into ``rec``."""

    def __init__(self, rec: RequestRecord, send: Send, timeouts: TimeoutConfig, *, strip_usage: bool,
                 before_first: Callable[[], Awaitable[None]] | None = None,
                 on_done: Callable[[], None] | None = None, grammar: Grammar | None = None) -> None:
        self.rec = rec
        self.grammar = grammar  # None: OpenAI chat/completions chunks, scanned here
        # Called once [DONE] is about to go out: a client that hangs up right after reading it
        # (the openai SDK does) has its answer, and must not count as a disconnect.
        self.on_done = on_done
        self.send = send
        self.before_first = before_first  # e.g. send the response headers with the first bytes
        self.timeouts = timeouts
        self.strip_usage = strip_usage
        self.done = False
        self.upstream_error = False

    def _scan(self, events: list[bytes], now: float) -> bytes:
        """Account for ``events``; return the bytes to send (all of them unless one is dropped)."""
        if self.grammar is not None:
            return self._scan_grammar(events, now)
        rec = self.rec
        out: list[bytes] | None = None
        for i, ev in enumerate(events):
            keep = True
            if _CONTENT.search(ev):
                if rec.content_chunks == 0:
                    rec.t_first = now
                    rec.to(State.STREAMING)
                else:
                    rec.gaps.append(now - rec.t_last)
                rec.t_last = now
                rec.content_chunks += 1
            if b'"usage"' in ev and _USAGE.search(ev):
                try:
                    obj = orjson.loads(ev.split(b":", 1)[1])
                except (orjson.JSONDecodeError, IndexError):
                    obj = None
                p, c = parse_usage(obj)
                if c is not None:
                    rec.prompt_tokens, rec.completion_tokens, rec.usage_from_server = p, c, True
                if self.strip_usage and _EMPTY_CHOICES.search(ev):
                    keep = False
            elif _DONE.match(ev):  # (anchored: fails within a few bytes on a content event)
                self.done = True
            elif _ERROR.match(ev):
                self.upstream_error = True
                rec.error = "the runtime sent an error event"
            if not keep and out is None:
                out = list(events[:i])
            elif keep and out is not None:
                out.append(ev)
        if out is None:
            return b"".join(events) if len(events) > 1 else events[0]
        return b"".join(out)

    def _scan_grammar(self, events: list[bytes], now: float) -> bytes:
        """``_scan`` for a stream read through its API's grammar; nothing is dropped."""
        rec, g = self.rec, self.grammar
        assert g is not None
        for ev in events:
            flags = g.scan(ev)
            if flags & CONTENT:
                if rec.content_chunks == 0:
                    rec.t_first = now
                    rec.to(State.STREAMING)
                else:
                    rec.gaps.append(now - rec.t_last)
                rec.t_last = now
                rec.content_chunks += 1
            if flags & END:
                self.done = True
            if flags & ERROR:
                self.upstream_error = True
                rec.error = "the runtime sent an error event"
        if g.completion_tokens is not None:
            rec.prompt_tokens, rec.completion_tokens, rec.usage_from_server = \
                g.prompt_tokens, g.completion_tokens, True
        return b"".join(events) if len(events) > 1 else events[0]

    async def run(self, resp: Response, deadline_total: float) -> None:
        """Relay until ``[DONE]``; raise UpstreamTimeout/UpstreamError on a broken stream.

        The response headers have already been sent to the client by the caller.
        """
        rec, t = self.rec, self.timeouts
        scanner = SSEScanner()
        held: list[bytes] | None = []  # events before the first content chunk
        read = resp.readany
        send = self.send
        loop = asyncio.get_running_loop()
        # Deadlines on the loop's clock; perf_counter values are for the record.
        now_loop = loop.time()
        total_at = now_loop + (deadline_total - time.perf_counter())
        first_at = min(total_at, now_loop + t.first_token_s)
        slack = min(1.0, t.between_tokens_s / 10)
        try:
            async with asyncio.timeout_at(first_at) as budget:
                while True:
                    data = await read()
                    if not data:
                        break
                    events = scanner.feed(data)
                    if events:
                        payload = self._scan(events, time.perf_counter())
                        if held is not None:
                            # Before the first token nothing goes out (a role chunk is useless
                            # alone): a runtime that fails or times out before then can still
                            # be answered with a proper status, or replaced by another replica.
                            held.append(payload)
                            if not (rec.content_chunks or self.done or self.upstream_error):
                                continue
                            payload, held = b"".join(held), None
                            if self.before_first is not None:
                                await self.before_first()
                                self.before_first = None
                        if self.done and self.on_done is not None:
                            self.on_done()
                            self.on_done = None
                        if payload:
                            await send({"type": "http.response.body", "body": payload, "more_body": True})
                    if rec.content_chunks:
                        # Move the deadline only once per `slack`, not on every chunk: a timer
                        # reschedule per token is a measurable share of the gateway's CPU. The
                        # limit then fires between between_tokens_s and that plus slack.
                        now = loop.time()
                        left = budget.when() - now  # type: ignore[operator]
                        if not t.between_tokens_s <= left <= t.between_tokens_s + slack:  # (also: first token)
                            budget.reschedule(min(total_at, now + t.between_tokens_s + slack))
        except TimeoutError:
            remaining_total = total_at - loop.time()
            if remaining_total <= 0.001:
                raise UpstreamTimeout("total", t.total_s) from None
            if rec.content_chunks:
                raise UpstreamTimeout("between tokens", t.between_tokens_s) from None
            raise UpstreamTimeout("first token", t.first_token_s) from None
        except (HTTPClientError, OSError) as exc:
            raise UpstreamError(f"The model runtime '{rec.backend}' broke the stream: "
                                f"{exc.__class__.__name__}", retryable=True) from exc
        tail = self._scan([scanner.pending], time.perf_counter()) + b"\n\n" if scanner.pending.strip() else b""
        if not self.done and not self.upstream_error and self.grammar is not None and self.grammar.ends_at_close:
            self.done = True  # a grammar without an end marker: the close is the end
        if held is not None and self.done:  # a stream with no content at all, e.g. max_tokens = 0
            tail = b"".join(held) + tail
        if self.done and self.on_done is not None:
            self.on_done()
        if tail and (held is None or self.done):
            # (a last event without its blank line is delivered rather than lost)
            if self.before_first is not None:
                await self.before_first()
                self.before_first = None
            await send({"type": "http.response.body", "body": tail, "more_body": True})
        if self.upstream_error:
            raise UpstreamError("The model runtime reported an error in the stream.")
        if not self.done:
            raise UpstreamError(f"The model runtime '{rec.backend}' closed the stream before it was complete.",
                                retryable=True)


async def read_body(resp: Response, rec: RequestRecord, timeouts: TimeoutConfig,
                    deadline_total: float) -> bytes:
    """Read a non-streaming answer within the first-token and total limits."""
    remaining = deadline_total - time.perf_counter()
    limit, phase = ((timeouts.first_token_s, "first token") if timeouts.first_token_s < remaining
                    else (max(remaining, 0.0), "total"))
    try:
        async with asyncio.timeout(limit):
            body = await resp.read()
    except TimeoutError:
        raise UpstreamTimeout(phase, timeouts.first_token_s if phase == "first token" else timeouts.total_s) \
            from None
    except (HTTPClientError, OSError) as exc:
        raise UpstreamError(f"The model runtime '{rec.backend}' broke the response: "
                            f"{exc.__class__.__name__}", retryable=True) from exc
    rec.t_first = rec.t_last = time.perf_counter()
    if b'"usage"' in body:
        try:
            p, c = parse_usage(orjson.loads(body))
        except orjson.JSONDecodeError:
            p = c = None
        if c is not None or p is not None:
            rec.prompt_tokens, rec.completion_tokens, rec.usage_from_server = p, c, True
    return body
