"""One batch line through the gateway's own request path, without HTTP.

The line is handed to :meth:`Gateway.handle` as an ASGI request of its own (a scope, a receive
that gives the body, a send that keeps the answer), so it lives the life of any request: the key
that created the batch (named in the scope under :data:`INTERNAL_KEY`, which no HTTP client can
set: uvicorn builds the scopes of the connections it accepts), its allow-list, quotas and rate
limits, the queue at the batch class (``X-Priority`` lowers a request's class whatever the key),
fair share by tenant, preemption, retries, metrics, the access log and a usage row.

Why not loop back over HTTP to the gateway's own port: the key's secret is not kept (only its
hash), the gateway may listen where it cannot reach itself (a socket behind a proxy), and a
loopback costs a connection, a parse and a copy per line for nothing the in-process call lacks.

Ending a line early (cancel, expiry, shutdown) is a client hanging up: its receive answers
``http.disconnect``, so the request ends with the cause ``client_disconnect`` and gives back its
slot and its key's turn the same way.

The line's outcome is the request's own :class:`RequestRecord` (its status, its termination cause,
its token counts, as the gateway measured them for the metrics and the usage store): the
gateway's listeners get every finished record, and :class:`LineRecords` hands each line its own
(matched by the ``X-Request-Id`` of its answer), so nothing here parses an answer again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from passerelle.observe.record import RequestRecord
from passerelle.proxy.gateway import INTERNAL_KEY, Gateway


@dataclass(slots=True)
class Answer:
    status: int = 0
    request_id: str = ""
    retry_after: float = 0.0
    chunks: list[bytes] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


class LineRecords:
    """The finished records of the lines running, by request id: a :attr:`Gateway.listeners`
    callable (one attribute test for any other request)."""

    def __init__(self) -> None:
        self.waiting: dict[str, LineRequest] = {}

    def observe(self, rec: RequestRecord) -> None:
        if rec.client == "batch" and (req := self.waiting.pop(rec.id, None)) is not None:
            req.record = rec


class LineRequest:
    """One line's request; ``hang_up()`` ends it as a client leaving would."""

    def __init__(self, path: str, body: bytes, *, key_id: str | None, class_name: str, batch_id: str,
                 records: LineRecords, cap: int = 64 * 1024 * 1024) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-priority", class_name.encode()), (b"x-passerelle-batch", batch_id.encode())]
        self.scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "headers": headers,
            "client": ("batch", 0), "server": ("batch", 0), INTERNAL_KEY: key_id}
        self.body = body
        self._sent = False
        self._gone = asyncio.Event()
        self.answer = Answer()
        self.cap = cap  # bytes of answer kept; past it the line hangs up (``too_large``)
        self.size = 0
        self.too_large = False
        self.records = records
        self.record: RequestRecord | None = None  # the gateway's, once the request has ended

    def hang_up(self) -> None:
        self._gone.set()

    async def _receive(self) -> dict[str, Any]:
        if not self._sent:
            self._sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.answer.status = message["status"]
            for k, v in message.get("headers", []):
                if k == b"x-request-id":
                    self.answer.request_id = bytes(v).decode("latin-1")
                    self.records.waiting[self.answer.request_id] = self
                elif k == b"retry-after" and bytes(v).isdigit():
                    self.answer.retry_after = float(bytes(v))
        elif message.get("body") and not self.too_large:
            self.size += len(message["body"])
            if self.size > self.cap:
                self.too_large = True
                self.answer.chunks = []
                self.hang_up()
                return
            self.answer.chunks.append(bytes(message["body"]))

    async def run(self, gateway: Gateway, endpoint: str) -> Answer:
        """The answer; :attr:`record` is set by then (the gateway accounts a request before its
        handler returns), unless no answer started (the line hung up first)."""
        try:
            await gateway.handle(self.scope, self._receive, self._send, endpoint)
        finally:
            self.records.waiting.pop(self.answer.request_id, None)
        return self.answer
