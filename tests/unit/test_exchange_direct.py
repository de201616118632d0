"""Exchange.write_now under the real server: uvicorn's response is recognised, a part written
directly arrives in the chunked framing uvicorn's own send gives, between the parts it sends, and
a HEAD request or a response with a length never takes the direct path."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import httptools
import uvicorn

from passerelle.proxy.exchange import Exchange, StreamGate
from tests.waiting import until

SSE = [(b"content-type", b"text/event-stream")]


class Body:
    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.done = False
        self.head = False

    def on_headers_complete(self) -> None:
        self.head = True

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        self.done = True


async def serve(app: Any) -> tuple[uvicorn.Server, int, asyncio.Task[None]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, http="httptools", lifespan="off", log_level="warning"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    await until(lambda: server.started, what="uvicorn started")
    return server, port, task


async def fetch(port: int, method: str) -> tuple[bytes, Body]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} /s HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    body = Body()
    parser = httptools.HttpResponseParser(body)
    raw = b""
    async with asyncio.timeout(5):
        while not body.done and not (method == "HEAD" and body.head):
            data = await reader.read(65536)
            if not data:
                break
            raw += data
            parser.feed_data(data)
    writer.close()
    return raw, body


async def test_write_now_goes_straight_to_uvicorns_connection_in_its_framing():
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        ex = Exchange(scope, receive, StreamGate(send), "chat")
        seen["before"] = ex.writable()  # (no head yet: nothing may be written directly)
        await ex.start(200, SSE)
        seen["after"] = ex.writable()
        if ex.writable():
            ex.write_now(b"data: one\n\n")
        await ex.send_body(b"data: two\n\n", more=True)  # the send path, between direct parts
        if ex.writable():
            ex.write_now(b"data: three\n\n")
        ex.mark_finishing()
        await ex.send_body(b"data: [DONE]\n\n", more=False)
        ex.close()

    server, port, task = await serve(app)
    try:
        raw, body = await fetch(port, "GET")
        assert seen == {"before": False, "after": True}
        assert b"transfer-encoding: chunked" in raw.lower()
        assert body.parts == [b"data: one\n\n", b"data: two\n\n", b"data: three\n\n", b"data: [DONE]\n\n"]
        assert raw.endswith(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")  # the last part and the end in one framing

        async def head_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            ex = Exchange(scope, receive, send, "chat")
            await ex.start(200, SSE if scope["method"] == "HEAD" else [*SSE, (b"content-length", b"3")])
            seen["head" if scope["method"] == "HEAD" else "sized"] = ex.writable()
            await ex.send_body(b"" if scope["method"] == "HEAD" else b"abc", more=False)

        server.config.app = server.config.loaded_app = head_app
        await fetch(port, "HEAD")
        await fetch(port, "GET")
        assert seen["head"] is False and seen["sized"] is False  # only a chunked body is written directly
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


async def test_a_hang_up_under_uvicorn_cancels_the_request_at_once_without_a_task_of_its_own():
    """On uvicorn's connection the exchange learns of a hang-up from the connection's own notice:
    the request's task is cancelled (``disconnected``, ``take_cancel``), no watcher task is made,
    and an answer that was on its last bytes is not a disconnect."""
    seen: dict[str, Any] = {}
    streaming = asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        ex = Exchange(scope, receive, StreamGate(send), "chat")
        before = len(asyncio.all_tasks())
        ex.watch()
        seen["tasks_made"] = len(asyncio.all_tasks()) - before
        try:
            if "hangup" in seen:  # (the second request: answered whole)
                await ex.start(200, SSE)
                ex.mark_finishing()
                await ex.send_body(b"data: [DONE]\n\n", more=False)  # (the response complete: no disconnect)
                await asyncio.sleep(0)
                seen["done"] = ex.disconnected
                return
            await ex.start(200, SSE)
            streaming.set()
            await asyncio.sleep(30)  # (a stream waiting on its runtime: the hang-up ends it)
            seen["hangup"] = "not cancelled"
        except asyncio.CancelledError:
            seen["hangup"] = (ex.disconnected, ex.take_cancel())
        finally:
            ex.close()

    server, port, task = await serve(app)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /s HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(streaming.wait(), 5)
        writer.close()
        await until(lambda: "hangup" in seen, what="the request ended by the hang-up")
        assert seen["hangup"] == (True, True)
        assert seen["tasks_made"] == 0
        _, body = await fetch(port, "GET")
        assert body.parts == [b"data: [DONE]\n\n"]
        await until(lambda: "done" in seen, what="the finished request")  # (a cancel would skip it)
        assert seen["done"] is False and seen["tasks_made"] == 0
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


class CountingTransport:
    """uvicorn's transport, its writes counted."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


async def test_the_head_and_the_first_part_go_out_in_one_write():
    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        ex = Exchange(scope, receive, StreamGate(send), "chat")
        cycle = send.__self__
        cycle.transport = counting = CountingTransport(cycle.transport)
        await ex.start_with(200, SSE, b"data: one\n\n")
        seen["writes"], seen["writable"] = counting.writes, ex.writable()
        if ex.writable():  # (the direct path still works after it; a HEAD has no body to write)
            ex.write_now(b"data: two\n\n")
        ex.mark_finishing()
        await ex.send_body(b"data: [DONE]\n\n", more=False)
        ex.close()

    server, port, task = await serve(app)
    try:
        raw, body = await fetch(port, "GET")
        assert seen == {"writes": 1, "writable": True}
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-request-id: " in raw.lower()
        assert body.parts == [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
        raw, body = await fetch(port, "HEAD")  # a HEAD: the head alone, as uvicorn's send gives it
        assert body.parts == [] and raw.endswith(b"\r\n\r\n")
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
