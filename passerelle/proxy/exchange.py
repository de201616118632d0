"""One request/response cycle between a client and the gateway, and everything it has said so far.

The gateway's code for one request reads top to bottom because the state that several steps share
lives here, on one object, rather than in closures and ``nonlocal`` flags:

* ``started``: the response head went out; from now on an error can only be an SSE error event;
* ``finishing``: the last bytes are on their way; a hang-up now is the client being done, not a
  disconnect (uvicorn answers ``receive()`` with ``http.disconnect`` once the response is
  complete, and the openai SDK closes the connection as soon as it has read ``[DONE]``);
* ``disconnected``: the client left; the request's task was cancelled because of it.

Race worth knowing: the watcher task waits on ASGI ``receive()`` and cancels the request's task on
``http.disconnect``. The request task tells a disconnect-cancel from any other cancellation by
``disconnected``, and ``uncancel()``s only the former.

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
from collections.abc import Awaitable, Callable
from typing import Any

from passerelle.errors import GatewayError
from passerelle.observe.record import RequestRecord, new_request_id
from passerelle.proxy import grammars
from passerelle.proxy.protocols import OPENAI, error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v).decode("latin-1")
    return None


class Exchange:
    __slots__ = ("_watcher", "disconnected", "errors", "finishing", "grammar", "rec", "receive", "scope", "send",
                 "started", "task")

    def __init__(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        client = scope.get("client")
        self.scope, self.receive, self.send = scope, receive, send
        self.rec = RequestRecord(id=new_request_id(), endpoint=endpoint, client=client[0] if client else "")
        self.started = False
        self.finishing = False
        self.disconnected = False
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self._watcher: asyncio.Task[None] | None = None
        # the API's error shape (protocols.py) and stream grammar (grammars.py), for report()
        self.errors = OPENAI
        self.grammar = "chat"

    def header(self, name: bytes) -> str | None:
        return header(self.scope, name)

    # -- the client leaving --------------------------------------------------------------------
    def watch(self) -> None:
        """From now on, a client that hangs up cancels this request (the body must be read first:
        the watcher takes over ``receive``)."""
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                if not self.finishing:
                    self.disconnected = True
                    self.task.cancel()
                return

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()

    # -- what the client is sent ---------------------------------------------------------------
    def mark_finishing(self) -> None:
        """Call before the last send: see ``finishing`` above."""
        self.finishing = True

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        rid = self.rec.id.encode()
        headers = [*headers, (b"x-request-id", rid)]
        if self.errors != OPENAI:
            headers.append((b"request-id", rid))  # where Anthropic's SDKs and Claude Code read it
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def send_body(self, body: bytes, *, more: bool) -> None:
        await self.send({"type": "http.response.body", "body": body, "more_body": more})

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
