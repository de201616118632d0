"""The lean upstream client against a real HTTP server on loopback: bodies, keep-alive, the stale
connection retry, closing mid-body, flow control, errors. Every test runs on asyncio's loop, and
again on uvloop (the gateway's) at the end of the file."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest
import uvloop

from passerelle.config import BackendConfig, TimeoutConfig
from passerelle.errors import UpstreamError
from passerelle.runtimes.kinds import make_backend
from passerelle.runtimes.supervisor import free_port
from passerelle.upstream.client import HIGH_WATER, ConnectFailed, ServerDisconnected, UpstreamClient
from tests.waiting import until


@dataclass
class Request:
    conn: int  # which connection it came on, from 1
    method: bytes
    path: bytes
    headers: dict[bytes, bytes]
    body: bytes


Handler = Callable[[Request, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Server:
    """A small HTTP/1.1 server: reads requests, lets the test's handler answer, counts connections
    opened and closed. A handler that closes the writer ends the connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.opened = 0
        self.closed = 0
        self.requests: list[Request] = []
        self._server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(5):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.opened += 1
        conn = self.opened
        try:
            while not writer.is_closing():
                head = await reader.readuntil(b"\r\n\r\n")
                line, *lines = head[:-4].split(b"\r\n")
                method, path, _ = line.split(b" ")
                headers = {k.strip().lower(): v.strip() for k, v in (x.split(b":", 1) for x in lines)}
                body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
                req = Request(conn, method, path, headers, body)
                self.requests.append(req)
                await self.handler(req, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            self.closed += 1


def ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), b"".join(h + b"\r\n" for h in extra), body)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def echo(req: Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(ok(b"%s %s %s" % (req.method, req.path, req.body), b"X-Conn: %d" % req.conn))
    await writer.drain()


async def get(client: UpstreamClient, path: str = "/x") -> tuple[int, bytes]:
    resp = await client.request(b"GET", path)
    try:
        return resp.status, await resp.read()
    finally:
        resp.close()


async def test_content_length_body_headers_and_request_line():
    async with Server(echo) as srv:
        client = UpstreamClient(srv.url + "/prefix", limit=4, headers={"Authorization": "Bearer k"})
        resp = await client.request(b"POST", "/v1/chat", b'{"a":1}', headers=b"X-Request-Id: r1\r\n")
        assert resp.status == 200
        assert resp.headers.get("content-type") == "text/plain" and resp.headers["X-CONN"] == "1"
        assert resp.headers.get("missing", "dflt") == "dflt"
        assert await resp.read() == b'POST /prefix/v1/chat {"a":1}'
        resp.close()
        req = srv.requests[0]
        assert req.headers[b"authorization"] == b"Bearer k" and req.headers[b"x-request-id"] == b"r1"
        assert req.headers[b"host"] == srv.url.removeprefix("http://").encode()
        client.close()


async def test_chunked_body_arrives_as_it_is_sent():
    step = asyncio.Event()

    async def handler(req, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"data: one\n\n"))
        await writer.drain()
        await step.wait()  # the second part only once the client has read the first
        writer.write(chunk(b"data: two\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=1)
        resp = await client.request(b"POST", "/s", b"{}")
        assert await resp.readany() == b"data: one\n\n"
        assert not resp.complete
        step.set()
        rest = b""
        while data := await resp.readany():
            rest += data
        assert rest == b"data: two\n\ndata: [DONE]\n\n" and resp.complete
        resp.close()
        assert client.idle_count == 1  # complete and keep-alive: back in the pool
        client.close()


async def test_keep_alive_reuses_one_connection():
    async with Server(echo) as srv:
        client = UpstreamClient(srv.url, limit=4)
        for i in range(5):
            assert await get(client, f"/{i}") == (200, b"GET /%d " % i)
        assert srv.opened == 1 and client.opened == 1
        assert {r.conn for r in srv.requests} == {1}
        client.close()


async def test_pool_limit_makes_requests_wait_for_a_connection():
    gate = asyncio.Event()

    async def handler(req, reader, writer):
        if req.path == b"/slow":
            await gate.wait()
        writer.write(ok(req.path))
        await writer.drain()

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=1)
        slow = asyncio.create_task(get(client, "/slow"))
        await until(lambda: len(srv.requests) == 1, what="the first request served")
        fast = asyncio.create_task(get(client, "/fast"))
        await until(lambda: client._waiters, what="the second request queued for the only connection")
        assert len(srv.requests) == 1 and srv.opened == 1
        gate.set()
        assert await slow == (200, b"/slow") and await fast == (200, b"/fast")
        assert srv.opened == 1 and [r.conn for r in srv.requests] == [1, 1]
        client.close()


async def test_stale_pooled_connection_is_retried_once_on_a_fresh_one():
    async def handler(req, reader, writer):
        if req.path == b"/second" and req.conn == 1:
            writer.close()  # what a runtime does to a keep-alive connection it timed out: no answer
            return
        writer.write(ok(b"conn %d" % req.conn))
        await writer.drain()

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=2)
        assert await get(client, "/first") == (200, b"conn 1")
        assert await get(client, "/second") == (200, b"conn 2")
        assert [(r.path, r.conn) for r in srv.requests] == [(b"/first", 1), (b"/second", 1), (b"/second", 2)]
        client.close()


async def test_no_retry_on_a_fresh_connection_nor_twice():
    async def handler(req, reader, writer):
        if req.path != b"/first":
            writer.close()
            return
        writer.write(ok(b""))
        await writer.drain()

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=2)
        with pytest.raises(ServerDisconnected) as info:
            await get(client, "/fresh")  # a fresh connection: the server may have seen it, no retry
        assert not info.value.got_bytes and len(srv.requests) == 1
        await get(client, "/first")
        with pytest.raises(ServerDisconnected):
            await get(client, "/again")  # pooled, then fresh: two tries, not more
        assert [r.path for r in srv.requests] == [b"/fresh", b"/first", b"/again", b"/again"]
        client.close()


async def test_close_mid_body_closes_the_socket_and_the_server_sees_it():
    left = asyncio.Event()

    async def handler(req, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n"))
        await writer.drain()
        if await reader.read(1) == b"":  # the client sends nothing more: this returns on its close
            left.set()
        writer.close()

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=2, keepalive_s=60)  # (no idle expiry closes it instead)
        resp = await client.request(b"POST", "/stream", b"{}")
        assert await resp.readany() == b"data: 1\n\n"
        resp.close()
        assert client.idle_count == 0
        async with asyncio.timeout(5):
            await left.wait()
        client.close()


async def test_cancelled_before_the_headers_closes_the_connection():
    async def handler(req, reader, writer):
        await reader.read(1)  # never answers; returns when the client hangs up

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=2)
        task = asyncio.create_task(client.request(b"POST", "/x", b"{}"))
        await until(lambda: len(srv.requests) == 1, what="the first request served")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: srv.closed == 1, what="the connection closed")
        client.close()


async def test_connection_close_is_honoured():
    async def handler(req, reader, writer):
        writer.write(ok(b"bye", b"Connection: close"))
        await writer.drain()
        await reader.read(1)  # until the client closes its side

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=2)
        assert await get(client) == (200, b"bye")
        assert client.idle_count == 0
        await until(lambda: srv.closed == 1, what="the connection closed")
        assert await get(client) == (200, b"bye")
        assert srv.opened == 2
        client.close()


async def test_a_second_response_in_the_same_segment_is_never_read_and_drops_the_connection():
    # A runtime that answers twice in one write: the second answer is nobody's, so the connection
    # cannot be trusted any more (whatever it says next would be taken for the next request's).
    async def handler(req, reader, writer):
        writer.write(ok(b"first") + ok(b"second, unasked") + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nthird")
        await writer.drain()

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=1)
        assert await get(client) == (200, b"first")
        assert client.idle_count == 0  # not back in the pool
        await until(lambda: srv.closed == 1, what="the connection closed")
        assert await get(client) == (200, b"first")  # on a fresh connection
        assert srv.opened == 2 and client.opened == 2
        client.close()


async def test_a_second_response_after_a_chunked_body_is_never_read():
    async def handler(req, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"one") + b"0\r\n\r\n"
                     + ok(b"two"))
        await writer.drain()

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=1)
        resp = await client.request(b"GET", "/x")
        got = []
        while data := await resp.readany():
            got.append(data)
        assert b"".join(got) == b"one" and resp.complete and not resp.keep_alive
        resp.close()
        assert client.idle_count == 0
        await until(lambda: srv.closed == 1, what="the connection closed")
        client.close()


async def test_body_that_ends_with_the_connection():
    async def handler(req, reader, writer):
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")
        await writer.drain()
        writer.close()

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=1)
        assert await get(client) == (200, b"until the end")
        assert client.idle_count == 0
        client.close()


async def test_truncated_body_raises_after_what_arrived():
    async def handler(req, reader, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=1)
        resp = await client.request(b"GET", "/x")
        got = b""
        with pytest.raises(ServerDisconnected) as info:
            while data := await resp.readany():
                got += data
        assert got == b"partial" and info.value.got_bytes
        resp.close()
        client.close()


async def test_idle_connections_expire():
    async with Server(echo) as srv:
        client = UpstreamClient(srv.url, limit=2, keepalive_s=0.05)
        await get(client)
        assert client.idle_count == 1
        await until(lambda: srv.closed == 1, what="the connection closed")  # closed by the client, not by the server
        assert client.idle_count == 0
        await get(client)
        assert srv.opened == 2
        client.close()


async def test_an_interim_100_continue_is_skipped():
    async def handler(req, reader, writer):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        writer.write(ok(b"final", b"X-Final: yes"))
        await writer.drain()

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=1)
        resp = await client.request(b"POST", "/x", b"{}")
        assert (resp.status, resp.headers.get("x-final"), await resp.read()) == (200, "yes", b"final")
        resp.close()
        assert await get(client) == (200, b"final") and srv.opened == 1
        client.close()


async def test_connect_refused_is_connect_failed_and_a_retryable_upstream_error():
    url = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    client = UpstreamClient(url, limit=1)
    with pytest.raises(ConnectFailed):
        await client.request(b"GET", "/")
    client.close()
    backend = make_backend(BackendConfig(name="b", kind="openai", url=url, models=("m",)), TimeoutConfig())
    await backend.start()
    with pytest.raises(UpstreamError) as info:
        await backend.post("/v1/chat/completions", b"{}", request_id="req_1")
    assert info.value.retryable and "not reachable" in info.value.message
    assert not await backend.check_health()
    await backend.close()


async def test_slow_consumer_pauses_the_socket_and_resumes_it():
    size, part = 32 << 20, b"x" * (16 << 10)  # far more than socket buffers hold
    sent = 0

    async def handler(req, reader, writer):
        nonlocal sent
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        while sent < size:
            writer.write(part)
            sent += len(part)
            await writer.drain()

    async with Server(handler) as srv:
        client = UpstreamClient(srv.url, limit=1)
        resp = await client.request(b"GET", "/big")
        conn = resp._conn
        # nobody reads: the buffer reaches the high-water mark
        await until(lambda: conn.paused, 10, "reading paused at the high-water mark")
        assert not conn.transport.is_reading()
        assert HIGH_WATER < resp._size <= HIGH_WATER + (1 << 20)  # bounded: no more reads once paused
        assert sent < size  # the server is held back, not the whole body buffered somewhere
        first = await resp.readany()
        assert conn.transport.is_reading() and not conn.paused
        total = len(first) + len(await resp.read())
        assert total == size and sent == size
        resp.close()
        assert client.idle_count == 1
        client.close()


async def test_backend_probes_share_the_pool_and_send_its_headers():
    async with Server(echo) as srv:
        backend = make_backend(BackendConfig(name="b", kind="openai", url=srv.url, models=("m",), api_key="k"),
                               TimeoutConfig())
        await backend.start()
        assert await backend.check_health()
        resp = await backend.post("/v1/chat/completions", b"{}", request_id="req_7")
        assert await resp.read() == b"POST /v1/chat/completions {}"
        resp.close()
        assert srv.opened == 1
        assert srv.requests[1].headers[b"x-request-id"] == b"req_7"
        assert all(r.headers[b"authorization"] == b"Bearer k" for r in srv.requests)
        await backend.close()


CASES = [f for name, f in sorted(globals().items()) if name.startswith("test_") and asyncio.iscoroutinefunction(f)]


@pytest.mark.parametrize("case", CASES, ids=[f.__name__.removeprefix("test_") for f in CASES])
def test_on_uvloop(case):
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(case())
