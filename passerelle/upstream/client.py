"""A lean HTTP/1.1 client for the runtimes behind the gateway: a keep-alive pool per runtime.

Every relayed token passes through it, so it does only what the gateway needs: one
``transport.write`` per request (head and body together), responses parsed by httptools as they
arrive (``http1.py``: Content-Length, chunked and close-delimited bodies, flow control). No
redirects (a 3xx is returned as it is, never followed), cookies, compression or proxies. A response
head is capped (``MAX_HEAD``, interim 1xx answers included) and :meth:`Response.read` takes a limit.

The pool holds at most ``limit`` connections, busy and idle; a request beyond that waits for one
to come back. Idle connections are reused most recent first and closed after ``keepalive_s``,
before the runtime's own keep-alive limit would close them under us (llama-server and uvicorn
close after 5 s). A request that still meets a pooled connection the runtime had closed, seen as
the connection ending before a single response byte, is sent once more on a fresh connection:
the runtime never read it.

Example::

    client = UpstreamClient("http://127.0.0.1:8081", limit=8, connect_timeout=5.0)
    resp = await client.request(b"POST", "/v1/chat/completions", body,
                                headers=b"Content-Type: application/json\\r\\n")
    try:
        while chunk := await resp.readany():
            ...
    finally:
        resp.close()  # back to the pool if complete, else the socket is closed
    client.close()
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from urllib.parse import urlsplit

from passerelle.upstream.http1 import (
    HIGH_WATER,
    MAX_HEAD,
    BadResponse,
    BodyTooLarge,
    ConnectFailed,
    Connection,
    Headers,
    HTTPClientError,
    Response,
    ServerDisconnected,
)

__all__ = ["HIGH_WATER", "MAX_HEAD", "BadResponse", "BodyTooLarge", "ConnectFailed", "HTTPClientError", "Headers",
           "Response", "ServerDisconnected", "UpstreamClient"]


class UpstreamClient:
    """Requests to one server (``base_url``: scheme, host, port and an optional path prefix)
    over a pool of at most ``limit`` keep-alive connections."""

    def __init__(self, base_url: str, *, limit: int, connect_timeout: float = 5.0, keepalive_s: float = 4.0,
                 headers: dict[str, str] | None = None) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"expected an http(s) URL, got {base_url!r}")
        self.host = url.hostname
        self.tls = url.scheme == "https"
        self.port = url.port or (443 if self.tls else 80)
        self.prefix = url.path.rstrip("/").encode()
        self.limit = max(1, limit)
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        default_port = self.port == (443 if self.tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        fixed = [f"Host: {host if default_port else f'{host}:{self.port}'}\r\n"]
        fixed += [f"{k}: {v}\r\n" for k, v in (headers or {}).items()]
        self._fixed_headers = "".join(fixed).encode("latin-1")
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self.tls else None
        self._idle: list[Connection] = []  # oldest first; reused from the end
        self._all: set[Connection] = set()
        self._count = 0  # connections open or opening, busy or idle
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False
        self.opened = 0  # connections ever opened (for tests and curiosity)

    async def request(self, method: bytes, path: str, body: bytes = b"", *, headers: bytes = b"") -> Response:
        """Send a request; return once the response's status and headers arrived.

        ``headers`` are extra header lines, each ending in ``\\r\\n``. Raises ConnectFailed,
        ServerDisconnected or BadResponse."""
        data = b"%s %s%s HTTP/1.1\r\n%s%sContent-Length: %d\r\n\r\n%s" % (
            method, self.prefix, path.encode(), self._fixed_headers, headers, len(body), body)
        conn, reused = await self._acquire(fresh=False)
        while True:
            try:
                resp = conn.send(data)
                await conn.headers_ready  # type: ignore[misc]
                return resp
            except ServerDisconnected as exc:
                conn.resp = None
                self.release(conn, reuse=False)
                if not reused or exc.got_bytes:
                    raise
            except BaseException:
                conn.resp = None
                self.release(conn, reuse=False)  # also on cancellation: the server sees the close
                raise
            # A pooled connection the server had already closed: it never read the request.
            conn, reused = await self._acquire(fresh=True)

    # -- the pool --------------------------------------------------------------------------
    async def _acquire(self, *, fresh: bool) -> tuple[Connection, bool]:
        loop = asyncio.get_running_loop()
        while True:
            if self._closed:
                raise ConnectFailed("the client is closed")
            idle = self._idle
            while idle and not fresh:
                conn = idle.pop()
                conn.idle = False
                if not conn.lost and not conn.transport.is_closing() and \
                        loop.time() - conn.idle_since < self.keepalive_s:
                    return conn, True
                self._discard(conn)
            if fresh and idle and self._count >= self.limit:
                self._discard(idle.pop(0))  # the oldest idle one makes room for a fresh one
            if self._count < self.limit:
                self._count += 1
                try:
                    return await self._connect(loop), False
                except BaseException:
                    self._count -= 1
                    self._wake_waiter()
                    raise
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._wake_waiter()  # it was our turn: pass it on
                raise

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> Connection:
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, loop), self.host, self.port, ssl=self._ssl,
                    server_hostname=self.host if self.tls else None)
        except TimeoutError:
            raise ConnectFailed(f"no connection to {self.host}:{self.port} within {self.connect_timeout:g} s",
                                timed_out=True) from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}") from exc
        self.opened += 1
        self._all.add(conn)
        return conn

    def release(self, conn: Connection, *, reuse: bool) -> None:
        """Return a busy connection: kept idle for the next request, or closed."""
        transport = conn.transport
        if reuse and not self._closed and not conn.lost and not transport.is_closing() \
                and transport.get_write_buffer_size() == 0:
            if conn.paused:
                conn.resume()
            conn.idle, conn.idle_since = True, conn.loop.time()
            self._idle.append(conn)
            if self._sweeper is None:
                self._sweeper = conn.loop.call_later(self.keepalive_s, self._sweep)
        else:
            self._count -= 1
            transport.close()
        self._wake_waiter()

    def lost(self, conn: Connection) -> None:
        """The connection closed; an idle one leaves the pool here (a busy one when released)."""
        self._all.discard(conn)
        if conn.idle:
            conn.idle = False
            self._idle.remove(conn)
            self._count -= 1
            self._wake_waiter()

    def _discard(self, conn: Connection) -> None:
        conn.idle = False
        self._count -= 1
        conn.transport.close()

    def _wake_waiter(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _sweep(self) -> None:
        self._sweeper = None
        idle = self._idle
        if not idle:
            return
        loop = idle[0].loop
        horizon = loop.time() - self.keepalive_s
        expired = 0
        while expired < len(idle) and idle[expired].idle_since <= horizon:
            expired += 1
        for conn in idle[:expired]:
            self._discard(conn)
        del idle[:expired]
        if idle:
            self._sweeper = loop.call_later(idle[0].idle_since - horizon, self._sweep)
        if expired:
            self._wake_waiter()

    @property
    def idle_count(self) -> int:
        return len(self._idle)

    def close(self, *, busy: bool = True) -> None:
        """Close the idle connections and, with ``busy``, those still in use too (otherwise each
        closes when its response does). Later requests fail with ConnectFailed."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._all):
            if busy or conn.idle:
                conn.transport.close()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
