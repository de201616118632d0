"""The bench/ scripts' streaming load: simulated users, each on one keep-alive HTTP/1.1 connection,
sending streaming chat requests one after another and timing them.

A lean client on uvloop and httptools, so that the generator is not what a run measures: the
request is written in one call, the response's events are counted in place (a content event as
passerelle/chunks.py defines it, the same definition the gateway's relay uses), and nothing is
decoded. TTFT runs from that write to the first content event. Users start staggered over one
request's duration (otherwise identical requests march in lock-step waves), the first request of
each connection is a warm-up, and users keep sending until the last measured request has ended,
so the load stays at the concurrency for the whole window. Each round records the generator's own
CPU, so a run shows whether the generator could keep up. ``run_waves`` sends synchronized waves
instead: N requests written back to back once all N connections are idle, wave after wave.

    from loadgen import run_async, run_load

    r = run_async(run_load(gw.url, concurrency=64, measured=1024, max_tokens=32, stagger_s=0.36,
                           timeout=60))
    print(pct(r.ttft_ms, 50), r.tokens_per_s, dict(r.errors))
    w = run_async(run_waves(gw.url, size=64, waves=10, max_tokens=32, timeout=60))
    print(pct(w.ttft_ms, 99), max(w.spread_ms))   # TTFT when 64 arrive at once; the writes' spread
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httptools
from harness import MASTER_KEY, MODEL, own_cpu_s

from passerelle.chunks import CHAT, count_events


class Failed(Exception):
    pass


@dataclass
class Totals:
    tokens: int = 0  # content events received on any request of the round, warm-ups included


class StreamConn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection sending one streaming request at a time."""

    def __init__(self, sink: Totals) -> None:
        self.sink = sink
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.open = False
        self.status = 0
        self.keep_alive = True
        self.tail = b""
        self.first = 0.0
        self.tokens = 0
        self.done = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(Failed(f"bad HTTP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._finish(Failed("connection closed mid-request"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        buf = self.tail + body if self.tail else body
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self.tail = buf
            return
        events, self.tail = buf[: cut + 2], buf[cut + 2:]
        n = count_events(CHAT, events)
        if n:
            if not self.first:
                self.first = time.perf_counter()
            self.tokens += n
            self.sink.tokens += n
        if b"data: [DONE]" in events:
            self.done = True

    def on_message_complete(self) -> None:
        self._finish(None)

    def _finish(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            if exc is None:
                self.waiter.set_result(None)
            else:
                self.waiter.set_exception(exc)

    async def request(self, raw: bytes, timeout: float) -> tuple[float, float, float, int]:
        """(sent, first content, end, content events); raises Failed or TimeoutError."""
        return await self.finish(self.send(raw), timeout)

    def send(self, raw: bytes) -> float:
        """Write the request (one call, no await: a wave writes all its requests back to back);
        returns when it was written."""
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.first, self.tokens, self.done, self.tail, self.status = 0.0, 0, False, b"", 0
        t0 = time.perf_counter()
        self.transport.write(raw)
        return t0

    async def finish(self, t0: float, timeout: float) -> tuple[float, float, float, int]:
        """Until the response :meth:`send` asked for has ended: (sent, first content, end, content
        events); raises Failed or TimeoutError."""
        assert self.waiter is not None
        async with asyncio.timeout(timeout):
            await self.waiter
        end = time.perf_counter()
        if self.status != 200:
            raise Failed(f"HTTP {self.status}")
        if not self.done:
            raise Failed("stream ended without [DONE]")
        return t0, self.first, end, self.tokens

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def request_bytes(url: str, max_tokens: int, extra: dict[str, Any] | None = None) -> bytes:
    """One streamed chat request, written whole; ``extra``: more body fields (``tools``, say)."""
    host = url.split("//", 1)[1]
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Tell me about rivers."}], **(extra or {})},
                      separators=(",", ":")).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {MASTER_KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def endpoints(url: str, max_tokens: int, extra: dict[str, Any] | None = None) -> list[tuple[str, int, bytes]]:
    """Host, port and request bytes of each base URL in ``url``: one, or several separated by commas
    (a group of gateway processes: connection ``i`` goes to the ``i mod n``-th, spread evenly as
    ``SO_REUSEPORT`` would spread them)."""
    out = []
    for u in url.split(","):
        host, port = u.split("//", 1)[1].rsplit(":", 1)
        out.append((host, int(port), request_bytes(u, max_tokens, extra)))
    return out


@dataclass
class Round:
    ttft_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    tokens_per_s: float = 0.0
    requests: int = 0  # every request the round sent and finished (warm-ups and cool-downs included)
    wall_s: float = 0.0
    window_s: float = 0.0
    gen_cpu_s: float = 0.0
    spread_ms: list[float] = field(default_factory=list)  # waves: per wave, its first write to its last


async def run_load(url: str, concurrency: int, measured: int, max_tokens: int, stagger_s: float,
                   timeout: float, deadline_s: float | None = None,
                   on_done: Callable[[float, float, float, int], None] | None = None,
                   cap_s: float | None = None, extra: dict[str, Any] | None = None) -> Round:
    """``concurrency`` users, each on its own connection: a warm-up request, then measured ones
    until ``measured`` are taken, then more (not measured) until the last measured one ended.

    ``cap_s``: after this long, take no more measured requests (a slow target gets fewer, but at
    least one per user). With ``deadline_s`` (soak) users run until then and nothing is measured
    but ``on_done``.
    """
    loop = asyncio.get_running_loop()
    places = endpoints(url, max_tokens, extra)
    totals = Totals()
    out = Round()
    state = {"taken": 0, "ended": 0, "t_a": 0.0, "tok_a": 0, "t_b": 0.0, "tok_b": 0, "closed": False}
    at_least = min(measured, concurrency)

    def maybe_all_ended() -> None:
        if state["ended"] == state["taken"] and (state["taken"] >= measured or state["closed"]) \
                and not all_ended.done():
            state["t_b"], state["tok_b"] = time.perf_counter(), totals.tokens
            all_ended.set_result(None)
    all_ended = loop.create_future()
    if measured <= 0:
        all_ended.set_result(None)
    t_start, gen0 = time.perf_counter(), own_cpu_s()
    stop_at = (t_start + deadline_s) if deadline_s is not None else None

    async def user(i: int) -> None:
        host, port, raw = places[i % len(places)]
        await asyncio.sleep(stagger_s * i / concurrency)
        conn: StreamConn | None = None
        warm = True
        try:
            while True:
                if stop_at is not None:
                    if time.perf_counter() >= stop_at:
                        return
                    counted = False
                elif all_ended.done():
                    return
                else:
                    if (cap_s is not None and not state["closed"] and state["taken"] >= at_least
                            and time.perf_counter() - t_start > cap_s):
                        state["closed"] = True
                        maybe_all_ended()
                        if all_ended.done():
                            return
                    counted = not warm and state["taken"] < measured and not state["closed"]
                if conn is None or not conn.open or not conn.keep_alive:
                    if conn is not None:
                        conn.close()
                    try:
                        _, conn = await loop.create_connection(lambda: StreamConn(totals), host, port)
                    except OSError as exc:
                        out.errors[f"connect: {exc.__class__.__name__}"] += 1
                        await asyncio.sleep(0.1)
                        continue
                if counted:
                    state["taken"] += 1
                    if state["taken"] == 1:
                        state["t_a"], state["tok_a"] = time.perf_counter(), totals.tokens
                try:
                    t0, first, end, n = await conn.request(raw, timeout)
                except (Failed, TimeoutError) as exc:
                    out.errors[str(exc) or "timeout"] += 1
                    conn.close()
                    conn = None
                else:
                    out.requests += 1
                    if on_done is not None:
                        on_done(t0, first, end, n)
                    if counted:
                        if n != max_tokens:
                            out.errors[f"{n} of {max_tokens} tokens"] += 1
                        out.ttft_ms.append((first - t0) * 1000)
                        out.e2e_ms.append((end - t0) * 1000)
                if counted:
                    state["ended"] += 1
                    maybe_all_ended()
                warm = False
        finally:
            if conn is not None:
                conn.close()

    await asyncio.gather(*(user(i) for i in range(concurrency)))
    out.wall_s = time.perf_counter() - t_start
    out.gen_cpu_s = own_cpu_s() - gen0
    if measured > 0 and state["t_b"] > state["t_a"]:
        out.window_s = state["t_b"] - state["t_a"]
        out.tokens_per_s = (state["tok_b"] - state["tok_a"]) / out.window_s
    return out


async def run_waves(url: str, size: int, waves: int, max_tokens: int, timeout: float, gap_s: float = 0.2,
                    cap_s: float | None = None, extra: dict[str, Any] | None = None) -> Round:
    """Synchronized waves: ``size`` requests that arrive at once, ``waves`` times.

    ``size`` keep-alive connections are opened and each sends a warm-up request (not measured).
    Then, per wave, a barrier: once every connection is open and idle, the ``size`` requests are
    written back to back in one pass, with no await between the writes (so nothing else this
    client does runs between them: the spread, first write to last, is recorded per wave), and
    the wave ends when the last response has. ``gap_s`` later the next wave starts. TTFT runs from
    each request's own write. ``cap_s``: after this long, start no more waves (at least one).
    ``tokens_per_s``: the content events of all waves over the time their waves ran.
    """
    loop = asyncio.get_running_loop()
    places = endpoints(url, max_tokens, extra)
    totals = Totals()
    out = Round()
    conns: list[StreamConn | None] = [None] * size
    t_start, gen0 = time.perf_counter(), own_cpu_s()

    async def ready(i: int) -> None:
        """Connection ``i`` open and keep-alive (a new one where a failure closed it)."""
        conn = conns[i]
        if conn is not None and conn.open and conn.keep_alive:
            return
        if conn is not None:
            conn.close()
        host, port, _ = places[i % len(places)]
        for _ in range(3):
            try:
                _, conns[i] = await loop.create_connection(lambda: StreamConn(totals), host, port)
                return
            except OSError as exc:
                out.errors[f"connect: {exc.__class__.__name__}"] += 1
                await asyncio.sleep(0.1)
        raise Failed(f"could not connect to {url}")

    async def ended(i: int, t0: float) -> tuple[float, float, float, int] | None:
        conn = conns[i]
        assert conn is not None
        try:
            return await conn.finish(t0, timeout)
        except (Failed, TimeoutError) as exc:
            out.errors[str(exc) or "timeout"] += 1
            conn.close()
            return None

    async def warm(i: int) -> None:
        await ready(i)
        conn = conns[i]
        assert conn is not None
        await ended(i, conn.send(places[i % len(places)][2]))

    busy_s, wave_tokens = 0.0, 0
    try:
        await asyncio.gather(*(warm(i) for i in range(size)))
        for w in range(waves):
            if w and cap_s is not None and time.perf_counter() - t_start > cap_s:
                break
            await asyncio.gather(*(ready(i) for i in range(size)))
            ready_conns = [c for c in conns if c is not None]  # all of them: ready() raises otherwise
            tok0 = totals.tokens
            # the barrier's release: all written in this pass
            sent = [c.send(places[i % len(places)][2]) for i, c in enumerate(ready_conns)]
            out.spread_ms.append((sent[-1] - sent[0]) * 1000)
            results = await asyncio.gather(*(ended(i, t0) for i, t0 in enumerate(sent)))
            busy_s += time.perf_counter() - sent[0]
            out.requests += len(sent)
            for res in results:
                if res is None:
                    continue
                t0, first, end, n = res
                if n != max_tokens:
                    out.errors[f"{n} of {max_tokens} tokens"] += 1
                out.ttft_ms.append((first - t0) * 1000)
                out.e2e_ms.append((end - t0) * 1000)
            wave_tokens += totals.tokens - tok0
            if w + 1 < waves:
                await asyncio.sleep(gap_s)
    finally:
        for c in conns:
            if c is not None:
                c.close()
    out.wall_s = out.window_s = time.perf_counter() - t_start
    out.gen_cpu_s = own_cpu_s() - gen0
    out.tokens_per_s = wave_tokens / busy_s if busy_s else 0.0
    return out


def run_async(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(coro)
    return uvloop.run(coro)
