"""Reading a runtime's answer that is not relayed as it comes: a whole body (its usage taken),
an error answer, and what is left of a stream after its end, each within a byte cap."""

from __future__ import annotations

import asyncio
import contextlib
import time

import orjson

from passerelle.errors import UpstreamError, UpstreamTooLarge
from passerelle.observe.record import RequestRecord
from passerelle.proxy.grammars import cached_of
from passerelle.proxy.sse_scan import parse_usage
from passerelle.upstream.client import BodyTooLarge, HTTPClientError, Response


async def read_body(resp: Response, rec: RequestRecord, *, limit: int) -> bytes:
    """Read a non-streaming answer, at most ``limit`` bytes, and take the token counts from its
    ``usage``. (The caller's budget bounds the time.)"""
    try:
        body = await resp.read(limit)
    except BodyTooLarge:
        raise UpstreamTooLarge("answer", limit, "max_answer_bytes") from None
    except (HTTPClientError, OSError) as exc:
        raise UpstreamError(f"The model runtime '{rec.backend}' broke the response: "
                            f"{exc.__class__.__name__}", retryable=True) from exc
    rec.t_first = rec.t_last = time.perf_counter()
    if b'"usage"' in body:
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            obj = None
        p, c = parse_usage(obj)
        if c is not None or p is not None:
            rec.prompt_tokens, rec.completion_tokens, rec.usage_from_server = p, c, True
            rec.cached_tokens = cached_of(obj)
    return body


async def read_error(resp: Response, rec: RequestRecord, *, limit: int) -> bytes:
    """The body of a runtime's error answer, at most ``limit`` bytes."""
    try:
        return await resp.read(limit)
    except BodyTooLarge:
        raise UpstreamTooLarge(f"error answer (HTTP {resp.status})", limit, "max_error_bytes") from None
    except (HTTPClientError, OSError) as exc:
        raise UpstreamError(f"The model runtime '{rec.backend}' broke its HTTP {resp.status} answer: "
                            f"{exc.__class__.__name__}", retryable=True) from exc


async def finish_upstream(resp: Response, budget: asyncio.Timeout, *, within_s: float = 0.1,
                          limit: int = 1 << 16) -> None:
    """After ``[DONE]``: read what is left of the body, relaying nothing, so that the connection can
    go back to the pool; give up (the connection is then closed) after ``limit`` bytes, or when
    ``budget``, moved ``within_s`` ahead, runs out (the caller treats that expiry as the end). A
    well-behaved runtime's chunked terminator is already there or arrives at once."""
    if resp.complete:
        return
    budget.reschedule(asyncio.get_running_loop().time() + within_s)
    got = 0
    with contextlib.suppress(HTTPClientError, OSError):
        while data := await resp.readany():
            got += len(data)
            if got > limit:
                return
