"""Client connections: caps and deadlines on everything a client controls before its request
reaches the app.

uvicorn's httptools protocol sets no limit on a request head's size or its number of headers, no
deadline for a head, none for a connection that never sends one (its keep-alive timer starts only
after a first response), and its ``limit_concurrency`` answers 503 only once a head has arrived
while every socket stays open. :func:`guarded_protocol` returns a subclass that adds, per listener:

* **head caps**: more than ``max_head_bytes`` (request line and headers) or ``max_headers``
  header lines → 431, connection closed. Bytes are counted as they arrive, so a header line that
  never ends is cut at the cap (plus at most one socket read), not buffered;
* **head deadline**: a head must be complete ``head_timeout_s`` after its first byte → 408, closed
  (slowloris);
* **idle reclaim**: a connection with no request in progress (just opened, or between keep-alive
  requests) is closed after ``keep_alive_s`` without a byte;
* **body backstop**: a request's body must be in ``body_timeout_s`` after its head. The app
  answers 408 itself when it is the one waiting for the body (:class:`BoundedReceive`); one second
  later this closes the connection whatever the app did, e.g. answered without reading a body
  that the client still trickles;
* **bodies held at once** (:class:`BodyBudget`): the request bodies all requests hold together
  stay under ``max_body_bytes_total``; past it, 503 ``server_busy`` (each body is also capped by
  ``max_body_bytes``, 413);
* **a connection limit**: beyond ``max_connections`` open connections, the connection idle the
  longest (no request in progress, head or not) is closed to make room, so idle and half-sent
  sockets can never lock others out; when every connection has a request in progress, the new one
  is answered 503 once its head is in, and closed.

Refusals are written in OpenAI's error shape with an ``X-Request-Id``, like every other answer::

    HTTP/1.1 431 Request Header Fields Too Large
    {"error": {"message": "The request head is larger than 65536 bytes ...", "type":
     "invalid_request_error", "code": "request_header_too_large"}}

Example::

    limits = ConnectionLimits.of(cfg.server)
    uvicorn.Config(app, http=guarded_protocol(limits), timeout_keep_alive=limits.keep_alive_s, ...)
"""

from __future__ import annotations

import asyncio
import http
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from passerelle.config import ServerConfig
from passerelle.errors import Cause, GatewayError, InvalidRequest
from passerelle.observe.record import new_request_id

log = logging.getLogger("passerelle.server.connections")

Receive = Callable[[], Awaitable[dict[str, Any]]]

_IDLE, _HEAD, _REQUEST, _CLOSED = range(4)
# After a refusal the connection reads and drops what the client still sends, this long at most,
# before closing: closing with unread bytes would reset the connection, and a client still
# writing its (too large) head would lose the answer that says why.
LINGER_S = 1.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_head_bytes: int = 65536
    max_headers: int = 100
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 30.0
    max_connections: int = 1024

    @classmethod
    def of(cls, server: ServerConfig, **changes: Any) -> ConnectionLimits:
        return cls(**{**{f: getattr(server, f) for f in cls.__dataclass_fields__}, **changes})


class RequestTimeout(InvalidRequest):
    """The client did not send its request body in time (raised by :class:`BoundedReceive`)."""

    status, code = 408, "request_timeout"

    def __init__(self, seconds: float) -> None:
        super().__init__(f"The request body did not arrive within {seconds:g} s (server.body_timeout_s).")
        self.seconds = seconds

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"connection", b"close")]  # whatever it still sends is not read


class BodiesOverBudget(GatewayError):
    """The request bodies being held at once would pass ``server.max_body_bytes_total``: the
    gateway itself is full (cause ``server_busy``: not a model's class queue, ``queue_full``, which
    is a 429 with its own remedy)."""

    status, type, code, cause = 503, "server_error", "server_busy", Cause.SERVER_BUSY

    def __init__(self, limit: int) -> None:
        super().__init__(f"The gateway already holds {limit} bytes of request bodies "
                         "(server.max_body_bytes_total); retry shortly.", retry_after=1)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [*super().headers(), (b"connection", b"close")]


class BodyBudget:
    """Bytes of request bodies held at once, by every request together, and their cap; and how long
    a body may take (``[server] max_body_bytes_total`` and ``body_timeout_s``)."""

    __slots__ = ("limit", "timeout_s", "used")

    def __init__(self, server: ServerConfig) -> None:
        self.used = 0
        self.configure(server)

    def configure(self, server: ServerConfig) -> None:
        """A lowered cap refuses new bodies until those held fit under it; none is cut."""
        self.limit = server.max_body_bytes_total
        self.timeout_s = server.body_timeout_s


class BoundedReceive:
    """An ASGI ``receive`` for one request whose body must be complete ``timeout_s`` from now
    (past that the waiting call raises :class:`RequestTimeout`) and fit in ``budget`` with every
    other request's (else :class:`BodiesOverBudget`). After the body it is ``receive`` itself (the
    wait for ``http.disconnect`` has no deadline). ``release()`` when the request ends: its body is
    held until then.

    Example::

        receive = BoundedReceive(receive, 60.0, budget)
        try:
            body = await read_request_body(scope, receive, limit)   # RequestTimeout after 60 s
        finally:
            receive.release()
    """

    __slots__ = ("budget", "deadline", "done", "held", "receive", "timeout_s")

    def __init__(self, receive: Receive, timeout_s: float, budget: BodyBudget) -> None:
        self.receive, self.timeout_s, self.budget = receive, timeout_s, budget
        self.deadline = asyncio.get_running_loop().time() + timeout_s
        self.done = False
        self.held = 0

    async def __call__(self) -> dict[str, Any]:
        if self.done:
            return await self.receive()
        try:
            async with asyncio.timeout_at(self.deadline):
                msg = await self.receive()
        except TimeoutError:
            raise RequestTimeout(self.timeout_s) from None
        if msg["type"] != "http.request" or not msg.get("more_body"):
            self.done = True
        if size := len(msg.get("body", b"")):
            if self.budget.used + size > self.budget.limit:
                raise BodiesOverBudget(self.budget.limit)
            self.budget.used += size
            self.held += size
        return msg

    def release(self) -> None:
        self.budget.used -= self.held
        self.held = 0


def error_bytes(status: int, code: str, message: str, *, kind: str = "invalid_request_error",
                retry_after: int | None = None) -> bytes:
    """A complete HTTP/1.1 error response that closes the connection."""
    body = orjson.dumps({"error": {"message": message, "type": kind, "code": code}})
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}", "content-type: application/json",
            f"content-length: {len(body)}", f"x-request-id: {new_request_id()}", "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the response is on the protocol."""


class _Table:
    """One listener's connections without a request in progress, longest idle first, and the
    refusals counted for the log."""

    def __init__(self) -> None:
        self.idle: dict[GuardedProtocol, None] = {}
        self.lingering: dict[GuardedProtocol, None] = {}  # refused, draining: the first to go
        self.refused: dict[str, int] = {}
        self._logged_at = 0.0

    def count(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._logged_at >= 10.0:  # a flood must not flood the log too
            self._logged_at = now
            log.warning("client connections cut by a limit so far: %s",
                        ", ".join(f"{k} {v}" for k, v in self.refused.items()))


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the caps and deadlines above; see :func:`guarded_protocol`."""

    limits = ConnectionLimits()
    table = _Table()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = _IDLE
        self._raw_head = 0  # bytes received since the head began (counted per read)
        self._head_bytes = 0  # request line and headers parsed so far (exact)
        self._header_count = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger: asyncio.TimerHandle | None = None
        self._over_limit = False  # accepted past max_connections: 503 once the head is in
        self._refusal: bytes | None = None

    # -- connection ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.table.idle[self] = None
        # uvicorn arms its keep-alive timer only after a response: a socket that never sends a
        # byte would stay open for ever.
        self.timeout_keep_alive_task = self.loop.call_later(self.limits.keep_alive_s, self.timeout_keep_alive_handler)
        if len(self.connections) > self.limits.max_connections:
            victim = next(iter(self.table.lingering), None) or next((c for c in self.table.idle if c is not self), None)
            if victim is not None:
                if victim._linger is None:
                    self.table.count("idle connection closed for a new one")
                victim._close()
            else:
                self._over_limit = True

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)

    def _forget(self) -> None:
        self._phase = _CLOSED
        self.table.idle.pop(self, None)
        self.table.lingering.pop(self, None)
        for timer in (self._head_timer, self._body_timer, self._linger):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._linger = None
        self._unset_keepalive_if_required()

    def _close(self) -> None:
        self._forget()
        self.transport.close()

    def _refuse(self, response: bytes, reason: str) -> None:
        """Answer ``response`` (a complete HTTP response), then close: at once if the transport
        cannot half-close, else once the client closes too or after ``LINGER_S``."""
        self.table.count(reason)
        self._forget()
        if self.transport.is_closing():
            return
        self.transport.write(response)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.table.lingering[self] = None
        self._linger = self.loop.call_later(LINGER_S, self._close)

    # -- bytes in ----------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._phase == _CLOSED:
            return
        self._unset_keepalive_if_required()
        counting = self._phase != _REQUEST
        if self._phase == _IDLE:
            self._phase = _HEAD
            self._raw_head = 0
            self._head_timer = self.loop.call_later(self.limits.head_timeout_s, self._head_timeout)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(self._refusal, "refused head")
                return
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
            return
        if counting and self._phase == _HEAD:
            self._raw_head += len(data)
            if self._raw_head > self.limits.max_head_bytes:
                self._refuse(self._too_large(), "head too large")

    def _too_large(self) -> bytes:
        return error_bytes(431, "request_header_too_large",
                           f"The request head is larger than {self.limits.max_head_bytes} bytes "
                           "(server.max_head_bytes).")

    def _stop(self, response: bytes) -> None:
        """From a parser callback: refuse with ``response`` once the parser has stopped."""
        self._refusal = response
        raise _Refused

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._header_count = 0
        if self._phase == _IDLE:  # pipelined after a complete request, in the same read
            self._phase = _HEAD

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        if self._head_bytes > self.limits.max_head_bytes:
            self._stop(self._too_large())
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        self._header_count += 1
        if self._head_bytes > self.limits.max_head_bytes:
            self._stop(self._too_large())
        if self._header_count > self.limits.max_headers:
            self._stop(error_bytes(431, "too_many_headers", f"The request has more than {self.limits.max_headers} "
                                   "header lines (server.max_headers)."))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._over_limit:
            self._stop(error_bytes(
                503, "too_many_connections",
                f"The gateway has {self.limits.max_connections} connections open (server.max_connections), "
                "each with a request in progress; retry later.", kind="server_error", retry_after=1))
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._phase = _REQUEST
        self.table.idle.pop(self, None)
        if self._body_timer is not None:  # a request pipelined behind one whose body is complete
            self._body_timer.cancel()
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s + 1.0, self._body_timeout)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if self._phase == _REQUEST and not pipelined and not self.transport.is_closing():
            self._phase = _IDLE
            self.table.idle[self] = None

    # -- deadlines ---------------------------------------------------------------------------------
    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._phase == _HEAD:
            self._refuse(error_bytes(408, "request_timeout", f"The request head did not arrive within "
                                     f"{self.limits.head_timeout_s:g} s (server.head_timeout_s)."), "head timeout")

    def _body_timeout(self) -> None:
        self._body_timer = None
        if self._phase != _REQUEST:
            return
        if self.cycle is None or not self.cycle.response_started:
            self._refuse(error_bytes(408, "request_timeout", f"The request body did not arrive within "
                                     f"{self.limits.body_timeout_s:g} s (server.body_timeout_s)."), "body timeout")
        else:  # answered (or answering) without the whole body: nothing more is read from it
            self.table.count("body timeout")
            self._close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedProtocol]:
    """A protocol class for one listener (``uvicorn.Config(http=...)``): its own limits and its
    own table of connections."""
    return type("GuardedProtocol", (GuardedProtocol,), {"limits": limits, "table": _Table()})
