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
own task still sends can come after the final event; a client that does not read gets one second.

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
from passerelle.proxy.exchange import Exchange
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


class StreamGate:
    """An ASGI ``send`` that can be closed: once ``closed``, what the app sends is dropped, and
    only the shutdown path writes (through ``raw``)."""

    __slots__ = ("closed", "raw")

    def __init__(self, raw: Send) -> None:
        self.raw = raw
        self.closed = False

    async def __call__(self, message: dict[str, Any]) -> None:
        if not self.closed:
            await self.raw(message)

    @property
    def __wrapped__(self) -> Send:
        """What it wraps: the exchange finds the client's connection under it (to cut a client
        that stopped reading)."""
        return self.raw


async def _end(ex: Exchange, gate: StreamGate, err: GatewayError, write_timeout_s: float) -> None:
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
    with contextlib.suppress(TimeoutError, OSError, RuntimeError):  # gone, or not reading
        async with asyncio.timeout(write_timeout_s):
            for message in final:
                await gate.raw(message)
    # The request's task ends the way a client's hang-up ends it (its slot and key are released,
    # its line is written), with the cause recorded above.
    ex.end_now()


async def end_open_requests(exchanges: Iterable[Exchange], err: GatewayError, *,
                            write_timeout_s: float = 1.0) -> int:
    """End every request of ``exchanges`` that is not already finishing; how many were ended."""
    ending = [_end(ex, ex.asgi_send, err, write_timeout_s) for ex in list(exchanges)
              if isinstance(ex.asgi_send, StreamGate) and not ex.finishing and ex.rec.cause is None]
    await asyncio.gather(*ending)
    return len(ending)
