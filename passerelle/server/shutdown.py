"""Stopping without truncating: past ``server.shutdown_grace_s``, every request still in progress
is ended with an error its client can read, and with its own termination cause.

On SIGTERM uvicorn stops accepting, lets requests in progress run for the grace period, then
cancels them: a stream would end with no error event, as if it had finished (a client cannot tell
an answer cut short from a complete one), and its access-log line would blame nobody in
particular. Instead, at the end of the grace period (uvicorn's own timeout is set a little later,
see ``serving.py``), :func:`end_open_requests` takes each request the gateway still has open
(``Gateway.open``) and:

* sends a stream that began its API's error event, then ends it (``[DONE]`` is never sent);
* answers a request that got nothing yet (queued, or waiting for its first token) with 503 in
  its API's error shape;
* records the cause ``shutdown`` and ends the request's task, which releases its slot as usual.

Writes go through the request's :class:`StreamGate`, closed first so that nothing the request's
own task still sends can come after the final event. A request whose last bytes are already on
their way (a whole answer, or its own error) is left to finish. Either way a client gets one second
(``write_timeout_s``) to take what it is sent; one that does not read is then cut (a reset), so
that its connection never holds the shutdown: uvicorn waits for every connection to close.

Example::

    send = StreamGate(send)                  # App, for every inference request
    ...
    await end_open_requests(gateway.open, ShuttingDown(30.0))
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from passerelle.errors import Cause, GatewayError
from passerelle.proxy import grammars
from passerelle.proxy.exchange import Exchange, StreamGate
from passerelle.proxy.protocols import OPENAI, error_body

Send = Callable[[dict[str, Any]], Awaitable[None]]


class ShuttingDown(GatewayError):
    status, type, code, cause = 503, "server_error", "shutting_down", Cause.SHUTDOWN

    def __init__(self, grace_s: float) -> None:
        super().__init__(f"The gateway is shutting down; this request was still running after the "
                         f"{grace_s:g} s grace period (server.shutdown_grace_s). Retry on another instance "
                         "or once it is back.", retry_after=5)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"connection", b"close")]


def _last_bytes_out(ex: Exchange) -> bool:
    """Whether ``ex`` is past what a final error could be added to: its answer is whole and going
    out (``finishing``, or a non-streamed body sent in pieces under its Content-Length), or its own
    error is being written (its cause is set)."""
    return ex.finishing or ex.rec.cause is not None or (ex.started and not ex.rec.stream)


async def _left_the_gateway(ex: Exchange) -> None:
    """Until the bytes written to ``ex``'s client have all been handed to the kernel (a client that
    does not read leaves them in the gateway, and keeps its connection open with them)."""
    while ex.unsent():
        await asyncio.sleep(0.01)


async def _end(ex: Exchange, gate: StreamGate, err: GatewayError, deadline: float) -> None:
    ex.rec.finish(err.cause, err.status, err.message)
    gate.closed = True
    if ex.started:  # the error event of the stream's own API (Chat, Responses, Anthropic Messages)
        final = [{"type": "http.response.body", "body": grammars.error_event(ex.grammar, err), "more_body": False}]
    else:  # an error response in the API's shape
        body, ctype = error_body(err, ex.errors)
        rid = ex.rec.id.encode()
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode()), (b"x-request-id", rid),
                   *err.headers(), *([] if ex.errors == OPENAI else [(b"request-id", rid)])]
        final = [{"type": "http.response.start", "status": err.status, "headers": headers},
                 {"type": "http.response.body", "body": body, "more_body": False}]
    delivered = False
    with contextlib.suppress(TimeoutError, OSError, RuntimeError):  # gone, or not reading
        async with asyncio.timeout_at(deadline):
            for message in final:
                await gate.raw(message)
            await _left_the_gateway(ex)
            delivered = True
    if not delivered:
        # A client that does not read: its connection is reset rather than left open, since the
        # server waits for every connection to close before it stops.
        ex.cut()
    # The request's task ends the way a client's hang-up ends it (its slot and key are released,
    # its line is written), with the cause recorded above.
    ex.end_now()


async def _let_finish(ex: Exchange, err: GatewayError, deadline: float) -> bool:
    """Give a request whose last bytes are on their way until ``deadline`` to finish by itself;
    past it, its client is cut (and the request, if its answer was not out yet, ends with
    ``err``'s cause). Whether it had to be cut short."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout_at(deadline):
            await asyncio.wait([ex.task])
            await _left_the_gateway(ex)
            return False
    cut_short = ex.rec.cause is None
    ex.rec.finish(err.cause, err.status, err.message)
    ex.cut()
    if not ex.task.done():
        ex.end_now()
    return cut_short


async def end_open_requests(exchanges: Iterable[Exchange], err: GatewayError, *,
                            write_timeout_s: float = 1.0) -> int:
    """End every request of ``exchanges`` within ``write_timeout_s``: those still running with
    ``err``; those whose last bytes are on their way are given that long to finish. How many
    were ended with ``err``."""
    deadline = asyncio.get_running_loop().time() + write_timeout_s
    gated = [(ex, ex.asgi_send) for ex in list(exchanges) if isinstance(ex.asgi_send, StreamGate)]
    finishing = [ex for ex, _ in gated if _last_bytes_out(ex)]
    ending = [(ex, gate) for ex, gate in gated if not _last_bytes_out(ex)]
    cut = await asyncio.gather(*(_let_finish(ex, err, deadline) for ex in finishing),
                               *(_end(ex, gate, err, deadline) for ex, gate in ending))
    return len(ending) + sum(1 for c in cut[:len(finishing)] if c)
