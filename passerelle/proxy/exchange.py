"""One request/response cycle between a client and the gateway, and everything it has said so far.

The gateway's code for one request reads top to bottom because the state that several steps share
lives here, on one object, rather than in closures and ``nonlocal`` flags:

* ``started``: the response head went out; from now on an error can only be an SSE error event;
* ``finishing``: the last bytes are on their way; a hang-up now is the client being done, not a
  disconnect (uvicorn answers ``receive()`` with ``http.disconnect`` once the response is
  complete, and the openai SDK closes the connection as soon as it has read ``[DONE]``);
* ``disconnected``: the client left; the request's task was cancelled because of it;
* ``stalled``: the client took no byte for ``client_write_s`` while the gateway had some to send;
  its connection was cut and the request's task cancelled (cause ``client_timeout``). Every write
  goes through :meth:`Exchange.send`, which notes since when it waits, and the gateway's watchdog
  (one timer for all requests, not one per write) calls :meth:`Exchange.stall`.

Race worth knowing: the client's hang-up (uvicorn's lost-connection notice, or elsewhere a watcher
task waiting on ASGI ``receive()`` for ``http.disconnect``) cancels the request's task. The
request task tells a disconnect-cancel from any other cancellation with ``take_cancel()``, and
``uncancel()``s only the former.

Example::

    ex = Exchange(scope, receive, send, "chat")
    ex.watch()                      # after the body was read
    await ex.start(200, headers)    # once, with the first bytes
    ex.mark_finishing()
    await ex.send_body(b"...", more=False)
    ex.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from passerelle.errors import GatewayError
from passerelle.observe.record import RequestRecord, new_request_id
from passerelle.proxy import grammars
from passerelle.proxy.protocols import OPENAI, error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


# What write_now reads of uvicorn's response (its httptools protocol's, uvicorn 0.54): a uvicorn
# without one of them gets every write through its send, as before.
_CYCLE_STATE = ("flow", "disconnected", "response_complete", "transport", "chunked_encoding", "scope")
_HANGUP_STATE = ("message_event", "disconnected", "response_complete")


def header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v).decode("latin-1")
    return None


def _transport_of(send: Send) -> Any:
    """The connection under an ASGI ``send``, where the server lets it be found (uvicorn's send is
    a method of its per-request cycle, which keeps the transport; a wrapper names what it wraps in
    ``__wrapped__``); None elsewhere."""
    fn: Any = send
    for _ in range(8):
        transport = getattr(getattr(fn, "__self__", None), "transport", None)
        if transport is not None:
            return transport
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    return None


def _cycle_of(send: Send) -> Any:
    """uvicorn's request/response cycle under an ASGI ``send`` (its send is the cycle's method; a
    wrapper names what it wraps in ``__wrapped__``), when it has what :class:`_HangUp` reads; None
    elsewhere (another server, a request the gateway makes itself)."""
    fn: Any = send
    for _ in range(8):
        cycle = getattr(fn, "__self__", None)
        if type(cycle) is RequestResponseCycle:
            return cycle if all(hasattr(cycle, a) for a in _HANGUP_STATE) else None
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    return None


class _HangUp(asyncio.Event):
    """uvicorn's per-request event, put in place once the body is read. uvicorn's connection sets
    it when the connection is lost (``disconnected``) and when the response is complete; from then
    on ``receive()`` answers ``http.disconnect``. Being set, it tells the exchange at once (once):
    what a task waiting on ``receive()`` learns, without a task per request."""

    def __init__(self, cycle: Any, exchange: Exchange) -> None:
        super().__init__()
        self.cycle = cycle
        self.exchange: Exchange | None = exchange

    def set(self) -> None:
        super().set()
        ex = self.exchange
        if ex is not None and (self.cycle.disconnected or self.cycle.response_complete):
            self.exchange = None
            ex._hung_up()


class _HeldWrites:
    """Stands in for uvicorn's transport while its send builds a response head, which is then
    written with what follows it (:meth:`Exchange.start_with`)."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.parts.append(data)


class StreamGate:
    """An ASGI ``send`` that can be closed: once ``closed``, what the app sends is dropped, and
    only the shutdown path writes (through ``raw``: server/shutdown.py). An exchange given one
    checks ``closed`` itself and writes through ``raw`` (a coroutine less on every write)."""

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


class Exchange:
    __slots__ = ("_aborted", "_asgi_send", "_cancel_pending", "_cancelled", "_cycle", "_gate", "_loop", "_watcher",
                 "disconnected", "errors", "finishing", "grammar", "held", "rec", "receive", "scope", "stalled",
                 "started", "task", "warnings", "writing_since")

    def __init__(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        client = scope.get("client")
        self.scope, self.receive, self._asgi_send = scope, receive, send
        self._gate = send if type(send) is StreamGate else None
        self.rec = RequestRecord(id=new_request_id(), endpoint=endpoint, client=client[0] if client else "")
        self.started = False
        self.finishing = False
        self.disconnected = False
        self.stalled = False  # the client took no byte for too long; its connection is cut
        self.warnings: list[str] = []  # sent as X-Passerelle-Warning headers (a request served otherwise than asked)
        self.held: Any = None  # an answer being assembled: its share of the gateway's budget (answer.AnswerShare)
        self._cancelled = False  # this exchange cancelled its task (once at most: see ``_cancel``)
        self._cancel_pending = False  # ... and the request's task has not caught it yet
        self._aborted = False  # the client's connection was dropped
        self.writing_since = 0.0  # loop time a write to the client began and has not returned; 0: none
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self._loop = task.get_loop()
        self._watcher: asyncio.Task[None] | _HangUp | None = None
        self._cycle: Any = None  # uvicorn's response, once its head is out with chunks to follow (write_now)
        # the API's error shape (protocols.py) and stream grammar (grammars.py), for report()
        self.errors = OPENAI
        self.grammar = "chat"

    def header(self, name: bytes) -> str | None:
        return header(self.scope, name)

    # -- the client leaving, or not reading --------------------------------------------------
    def watch(self) -> None:
        """From now on, a client that hangs up cancels this request (the body must be read first:
        the watcher takes over ``receive``). On uvicorn's own connection, its lost-connection
        notice tells the exchange at once (:class:`_HangUp`), with no task per request; elsewhere a
        watcher task waits on ``receive()``."""
        cycle = _cycle_of(self._asgi_send)
        if cycle is not None:
            event = _HangUp(cycle, self)
            self._watcher = event
            cycle.message_event = event
            if cycle.disconnected or cycle.response_complete:  # (lost before the notice was in place)
                event.set()
            return
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                self._hung_up()
                return

    def _hung_up(self) -> None:
        """The client's connection ended (or its response did): a disconnect, unless the answer was
        on its last bytes or the gateway cut the client itself."""
        if not self.finishing and not self.stalled:
            self.disconnected = True
            self._cancel()

    def _cancel(self) -> None:
        # One cancel per exchange, so that one uncancel() in the gateway balances it (a leftover
        # cancel request would turn the task's later timeouts into cancellations). After it, a
        # client stuck again is released by abort() alone.
        if not self._cancelled:
            self._cancelled = self._cancel_pending = True
            self.task.cancel()

    def end_now(self) -> None:
        """End this request's task the way a client's hang-up does (its slot and key are given back,
        its line written), e.g. at shutdown; the cause is the caller's to record first."""
        self.disconnected = True
        self._cancel()

    @property
    def asgi_send(self) -> Send:
        """The server's own send, under the watched one (for a shutdown that must write past it)."""
        return self._asgi_send

    def take_cancel(self) -> bool:
        """For the request's task, catching a CancelledError: was it this exchange's cancel (the
        client left or stopped reading)? True once; any other cancellation must propagate."""
        if self._cancel_pending:
            self._cancel_pending = False
            return True
        return False

    def stall(self) -> None:
        """The client has not taken a byte for too long (the gateway's watchdog calls this): cut
        its connection, which frees what was waiting to be written, and end the request."""
        if self.stalled or self.disconnected:
            return
        self.cut()
        self._cancel()

    def cut(self) -> None:
        """Mark the client as not reading and drop its connection (no cancel: for a caller that
        found out by itself, e.g. the relay's deadline passing while a write waited)."""
        self.stalled = True
        self.abort()

    def abort(self) -> None:
        """Drop the client's connection at once, unsent bytes and all: a reset (SO_LINGER 0), since
        even an abort's close would leave the kernel holding the queued bytes (megabytes, for a
        while) for a client that does not read, and that client would never learn it was cut."""
        if self._aborted:
            return
        self._aborted = True
        transport = _transport_of(self._asgi_send)
        if transport is None:
            return
        sock = transport.get_extra_info("socket") if hasattr(transport, "get_extra_info") else None
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):  # (ValueError: uvloop, a socket already closed)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()  # (also when closing: a graceful close may still be flushing)

    def unsent(self) -> int:
        """Bytes the client's connection still holds in the gateway, written but not yet handed to
        the kernel (0 where the server does not say): a complete answer to a client that does not
        read stays there, and its connection cannot close until they leave."""
        transport = _transport_of(self._asgi_send)
        size = getattr(transport, "get_write_buffer_size", None)
        return int(size()) if size is not None else 0

    def close(self) -> None:
        watcher = self._watcher
        if isinstance(watcher, _HangUp):
            watcher.exchange = None  # (the connection keeps its event until its next request)
            self._watcher = None
        elif watcher is not None:
            watcher.cancel()
            # Forget it: the cancelled task keeps its frames (and through them this exchange) in its
            # CancelledError's traceback, a reference cycle per request left to the cyclic collector.
            self._watcher = None
        if self.stalled:
            self.abort()

    # -- what the client is sent ---------------------------------------------------------------
    async def send(self, message: dict[str, Any]) -> None:
        """The ASGI send, watched: while it waits for the client to take bytes, ``writing_since``
        says since when (the gateway's watchdog cuts a client stuck past ``client_write_s``)."""
        self.writing_since = self._loop.time()
        gate = self._gate
        if gate is None:
            await self._asgi_send(message)
        elif not gate.closed:
            await gate.raw(message)
        self.writing_since = 0.0  # (left set when the send was cancelled or failed: the next one resets it)

    def mark_finishing(self) -> None:
        """Call before the last send: see ``finishing`` above."""
        self.finishing = True

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        rid = self.rec.id.encode()
        headers = [*headers, (b"x-request-id", rid)]
        headers += [(b"x-passerelle-warning", w.encode("utf-8", "replace")) for w in self.warnings]
        if self.errors != OPENAI:
            headers.append((b"request-id", rid))  # where Anthropic's SDKs and Claude Code read it
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        cycle = getattr(self._gate.raw if self._gate is not None else self._asgi_send, "__self__", None)
        if (type(cycle) is RequestResponseCycle and all(hasattr(cycle, a) for a in _CYCLE_STATE)
                and cycle.chunked_encoding and cycle.scope["method"] != "HEAD"):
            self._cycle = cycle

    async def start_with(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """:meth:`start`, then ``body`` as the first, non-final part of a chunked body: head and part
        in one write on uvicorn's connection when it takes bytes now (a write less per request,
        on the way to the first token); otherwise the head, then the part through :meth:`send`."""
        cycle = getattr(self._gate.raw if self._gate is not None else self._asgi_send, "__self__", None)
        if (type(cycle) is RequestResponseCycle and all(hasattr(cycle, a) for a in _CYCLE_STATE)
                and not cycle.flow.write_paused and not cycle.disconnected and not cycle.transport.is_closing()):
            transport, held = cycle.transport, _HeldWrites()
            cycle.transport = held  # type: ignore[assignment]  # (uvicorn's send writes the head: nothing waits)
            try:
                await self.start(status, headers)
            finally:
                cycle.transport = transport
            if self._cycle is not None and held.parts:  # (chunked, the head built)
                transport.write(b"".join(held.parts) + b"%x\r\n%b\r\n" % (len(body), body))
                return
            if held.parts:
                transport.write(b"".join(held.parts))
        else:
            await self.start(status, headers)
        await self.send_body(body, more=True)

    def writable(self) -> bool:
        """Can :meth:`write_now` write a part of the body at once? (uvicorn's response, its head
        out and chunked, the connection open and taking bytes, the shutdown not holding writes.)
        Where not, the body goes through :meth:`send`, which waits for the client or drops."""
        cycle = self._cycle
        return (cycle is not None and not cycle.flow.write_paused and not cycle.disconnected
                and not cycle.response_complete and not cycle.transport.is_closing()
                and (self._gate is None or not self._gate.closed))

    def write_now(self, body: bytes) -> None:
        """Write a non-empty, non-final part of the body straight to the client's connection, in the
        chunked framing uvicorn's send gives it (only when :meth:`writable`): what ``send`` does for
        it, without the coroutines and the message between (a stream's relay writes a few dozen
        of them a request). Nothing waits, so ``writing_since`` stays unset; a client that stops
        reading fills its buffer until uvicorn pauses writing, and then ``send`` waits as usual."""
        self._cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))

    async def send_body(self, body: bytes, *, more: bool) -> None:
        await self.send({"type": "http.response.body", "body": body, "more_body": more})

    async def send_whole(self, body: bytes | Sequence[bytes | bytearray | memoryview], *,
                         piece: int = 1 << 18) -> None:
        """A whole body (bytes, or pieces written one after the other), in pieces of ``piece``
        bytes: between pieces the send waits for the client to take what it has, so a client that
        stops reading holds at most a piece in memory (and is found by the watchdog), not the whole
        answer."""
        if isinstance(body, bytes) and len(body) <= piece:
            self.mark_finishing()
            await self.send_body(body, more=False)
            return
        parts = [memoryview(body)] if isinstance(body, bytes) else [memoryview(p) for p in body]
        total = sum(len(p) for p in parts)
        sent = 0
        out = bytearray()
        for part in parts:
            while len(part):
                take = min(piece - len(out), len(part))
                out += part[:take]
                part = part[take:]
                if len(out) == piece and sent + piece < total:
                    await self.send_body(bytes(out), more=True)
                    sent += piece
                    out.clear()
        self.mark_finishing()
        await self.send_body(bytes(out), more=False)

    async def report(self, err: GatewayError) -> None:
        """Tell the client about ``err``: an error response in its API's shape, or that API's own
        error event once streaming began. A client that is gone by then is nobody's problem."""
        self.finishing = True
        with contextlib.suppress(OSError):
            if self.started:
                await self.send_body(grammars.error_event(self.grammar, err), more=False)
                return
            body, ctype = error_body(err, self.errors)
            await self.start(err.status, [(b"content-type", ctype), (b"content-length", str(len(body)).encode()),
                                          *err.headers()])
            await self.send_body(body, more=False)
