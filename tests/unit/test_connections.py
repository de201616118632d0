"""The client connection guards (server/connections.py) on a real uvicorn server in this event
loop: real sockets, raw bytes, small limits so that every deadline passes in a fraction of a second."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tracemalloc
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import uvicorn

from passerelle.server.connections import ConnectionLimits, guarded_protocol
from tests.waiting import until

LIMITS = ConnectionLimits(max_head_bytes=4096, max_headers=16, head_timeout_s=0.3, body_timeout_s=0.3,
                          keep_alive_s=0.3, max_connections=3)


class EchoApp:
    """Answers the body it read, or (path /noread) answers at once without reading it, or
    (path /hold) waits until ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.requests = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.requests += 1
        body = b""
        if scope["path"] == "/hold":
            await self.release.wait()
        elif scope["path"] != "/noread":
            while True:
                msg = await receive()
                body += msg.get("body", b"")
                if not msg.get("more_body"):
                    break
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serve(limits: ConnectionLimits = LIMITS) -> AsyncIterator[tuple[int, EchoApp, Any]]:
    app = EchoApp()
    protocol = guarded_protocol(limits)
    config = uvicorn.Config(app, http=protocol, lifespan="off", log_config=None, log_level="critical",
                            timeout_keep_alive=limits.keep_alive_s)  # type: ignore[arg-type]
    server = uvicorn.Server(config)
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await until(lambda: server.started or task.done(), 10, "the server started")
    assert not task.done(), task
    try:
        yield sock.getsockname()[1], app, protocol
    finally:
        app.release.set()
        for w in _writers:
            w.close()
            with contextlib.suppress(ConnectionError):
                await w.wait_closed()
        _writers.clear()
        server.should_exit = True
        await task


_writers: list[asyncio.StreamWriter] = []


async def open_(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    _writers.append(writer)
    return reader, writer


async def read_until_closed(reader: asyncio.StreamReader, timeout: float = 3.0) -> bytes:
    """Everything until the server closes (a reset counts); fails the test when it does not within
    ``timeout``."""
    out = b""
    async with asyncio.timeout(timeout):
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                out += chunk
    return out


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def request(path: str = "/", body: bytes = b"", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


async def test_requests_and_keep_alive_work_as_before():
    async with serve() as (port, app, _):
        reader, writer = await open_(port)
        for i in range(3):
            writer.write(request(body=b"hello %d" % i))
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(7) == b"hello %d" % i
        writer.close()
        assert app.requests == 3


@pytest.mark.parametrize("shape", ["one big header", "many headers", "a long URL"])
async def test_a_head_past_the_caps_gets_431_and_the_connection_closes(shape):
    async with serve() as (port, app, protocol):
        reader, writer = await open_(port)
        if shape == "one big header":
            writer.write(request(extra=f"X-Big: {'a' * 8000}\r\n"))
            code = "request_header_too_large"
        elif shape == "many headers":
            writer.write(request(extra="".join(f"X-H{i}: v\r\n" for i in range(20))))
            code = "too_many_headers"
        else:
            writer.write(request(path="/" + "p" * 5000))
            code = "request_header_too_large"
        status, headers, body = parse(await read_until_closed(reader))
        assert status == 431 and orjson.loads(body)["error"]["code"] == code
        assert headers["connection"] == "close" and headers["x-request-id"].startswith("req_")
        assert app.requests == 0 and sum(protocol.table.refused.values()) == 1


async def test_a_header_line_that_never_ends_is_cut_at_the_cap_not_buffered():
    async with serve() as (port, _, _):
        reader, writer = await open_(port)
        writer.write(b"GET / HTTP/1.1\r\nX-Big: ")
        chunk, sent = b"a" * 16384, 0
        tracemalloc.start()
        try:
            with contextlib.suppress(ConnectionError):
                while sent < 4 * 1024 * 1024 and not reader._buffer:  # type: ignore[attr-defined]  # no answer yet
                    writer.write(chunk)
                    sent += len(chunk)
                    await writer.drain()
                    await asyncio.sleep(0)  # the server runs in this loop too
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        status, _, _ = parse(await read_until_closed(reader))
        # refused while the line was still coming, and never held: the whole process (server and
        # client) allocated less than a few socket reads meanwhile
        assert status == 431 and sent >= 16384 and peak < 768 * 1024, (sent, peak)


async def test_a_head_that_does_not_finish_in_time_gets_408():
    async with serve() as (port, app, _):
        reader, writer = await open_(port)
        writer.write(b"POST / HTTP/1.1\r\nHost: t\r\n")
        loop = asyncio.get_running_loop()
        start = loop.time()
        for _ in range(3):  # slowloris: a byte now and then does not extend the deadline
            await asyncio.sleep(0.1)
            writer.write(b"X")
        status, _, body = parse(await read_until_closed(reader))
        assert status == 408 and orjson.loads(body)["error"]["code"] == "request_timeout"
        assert 0.25 < loop.time() - start < 2.0 and app.requests == 0


async def test_a_connection_that_never_sends_a_byte_is_closed_after_keep_alive_s():
    async with serve() as (port, _, _):
        reader, _ = await open_(port)
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await read_until_closed(reader) == b""
        assert 0.25 < loop.time() - start < 2.0


async def test_an_unread_body_still_trickling_after_the_answer_is_cut_at_the_body_deadline():
    async with serve() as (port, _, _):
        reader, writer = await open_(port)
        writer.write(b"POST /noread HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\nsome")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        loop = asyncio.get_running_loop()
        start = loop.time()
        with contextlib.suppress(ConnectionError):
            for _ in range(30):  # keeps trickling: the connection is closed anyway
                writer.write(b"x")
                await asyncio.sleep(0.05)
                if reader.at_eof():
                    break
        await read_until_closed(reader)
        assert loop.time() - start < 2.5  # body_timeout_s + 1 s, with room for a busy machine


async def test_past_max_connections_the_longest_idle_connection_makes_room():
    async with serve(ConnectionLimits(**{**LIMITS.__dict__, "keep_alive_s": 30.0})) as (port, _, protocol):
        idle = [await open_(port) for _ in range(3)]
        # the server has accepted them all
        await until(lambda: len(protocol.table.idle) >= 3, 3, "the server to accept the three connections")
        reader, writer = await open_(port)  # the fourth: the oldest idle one is closed for it
        assert await read_until_closed(idle[0][0]) == b""
        writer.write(request(body=b"ok"))
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and await reader.readexactly(2) == b"ok"
        for r, w in idle[1:]:
            assert not r.at_eof()
            w.close()
        writer.close()


async def test_past_max_connections_with_every_one_busy_the_new_one_gets_503():
    async with serve() as (port, app, _):
        busy = [await open_(port) for _ in range(3)]
        for _, w in busy:
            w.write(request("/hold"))
        await until(lambda: app.requests >= 3, 3, "the three requests held")
        reader, writer = await open_(port)
        writer.write(request(body=b"x"))
        status, headers, body = parse(await read_until_closed(reader))
        assert status == 503 and headers["retry-after"] == "1"
        assert orjson.loads(body)["error"]["code"] == "too_many_connections"
        app.release.set()
        for r, _ in busy:  # the busy ones were served
            assert (await r.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
