"""Waiting for something to happen, with a deadline: the tests' one way to do it.

A fixed sleep guesses how long a thing takes: too short on a busy machine, wasted time on an idle
one. ``until`` (in a coroutine) and ``wait_until`` (in a thread) poll the thing itself and fail after
``timeout`` seconds with an ``AssertionError`` naming what was awaited (``what``, or the check's own
source line) and the last error the check raised. A sleep that paces a scripted peer (a slow client,
a slow runtime) is not a wait and stays a sleep."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
import httpx

T = TypeVar("T")

# What a check may raise while the thing it looks at is not there yet (a server still starting, a
# body half written): retried until the deadline, then named in the failure.
TRANSIENT: tuple[type[BaseException], ...] = (OSError, ValueError, httpx.HTTPError, aiohttp.ClientError)


async def until(cond: Callable[[], T | Awaitable[T]], timeout: float = 5.0, what: str | None = None, *,
                interval: float = 0.005, ignore: tuple[type[BaseException], ...] = TRANSIENT) -> T:
    """Await ``cond()`` (a function or a coroutine function) until it returns a truthy value, and
    return that value; fail after ``timeout`` seconds of the running loop's clock."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = cond()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value  # type: ignore[return-value]
        except ignore as exc:
            last = exc
        if loop.time() > deadline:
            raise AssertionError(_timed_out(cond, timeout, what, last))
        await asyncio.sleep(interval)


def wait_until(cond: Callable[[], T], timeout: float = 5.0, what: str | None = None, *,
               interval: float = 0.05, ignore: tuple[type[BaseException], ...] = TRANSIENT) -> T:
    """``until`` for a thread (a test driving subprocesses over HTTP): poll ``cond()`` until it returns
    a truthy value, and return that value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = cond()
            if value:
                return value
        except ignore as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(cond, timeout, what, last))
        time.sleep(interval)


def _timed_out(cond: Callable[..., object], timeout: float, what: str | None, last: BaseException | None) -> str:
    text = f"timed out after {timeout} s waiting for {what or _describe(cond)}"
    return text + (f" (last error: {type(last).__name__}: {last})" if last is not None else "")


def _describe(cond: Callable[..., object]) -> str:
    """The check's own source (a lambda's line), when no ``what`` was given."""
    try:
        source = " ".join(inspect.getsource(cond).split())
    except (OSError, TypeError):
        return getattr(cond, "__qualname__", repr(cond))
    return source if len(source) <= 200 else source[:197] + "..."
