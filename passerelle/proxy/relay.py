"""SSE pass-through: runtime bytes reach the client as they arrive; a byte scan learns the rest.

No event is decoded as JSON except the one carrying ``usage``. Complete events from one upstream
read are sent to the client in one write; an incomplete trailing event is held only until its end
arrives (a partial event is of no use to a client). The scan finds:

* content chunks (what counts as one is defined once, in chunks.py, for the relay and the
  benchmark alike): first-token time, inter-chunk gaps, a fallback token count (a reasoning
  model's thinking is its first tokens);
* the usage chunk: token counts; dropped again when the gateway asked for it and the client did not;
* ``[DONE]``: the end; nothing after it is relayed or even read, and a stream that ends without
  it was truncated (the client gets an error event).

Where it runs: when nothing rewrites the stream, a stream to the client's own uvicorn connection
is relayed in the upstream connection's callback (``Response.sink_into``): before the first token
it holds what comes (the role chunk) and hands over to the task, which sends the head with the
first part in one write (``Exchange.start_with``); after that it writes with ``Exchange.write_now``:
no task switch and no ASGI message per chunk. The request's task waits meanwhile, and takes over
(the loop in :meth:`StreamRelay.relay`) at the end, on an error, or while the client cannot take
bytes at once.

Caps and time: an event is at most ``[limits] max_event_bytes``; the scan is linear in the bytes
received however they are cut; every wait is bounded by the request's :class:`Deadline`.

Other APIs' streams (Responses, Anthropic Messages, llama-server's native chunks) are read through
their grammar (grammars.py), which says the same things in their words, and supplies the fields of
that API a runtime left out of an event (the event is then relayed with them).

The split into events is sse_scan.py's; a body that is not relayed is read by upstream_read.py.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson

from passerelle.chunks import CHAT
from passerelle.config import TimeoutConfig
from passerelle.errors import ClientTimeout, GatewayError, UpstreamError, UpstreamTimeout
from passerelle.observe.record import RequestRecord, State
from passerelle.proxy.deadline import Deadline
from passerelle.proxy.grammars import AMENDED, CONTENT, END, ERROR, Grammar, cached_of
from passerelle.proxy.repair import StreamRepair
from passerelle.proxy.sse_scan import SSEScanner, parse_usage
from passerelle.upstream.client import HTTPClientError, Response

Send = Callable[[dict[str, Any]], Awaitable[None]]

_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_ERROR = re.compile(rb'^data:\s*\{\s*"error"')
_DONE = re.compile(rb"^data:\s*\[DONE\]\s*$")


SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class Client(Protocol):
    """The client's response, as the relay sees it (``Exchange``)."""

    started: bool

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    def mark_finishing(self) -> None: ...


class DirectClient(Client, Protocol):
    """A client whose body can also be written at once, without a send (``Exchange``)."""

    def writable(self) -> bool: ...

    def write_now(self, body: bytes) -> None: ...


class StreamRelay:
    """Relay one upstream SSE response to an ASGI client, timing it into ``rec``.

    ``client``: the response whose head goes out with the first bytes (unless it went already),
    and that is marked finishing once ``[DONE]`` is about to go out; None when ``send`` is not a
    client's (an answer assembled from a stream)."""

    def __init__(self, rec: RequestRecord, send: Send, timeouts: TimeoutConfig, *, strip_usage: bool,
                 client: Client | None = None, grammar: Grammar | None = None, max_event: int = 1 << 20,
                 repair: StreamRepair | None = None) -> None:
        self.rec = rec
        self.repair = repair  # tool calls left as text made the API's own (repair_stream.py); None: off
        self.grammar = grammar  # None: OpenAI chat/completions chunks, scanned here
        # Called once [DONE] is about to go out: a client that hangs up right after reading it
        # (the openai SDK does) has its answer, and must not count as a disconnect.
        self.on_done: Callable[[], None] | None = client.mark_finishing if client is not None else None
        self.send = send
        # sends the response head with the first bytes
        self.before_first: Callable[[], Awaitable[None]] | None = None
        if client is not None and not client.started:
            self.before_first = functools.partial(client.start, 200, SSE_HEADERS)
        self.timeouts = timeouts
        self.strip_usage = strip_usage
        self.max_event = max_event
        self.done = False
        self.upstream_error = False
        self.sending = False  # waiting for the client to take bytes (not the runtime's time)
        # The client, when ``send`` is its own send and it can be written at once: then, once the
        # head is out, the stream's bytes are relayed in the upstream connection's callback.
        self.direct: DirectClient | None = None
        if client is not None and hasattr(client, "write_now") and send == getattr(client, "send", None):
            self.direct = client  # type: ignore[assignment]
        # With a direct client, the bytes that end the stream ([DONE]'s) are not sent here but kept
        # for the caller's last send, which writes them with the end of the body in one write
        # (unless the runtime reported an error: the caller then reports it, and these go out now).
        self.final = b""

    def _scan(self, events: list[bytes], now: float) -> bytes:
        """Account for ``events``; return the bytes to send (all of them unless one is dropped).
        Nothing after ``[DONE]`` is sent: the stream is over there."""
        if self.grammar is not None:
            return self._scan_grammar(events, now)
        rec = self.rec
        out: list[bytes] | None = None
        for i, ev in enumerate(events):
            keep = True
            # (the form every OpenAI-compatible runtime sends first: a plain find, which settles a
            # content event without the regex; anything else is the regex's to decide)
            at = ev.find(b'"content":"')
            if (0 <= at < len(ev) - 11 and ev[at + 11] != 34) or CHAT.search(ev):
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
                    rec.cached_tokens = cached_of(obj)
                if self.strip_usage and _EMPTY_CHOICES.search(ev):
                    keep = False
            elif b"[DONE]" in ev and _DONE.match(ev):
                self.done = True
                if i + 1 < len(events):  # events after [DONE] are not relayed
                    out = list(events[:i + 1]) if out is None else [*out, ev]
                    break
            elif b'"error"' in ev and _ERROR.match(ev):
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
        """``_scan`` for a stream read through its API's grammar; nothing after its end event is sent."""
        rec, g = self.rec, self.grammar
        assert g is not None
        for i, ev in enumerate(events):
            flags = g.scan(ev)
            if flags & AMENDED:  # (a field its API defines, which the runtime left out: supplied)
                events[i] = g.amended
            if flags & CONTENT:
                if rec.content_chunks == 0:
                    rec.t_first = now
                    rec.to(State.STREAMING)
                else:
                    rec.gaps.append(now - rec.t_last)
                rec.t_last = now
                rec.content_chunks += 1
            if flags & ERROR:
                self.upstream_error = True
                rec.error = "the runtime sent an error event"
            if flags & END:
                self.done = True
                if i + 1 < len(events):  # events after the end are not relayed
                    events = events[:i + 1]
                break
        if g.completion_tokens is not None:
            rec.prompt_tokens, rec.completion_tokens, rec.usage_from_server = \
                g.prompt_tokens, g.completion_tokens, True
            rec.cached_tokens = g.cached_tokens
        elif g.prompt_tokens is not None:  # (Messages: the prompt's count comes first, in message_start)
            rec.prompt_tokens = g.prompt_tokens
        return b"".join(events) if len(events) > 1 else events[0]

    async def run(self, resp: Response, deadline: Deadline, budget: asyncio.Timeout | None = None) -> None:
        """Relay until ``[DONE]``; raise UpstreamTimeout/UpstreamError on a broken stream, and
        ClientTimeout when the deadline passed while the client was not taking bytes.

        ``budget`` is the attempt's one timeout, entered by the caller before it sent the request
        (one timer per request covers the response head and the stream); without one, the relay
        makes its own. Either way it fires at ``deadline.first_at`` until the first content chunk,
        then each content chunk moves it ``between_tokens_s`` ahead, never past ``total_at``. A
        caller that gives a budget turns its expiry into an error with :meth:`timed_out`.
        Reading stops at ``[DONE]``: what a runtime sends after it is never relayed, and a runtime
        that idles after it has still answered in full.
        """
        if budget is not None:
            await self.relay(resp, deadline, budget)
            return
        try:
            async with asyncio.timeout_at(deadline.first_at) as own:
                await self.relay(resp, deadline, own)
        except TimeoutError:
            raise self.timed_out(deadline) from None

    def timed_out(self, deadline: Deadline) -> GatewayError:
        """The error for the budget running out during :meth:`run`: which deadline it was, and
        whose turn it was (a client that takes nothing is not the runtime's fault)."""
        t = self.timeouts
        if deadline.left_s <= 0.001:
            return UpstreamTimeout("total", t.total_s)
        if self.sending:  # the runtime was waiting for us: the client took nothing all that time
            return ClientTimeout(f"The client took no bytes for {t.between_tokens_s:g} s.")
        if self.rec.content_chunks:
            return UpstreamTimeout("between tokens", t.between_tokens_s)
        return UpstreamTimeout("first token", t.first_token_s)

    async def relay(self, resp: Response, deadline: Deadline, budget: asyncio.Timeout) -> None:
        """:meth:`run` within the caller's ``budget`` (awaited directly by a caller that has one:
        a coroutine less to pass through each time the stream's task resumes)."""
        rec, t = self.rec, self.timeouts
        scanner = SSEScanner(self.max_event)
        held: list[bytes] | None = []  # events before the first content chunk
        read = resp.readany
        send = self.send
        repair = self.repair
        loop = asyncio.get_running_loop()
        total_at = deadline.total_at
        between = t.between_tokens_s
        slack = min(1.0, between / 10)
        seen = 0  # content chunks (with repair, the runtime's text deltas too) when the deadline last moved
        # Once the head is out, a stream the gateway passes on as it comes (no tool-call repair, to
        # the client's own connection) is relayed in the upstream connection's callback as its bytes
        # arrive: the same split, scan and deadline as the loop below, and the bytes written at
        # once, with no task switch, no coroutines and no message per chunk. The task waits until
        # the sink hands over: at the end, on an error, or when the client cannot take bytes now
        # (the loop then sends them, waiting for the client as usual).
        # Before the first token the sink only holds what comes (the role chunk), and hands over
        # (``ready``) once the first content, the end or an error is held: the head goes out from
        # the task, with the first part, in one write.
        direct = self.direct if repair is None and hasattr(resp, "sink_into") else None
        failed: list[BaseException] = []
        ready = False

        def sink(resp: Response) -> bool:
            nonlocal seen, ready
            before = held
            if before is None and not direct.writable():  # type: ignore[union-attr]
                return False
            try:
                events = scanner.feed(resp.take())
                if not events:
                    return True
                payload = self._scan(events, time.perf_counter())
                if rec.content_chunks != seen:  # (the deadline as in the loop below)
                    seen = rec.content_chunks
                    now = loop.time()
                    left = budget.when() - now  # type: ignore[operator]
                    if not between <= left <= between + slack:
                        budget.reschedule(min(total_at, now + between + slack))
                if before is not None:
                    before.append(payload)
                    ready = bool(rec.content_chunks or self.done or self.upstream_error)
                    return not ready
                if self.done and self.on_done is not None:
                    self.on_done()
                    self.on_done = None
                if self.done and not self.upstream_error:
                    self.final = payload  # (for the caller's last send: see __init__)
                elif payload:
                    direct.write_now(payload)  # type: ignore[union-attr]
            except Exception as exc:  # (raised by the task, as if the loop had met it)
                failed.append(exc)
                return False
            return not self.done

        try:
            while not self.done or ready:
                if not ready and direct is not None and (held is not None or direct.writable()):
                    waiter = resp.sink_into(sink)
                    if waiter is not None:
                        try:
                            await waiter
                        finally:
                            resp.unsink()
                        if failed:
                            raise failed.pop()
                        if not ready:
                            continue
                if ready:  # (the sink held the first content, the end or an error: flushed below)
                    ready, payload = False, b""
                else:
                    data = await read()
                    if not data:
                        break
                    events = scanner.feed(data)
                    if not events:
                        continue
                    if repair is not None:  # (before the scan: it accounts what the client gets)
                        events = repair.feed(events)
                    payload = self._scan(events, time.perf_counter()) if events else b""
                    # (with repair, a call being held is text the runtime generates, though none goes out yet)
                    progress = rec.content_chunks if repair is None else rec.content_chunks + repair.repair.fed
                    if progress != seen:
                        # Only content moves the deadline (a runtime dripping comments or empty
                        # events is not producing tokens), and only once per `slack`, not on every
                        # chunk: a timer reschedule per token is a measurable share of the
                        # gateway's CPU. The limit then fires between between_tokens_s and that
                        # plus slack.
                        seen = progress
                        now = loop.time()
                        left = budget.when() - now  # type: ignore[operator]
                        if not between <= left <= between + slack:  # (also: the first token)
                            budget.reschedule(min(total_at, now + between + slack))
                    if not events:
                        continue
                if held is not None:
                    # Before the first token nothing goes out (a role chunk is useless alone): a
                    # runtime that fails or times out before then can still be answered with a
                    # proper status, or replaced by another replica.
                    held.append(payload)
                    if not (rec.content_chunks or self.done or self.upstream_error):
                        continue
                    payload, held = b"".join(held), None
                    if self.before_first is not None:
                        self.sending = True
                        start_with = getattr(self.direct, "start_with", None)
                        if start_with is not None and payload and not self.done:
                            # the head and the first part in one write (the usual first token)
                            await start_with(200, SSE_HEADERS, payload)
                            payload = b""
                        else:
                            await self.before_first()
                        self.before_first = None
                if self.done and self.on_done is not None:
                    self.on_done()
                    self.on_done = None
                if self.done and self.direct is not None and not self.upstream_error:
                    self.final = payload  # (for the caller's last send: see __init__)
                elif payload:
                    if self.direct is not None and self.direct.writable():  # (no wait: no coroutine, no message)
                        self.direct.write_now(payload)
                    else:
                        self.sending = True
                        await send({"type": "http.response.body", "body": payload, "more_body": True})
                self.sending = False
        except (HTTPClientError, OSError) as exc:
            raise UpstreamError(f"The model runtime '{rec.backend}' broke the stream: "
                                f"{exc.__class__.__name__}", retryable=True) from exc
        tail = b""
        if not self.done and scanner.pending.strip():
            # (a last event without its blank line is delivered rather than lost)
            last = [scanner.pending + b"\n\n"]
            if repair is not None:
                last = repair.feed(last)
            tail = self._scan(last, time.perf_counter()) if last else b""
        if not self.done and not self.upstream_error and self.grammar is not None and self.grammar.ends_at_close:
            self.done = True  # a grammar without an end marker: the close is the end
        if held is not None and self.done:  # a stream with no content at all, e.g. max_tokens = 0
            tail = b"".join(held) + tail
        if self.done and self.on_done is not None:
            self.on_done()
        if tail and (held is None or self.done):
            self.sending = True
            if self.before_first is not None:
                await self.before_first()
                self.before_first = None
            await send({"type": "http.response.body", "body": tail, "more_body": True})
            self.sending = False
        if self.upstream_error:
            raise UpstreamError("The model runtime reported an error in the stream.")
        if not self.done:
            raise UpstreamError(f"The model runtime '{rec.backend}' closed the stream before it was complete.",
                                retryable=True)
