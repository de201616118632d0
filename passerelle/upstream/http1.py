"""One HTTP/1.1 exchange at a time on one connection: the protocol httptools drives, and the
:class:`Response` it fills as bytes arrive. The pool around it is in ``upstream.py``.

The body is buffered only up to a high-water mark: beyond it the socket stops being read until
the consumer catches up, so a slow client slows the runtime down instead of filling memory. The
response decides what happens to its connection when closed: back to the pool if the body is
complete and the server keeps the connection, otherwise closed, which is how a runtime learns
that nobody listens any more. A byte after the end of a response (a second response nobody asked
for, even one in the same segment as the first) is never read: the connection is closed, never reused.

Example (what :meth:`UpstreamClient.request <passerelle.upstream.client.UpstreamClient.request>` does)::

    _, conn = await loop.create_connection(lambda: Connection(pool, loop), host, port)
    resp = conn.send(b"GET /health HTTP/1.1\\r\\nHost: h\\r\\nContent-Length: 0\\r\\n\\r\\n")
    await conn.headers_ready         # resp.status, resp.headers
    body = await resp.read()
    resp.close()                     # pool.release(conn, reuse=...)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import httptools

# Pause reading the socket when this much body is buffered and unread; resume once it was read.
HIGH_WATER = 1 << 16
# The most a response head may take, interim answers (100 Continue) included: past it the response
# is refused, so a runtime sending an endless header line or endless 100s cannot grow memory.
MAX_HEAD = 1 << 16


class Pool(Protocol):
    """What a connection tells its pool."""

    def release(self, conn: Connection, *, reuse: bool) -> None: ...

    def lost(self, conn: Connection) -> None: ...


class HTTPClientError(Exception):
    """An exchange with an upstream server that failed below HTTP (no usable response)."""


class ConnectFailed(HTTPClientError):
    """No connection could be opened (refused, unreachable, name not found, connect timeout)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out  # the connect timeout passed (rather than a refusal)


class ServerDisconnected(HTTPClientError):
    """The connection ended before the response was complete."""

    def __init__(self, message: str, *, got_bytes: bool = False) -> None:
        super().__init__(message)
        self.got_bytes = got_bytes  # any byte of the response had arrived


class BadResponse(HTTPClientError):
    """The server's bytes are not an HTTP/1.x response (or its head is larger than ``MAX_HEAD``)."""


class BodyTooLarge(HTTPClientError):
    """The body is larger than the limit the reader gave (:meth:`Response.read`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the response body is larger than {limit} bytes")
        self.limit = limit


class Headers:
    """Response headers, looked up case-insensitively: ``headers.get("Content-Type", "")``."""

    __slots__ = ("_map",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        out: dict[str, str] = {}
        for name, value in raw:
            key, text = name.decode("latin-1").lower(), value.decode("latin-1")
            out[key] = f"{out[key]}, {text}" if key in out else text
        self._map = out

    def get(self, name: str, default: Any = None) -> Any:
        return self._map.get(name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return self._map[name.lower()]

    def __repr__(self) -> str:
        return f"Headers({self._map!r})"


class Response:
    """One response: status and headers once they arrived, the body as it arrives.

    Read with :meth:`readany` (whatever has arrived, ``b""`` at the end) or :meth:`read` (all of
    it), and always :meth:`close` it.
    """

    __slots__ = ("_chunks", "_closed", "_conn", "_done", "_exc", "_headers", "_raw_headers", "_size",
                 "_waiter", "keep_alive", "sink", "status")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.status = 0
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: Headers | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._done = False  # the whole body has arrived
        self._exc: HTTPClientError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self.keep_alive = False
        # While a reader waits in :meth:`sink_into`: called with this response as body bytes arrive.
        self.sink: Callable[[Response], bool] | None = None

    @property
    def headers(self) -> Headers:
        if self._headers is None:
            self._headers = Headers(self._raw_headers)
        return self._headers

    def header(self, name: bytes) -> bytes | None:
        """One header's raw value (``name`` in lower case), without building :attr:`headers`."""
        for key, value in self._raw_headers:
            if key.lower() == name:
                return value
        return None

    @property
    def complete(self) -> bool:
        """Has the whole body arrived (read or not)?"""
        return self._done

    async def readany(self) -> bytes:
        """What arrived since the last read, waiting for some; ``b""`` once the body is over.

        Raises ServerDisconnected or BadResponse when the body cannot be completed (after the
        bytes that did arrive were returned)."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._size = 0
                if self._conn.paused:
                    self._conn.resume()
                return data
            if self._exc is not None:
                raise self._exc
            if self._done or self._closed:
                return b""
            waiter = self._waiter = self._conn.loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def take(self) -> bytes:
        """What arrived since the last read, without waiting (``b""``: nothing)."""
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        if self._conn.paused:
            self._conn.resume()
        return data

    def sink_into(self, sink: Callable[[Response], bool]) -> asyncio.Future[None] | None:
        """Have the body's bytes handled by ``sink`` in the connection's own callback, as they are
        parsed, instead of by a reader's task woken for each read (a stream's relay: no task
        switch per chunk). ``sink(resp)`` takes them with :meth:`take` and returns True, or
        returns False to hand over: it has left them or met something its reader must handle.
        Returns the future that is set when the reader is needed (the sink handed over, the body
        ended or failed, the response was closed); the reader then calls :meth:`unsink` and reads
        as usual. None, without a sink: there is something to read now."""
        if self._chunks or self._exc is not None or self._done or self._closed or self._waiter is not None:
            return None
        self.sink = sink
        waiter = self._waiter = self._conn.loop.create_future()
        return waiter

    def unsink(self) -> None:
        """End :meth:`sink_into`: bytes wait for :meth:`readany` again."""
        self.sink = None
        self._waiter = None

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; with ``limit``, BodyTooLarge as soon as it is known to be larger (the
        declared Content-Length, or the bytes read so far), having held at most about that much."""
        if limit is not None:
            declared = self.headers.get("content-length")
            if declared is not None and declared.strip().isdigit() and int(declared) > limit:
                raise BodyTooLarge(limit)
        parts = []
        size = 0
        while data := await self.readany():
            size += len(data)
            if limit is not None and size > limit:
                raise BodyTooLarge(limit)
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        """Give the connection back: to the pool when the body is complete and the server
        keeps the connection, otherwise closed (which tells the server that nobody listens)."""
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        conn.resp = None
        conn.pool.release(conn, reuse=self._done and self.keep_alive and self._exc is None)
        self._wake()  # a reader waiting in another task gets b"": closed (a suspended stream)

    # -- fed by the connection -------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: HTTPClientError) -> None:
        if not self._done and self._exc is None:
            self._exc = exc
        self._wake()


class _Unsolicited(Exception):
    """Raised inside the parser to stop it at a response nobody asked for."""


class _ClosedParser:
    """Stands in for the parser of a connection that is gone (no cycle, and a late call is harmless)."""

    def feed_data(self, data: bytes) -> None:
        raise httptools.HttpParserError("the connection is closed")

    def get_status_code(self) -> int:
        return 0

    def should_keep_alive(self) -> bool:
        return False


_CLOSED_PARSER = _ClosedParser()


class Connection(asyncio.Protocol):
    """One keep-alive connection; the httptools parser calls back into it."""

    __slots__ = ("got_bytes", "head_bytes", "headers_ready", "idle", "idle_since", "interim", "loop", "lost",
                 "parser", "paused", "pool", "resp", "transport")

    def __init__(self, pool: Pool, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.parser: httptools.HttpResponseParser | _ClosedParser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set before any use
        self.resp: Response | None = None  # the response being received or read
        self.headers_ready: asyncio.Future[None] | None = None
        self.got_bytes = False  # of the current response
        self.head_bytes = 0  # received for the current response while its head was incomplete
        self.interim = False  # parsing a 1xx answer
        self.paused = False
        self.lost = False
        self.idle = False  # in the pool's idle list
        self.idle_since = 0.0

    def send(self, data: bytes) -> Response:
        """Write one request; the response fills in as it arrives."""
        resp = self.resp = Response(self)
        self.headers_ready = self.loop.create_future()
        self.got_bytes = self.interim = False
        self.head_bytes = 0
        self.transport.write(data)
        return resp

    def resume(self) -> None:
        self.paused = False
        if not self.lost:
            self.transport.resume_reading()

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or resp._done:  # bytes nobody asked for: the connection cannot be trusted
            self.transport.close()
            return
        self.got_bytes = True
        heading = not resp.status
        if heading:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not resp._done:  # (else: bytes after the complete response, see on_message_begin)
                self._broken(BadResponse(f"invalid HTTP response: {exc}"))
            self.transport.close()
            resp._wake()
            return
        if heading and not resp.status and self.head_bytes > MAX_HEAD:
            self._broken(BadResponse(f"the response head is larger than {MAX_HEAD} bytes"))
            self.transport.close()
            return
        sink = resp.sink
        if sink is not None and resp._chunks and sink(resp) and not resp._done:
            return  # taken in this callback: no reader to wake
        if resp._size > HIGH_WATER and not self.paused and not resp._done:
            self.paused = True
            self.transport.pause_reading()
        resp._wake()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        # The parser holds this protocol's callbacks and this protocol the parser: a reference cycle
        # that would keep every closed connection (and its transport) for the cyclic collector.
        self.parser = _CLOSED_PARSER
        self.pool.lost(self)
        resp = self.resp
        if resp is None or resp._done:
            return
        if exc is None and resp.status and self._ends_at_eof(resp):
            resp._done = True  # a body without length or chunks ends with the connection
            resp._wake()
            return
        reason = f" ({exc.__class__.__name__}: {exc})" if exc is not None else ""
        self._broken(ServerDisconnected(f"the server closed the connection before the response was complete{reason}",
                                        got_bytes=self.got_bytes))

    def _broken(self, exc: HTTPClientError) -> None:
        ready = self.headers_ready
        if ready is not None and not ready.done():
            ready.set_exception(exc)
        if self.resp is not None:
            self.resp._fail(exc)

    @staticmethod
    def _ends_at_eof(resp: Response) -> bool:
        names = {name.lower() for name, _ in resp._raw_headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    # -- httptools callbacks -----------------------------------------------------------------
    def on_message_begin(self) -> None:
        resp = self.resp
        if resp is not None and resp._done:
            # A second response in the bytes of the first (a segment carries both): nobody asked
            # for it, and what the connection says next cannot be matched to a request. It is
            # never read, and the connection never reused (data_received closes it).
            resp.keep_alive = False
            raise _Unsolicited

    def on_header(self, name: bytes, value: bytes) -> None:
        self.resp._raw_headers.append((name, value))  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue): the real one follows
            self.interim = True
            self.resp._raw_headers.clear()  # type: ignore[union-attr]
            return
        self.resp.status = status  # type: ignore[union-attr]
        ready = self.headers_ready
        if ready is not None and not ready.done():
            ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        resp._chunks.append(body)  # type: ignore[union-attr]
        resp._size += len(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        resp = self.resp
        resp._done = True  # type: ignore[union-attr]
        resp.keep_alive = self.parser.should_keep_alive()  # type: ignore[union-attr]
