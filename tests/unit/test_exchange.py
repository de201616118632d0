"""The exchange's hold on the client's connection: found under uvicorn's send, reset (not closed) when
the client stops reading, once."""

from __future__ import annotations

import asyncio
import socket
import struct

from passerelle.proxy.exchange import Exchange

SCOPE = {"type": "http", "headers": [], "client": ("127.0.0.1", 1)}


class Sock:
    def __init__(self) -> None:
        self.options: list[tuple[int, int, bytes]] = []
        self.closed = False

    def setsockopt(self, level: int, name: int, value: bytes) -> None:
        if self.closed:
            raise ValueError("negative file descriptor")  # what uvloop's pseudo-socket says then
        self.options.append((level, name, value))


class Transport:
    def __init__(self) -> None:
        self.sock = Sock()
        self.aborts = 0

    def get_extra_info(self, name: str):
        return self.sock if name == "socket" else None

    def abort(self) -> None:
        self.aborts += 1
        self.sock.closed = True


class Cycle:
    """Like uvicorn's RequestResponseCycle: ``send`` is its method, ``transport`` its attribute."""

    def __init__(self) -> None:
        self.transport = Transport()
        self.sent: list[dict] = []

    async def send(self, message: dict) -> None:
        self.sent.append(message)


async def test_a_cut_resets_the_connection_once_and_never_raises():
    cycle = Cycle()

    async def receive():
        await asyncio.Event().wait()

    ex = Exchange(SCOPE, receive, cycle.send, "chat")
    ex.cut()
    ex.cut()
    ex.close()  # the gateway's finally closes again: a second abort must not touch a closed socket
    t = cycle.transport
    assert ex.stalled and t.aborts == 1
    assert t.sock.options == [(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))]


async def test_the_connection_is_found_through_a_wrapper_that_names_what_it_wraps():
    cycle = Cycle()

    async def wrapper(message: dict) -> None:
        await cycle.send(message)

    wrapper.__wrapped__ = cycle.send  # type: ignore[attr-defined]  # what the CORS wrapper does

    async def receive():
        await asyncio.Event().wait()

    async def request() -> Exchange:
        ex = Exchange(SCOPE, receive, wrapper, "chat")
        await ex.send({"type": "http.response.start", "status": 200, "headers": []})
        assert ex.writing_since == 0.0 and cycle.sent
        ex.stall()  # cuts the connection and cancels the request's task
        await asyncio.sleep(1)
        raise AssertionError("not cancelled")

    task = asyncio.create_task(request())
    await asyncio.wait([task])
    assert task.cancelled() and cycle.transport.aborts == 1
