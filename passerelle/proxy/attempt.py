"""One try of a request on one replica: send it, check what comes back, take the answer.

Everything the runtime may make the gateway wait for is bounded by one timer per attempt, entered
before the request is sent: the response head must come by ``deadline.first_at`` (streams, and
answers assembled from a stream) or ``deadline.total_at`` (an answer the runtime sends whole); then
the relay moves the same timer token by token (relay.py). What is read is capped (``[limits]``).

    fetch ─► Backend.post ─► check_head ─► error body (capped) ─► UpstreamStatus
                                        └► a stream: StreamRelay to the client, or to a _Collector
                                           that assembles it (llama-server's non-streamed answers)
                                        └► a whole answer: read_body (capped), JSON or 502

Every attempt's end is one :class:`Outcome` for the replica's circuit breaker (``outcome_of``).

Example::

    req = upstream_request(call, backend, cfg)   # upstream_request.py: the body as sent
    answer = await fetch(ex, req, backend, call.deadline)
    if answer is not None:          # (None: streamed to the client already)
        raw, content_type = answer
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

import orjson

from passerelle.errors import GatewayError, InputTooLong, UpstreamError, UpstreamStatus, UpstreamTooLarge
from passerelle.proxy import grammars
from passerelle.proxy.answer import AnswerShare, Piece
from passerelle.proxy.assemble import ChatAssembler
from passerelle.proxy.assemble_events import EventsAssembler
from passerelle.proxy.deadline import Deadline
from passerelle.proxy.exchange import Exchange, Send
from passerelle.proxy.relay import StreamRelay
from passerelle.proxy.repair import repair_body
from passerelle.proxy.repair_stream import stream_repair
from passerelle.proxy.sse_scan import SSEScanner
from passerelle.proxy.upstream_read import finish_upstream, read_body, read_error
from passerelle.proxy.upstream_request import UpstreamRequest
from passerelle.runtimes.breaker import Outcome
from passerelle.runtimes.kinds import Backend
from passerelle.upstream.client import Response


class _Collector:
    """An ASGI ``send`` that assembles the answer as its events arrive (for answers assembled from
    a stream): at most ``limit`` bytes of stream (``[limits] max_answer_bytes``), and what the
    answer holds counted against every answer's budget (``hold``: ``max_answer_bytes_total``)."""

    def __init__(self, limit: int, builder: ChatAssembler | EventsAssembler, hold: AnswerShare | None) -> None:
        self.size = 0
        self.limit = limit
        self.builder = builder
        self.hold = hold
        self.scanner = SSEScanner(max_event=limit)

    async def __call__(self, message: dict[str, Any]) -> None:
        body = message.get("body", b"")
        self.size += len(body)
        if self.size > self.limit:
            raise UpstreamTooLarge("answer", self.limit, "max_answer_bytes")
        builder = self.builder
        for ev in self.scanner.feed(body):
            builder.feed(ev)
        if self.hold is not None:
            self.hold.grow_to(builder.held)

    def finish(self) -> list[Piece]:
        if pending := self.scanner.pending:
            self.builder.feed(pending + b"\n\n")  # (a last event without its blank line)
        return self.builder.finish()


# llama-server's refusals of an input it would have to take in one batch (an embedding, a rerank
# document: never split), as a 500 past its physical batch or a 400 past its context.
_TOO_LONG = re.compile(rb"input \((\d+) tokens\) is (?:too large to process\. increase the physical batch size "
                       rb"\(current batch size: (\d+)\)|larger than the max context size \((\d+) tokens\))")


def refusal(status: int, raw: bytes, content_type: bytes) -> GatewayError:
    """The error for a runtime's non-200 answer: its own, passed on (UpstreamStatus), except an input
    too long to take, which is the client's (a 400 naming the length and the limit) and says
    nothing against the runtime."""
    if status in (400, 500) and (m := _TOO_LONG.search(raw[:4096])):
        return InputTooLong(int(m[1]), int(m[2] or m[3]))
    return UpstreamStatus(status, raw, content_type)


def outcome_of(err: BaseException | None) -> Outcome:
    """What an attempt's end says about the runtime, for its circuit breaker: a failure when the
    runtime could not answer properly, nothing at all when the client, its request, a cap or the
    gateway ended it."""
    if err is None:
        return Outcome.SUCCESS
    if isinstance(err, UpstreamStatus):
        return Outcome.FAILURE if err.status >= 500 or err.status == 429 else Outcome.NEUTRAL
    if isinstance(err, UpstreamTooLarge) or not isinstance(err, UpstreamError):
        return Outcome.NEUTRAL
    return Outcome.FAILURE


async def fetch(ex: Exchange, req: UpstreamRequest, backend: Backend,
                deadline: Deadline) -> tuple[bytes | list[Piece], bytes] | None:
    """Send ``req`` and take the runtime's answer within the attempt's one timer (the response
    head, then the stream it moves): a stream is relayed to the client (None); a non-streamed
    answer is returned whole, with its content type, for the caller to send (an answer assembled
    from a stream as pieces, answer.py; what it holds counted in ``ex.held``).

    With a splice (a preemptible stream, resume.py) the events pass through it, the scheduler
    may cut the attempt once ``req.on_streaming`` was called, and a cut attempt returns None (or
    raises) with ``splice.suspended`` set; an assembled answer keeps its collector across attempts."""
    rec, limits, api, splice = ex.rec, req.limits, req.api, req.splice
    streamed = req.streamed
    deadline.start_attempt()
    head_at = deadline.head_at(streamed=streamed)
    resp: Response | None = None
    relay: StreamRelay | None = None
    sink: _Collector | None = None
    if req.collect:
        builder = ChatAssembler(api.name) if api.grammar == "chat" else EventsAssembler(api.grammar)
        sink = splice.collector if splice is not None and splice.collector is not None else \
            _Collector(limits.max_answer_bytes, builder, ex.held)
        if splice is not None:
            splice.collector = sink
    finishing = False  # the answer is whole; only what follows [DONE] is being read
    try:
        async with asyncio.timeout_at(head_at) as budget:
            resp = await backend.post(api.upstream, req.body, request_id=rec.id, content_type=req.content_type,
                                      traceparent=rec.trace.traceparent() if rec.trace is not None else b"")
            check_head(resp, backend, streamed=streamed, json=not api.form)
            if resp.status != 200:
                raw = await read_error(resp, rec, limit=limits.max_error_bytes)
                raise refusal(resp.status, raw, resp.header(b"content-type") or b"")
            if not streamed:
                raw = await read_body(resp, rec, limit=limits.max_answer_bytes)
                if not api.form and raw.lstrip()[:1] not in (b"{", b"["):
                    raise UpstreamError(f"The model runtime '{backend.name}' answered with a body that is not "
                                        "JSON.")
                if not rec.usage_from_server and b"_tokens" in raw:  # Responses', Anthropic's, llama-server's
                    with contextlib.suppress(orjson.JSONDecodeError):
                        obj = orjson.loads(raw)
                        p, c = grammars.usage_of(obj)
                        if p is not None or c is not None:
                            rec.prompt_tokens, rec.completion_tokens, rec.usage_from_server = p, c, True
                            rec.cached_tokens = grammars.cached_of(obj)
                if req.repair is not None:
                    raw = repair_body(req.repair, api.grammar, raw)
                return raw, resp.header(b"content-type") or b"application/json"
            send: Send = sink if sink is not None else ex.send
            if splice is not None:
                send = splice.watch(resp, send, req.dialect, streaming=req.on_streaming)
            # to an assembler, or to the client (whose response head goes out with the first bytes)
            relay = StreamRelay(rec, send, req.timeouts, strip_usage=req.strip_usage,
                                client=ex if sink is None else None, grammar=grammars.make(api.grammar),
                                max_event=limits.max_event_bytes,
                                repair=stream_repair(req.repair, api.grammar) if req.repair is not None else None)
            await relay.relay(resp, deadline, budget)
            if splice is not None and splice.suspended:
                return None
            if sink is None:
                ex.mark_finishing()
                with contextlib.suppress(OSError):  # the client may hang up once it has [DONE]
                    # (the stream's last bytes, kept by the relay, go out with the body's end: one write)
                    await ex.send_body(relay.final, more=False)
            finishing = True
            await finish_upstream(resp, budget)
    except TimeoutError:
        if not finishing:
            if resp is None:
                raise deadline.expired(head_at, detail=f"runtime '{backend.name}' sent no response head") \
                    from None
            if relay is not None:
                raise relay.timed_out(deadline) from None
            raise deadline.expired(head_at, detail=f"its HTTP {resp.status} answer was still arriving") from None
    finally:
        if resp is not None:
            resp.close()  # drops the connection if unread: the runtime stops generating
    if sink is None:
        return None
    return sink.finish(), b"application/json"


def check_head(resp: Response, backend: Backend, *, streamed: bool, json: bool = True) -> None:
    """Refuse what is not an answer to relay: a redirect (never followed: it could point
    anywhere), a status that is neither 200 nor an error, or a 200 whose type is not an event
    stream (streams) or JSON (the rest), such as an HTML page from a proxy in front."""
    status = resp.status
    if status == 200:
        raw = resp.header(b"content-type")
        if not raw:
            return
        ctype = raw.decode("latin-1").lower()
        if streamed and "event-stream" not in ctype:
            raise UpstreamError(f"The model runtime '{backend.name}' answered a streaming request with "
                                f"'{ctype[:80]}', not an event stream.")
        if not streamed and json and "json" not in ctype:
            raise UpstreamError(f"The model runtime '{backend.name}' answered with '{ctype[:80]}', not JSON.")
        return
    if 400 <= status < 600:
        return  # the runtime's error: passed on by the caller
    where = resp.headers.get("Location", "")
    to = f" to '{where[:200]}'" if where else ""
    raise UpstreamError(f"The model runtime '{backend.name}' answered HTTP {status}{to}; passerelle does not "
                        "follow redirects or relay other statuses. Check the backend's url.")
