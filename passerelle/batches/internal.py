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
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import orjson

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


class Line:
    """One line's request; ``hang_up()`` ends it as a client leaving would."""

    def __init__(self, path: str, body: bytes, *, key_id: str | None, class_name: str, batch_id: str,
                 cap: int = 64 * 1024 * 1024) -> None:
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
        await gateway.handle(self.scope, self._receive, self._send, endpoint)
        return self.answer


def usage_of(body: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens of an answer, from its ``usage`` in any of the APIs' spellings."""
    try:
        usage = orjson.loads(body).get("usage") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return 0, 0
    if not isinstance(usage, dict):
        return 0, 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    return (prompt if isinstance(prompt, int) else 0), (completion if isinstance(completion, int) else 0)
