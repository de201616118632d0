"""Writing whole (non-streamed) responses to an ASGI ``send``: JSON, raw bytes, errors.

Every response carries ``X-Request-Id``; every error is a
:class:`~passerelle.errors.GatewayError` rendered in its API's shape.

Example::

    await json_response(send, 200, {"status": "ok"})
    await error_response(send, NotFound("No route for GET /nope."))
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from passerelle.errors import GatewayError
from passerelle.observe.record import new_request_id

Send = Callable[[dict[str, Any]], Awaitable[None]]


async def raw_response(send: Send, status: int, body: bytes, ctype: bytes,
                       extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode()),
               (b"x-request-id", new_request_id().encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def json_response(send: Send, status: int, obj: Any) -> None:
    await raw_response(send, status, b"" if obj is None else orjson.dumps(obj), b"application/json")


async def error_response(send: Send, err: GatewayError) -> None:
    await raw_response(send, err.status, err.body(), b"application/json", err.headers())
