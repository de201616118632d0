"""A deterministic OpenAI-compatible runtime for tests, benchmarks and checking a set-up.

``passerelle fake-backend --port P --ttft-ms X --itl-ms Y [--slots N]`` streams one token per
chunk on a fixed schedule: the first content chunk X ms after the request gets a slot, then one
every Y ms, scheduled against the monotonic clock from that start so delays never accumulate.
With ``--slots N`` at most N requests generate at once and the rest wait in FIFO order, like
llama-server's slots. It also speaks enough of llama-server's side API (``/health``, ``/slots``,
``/metrics``, ``/props``) to stand in for it, and can inject failures (HTTP 500), mid-stream
connection cuts and scripted misbehaviours (``--fault``, or ``"fake_fault"`` in a request's body:
never answering, ``100 Continue`` forever, huge events and bodies, redirects, HTML, events after
``[DONE]``…; see faults.py). ``GET /fake/stats`` tells tests what it injected. ``/v1/responses``
and ``/v1/messages`` stream the same tokens on the same schedule in those APIs' events
(fake_events.py), so the gateway's cost can be measured on every grammar alike.

It has to outrun the benchmark client at hundreds of streams and zero delays, so chunks are
assembled from pre-encoded byte templates and whatever is due is written in one call.

Tests start it in a subprocess with :func:`start_fake_backend`::

    with start_fake_backend(ttft_ms=100, itl_ms=20, slots=4) as fake:
        httpx.get(fake.url + "/v1/models")
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import os
import random
import re
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from passerelle.testing.fake_events import Events
from passerelle.testing.faults import FAULTS, fault_of, misbehave

# Tokens the fake "generates": ordinary words, so the text looks like text to whatever reads it.
VOCAB = (
    " the", " river", " carried", " small", " boats", " past", " old", " mills", " and", " quiet",
    " fields", " where", " people", " worked", " from", " morning", " until", " evening", " light",
    " faded", " over", " hills", " of", " stone", " with", " bread", " warm", " water", " cold",
    " wind", " strong", " voices", " near", " a", " door", " opened", " slowly", " to", " let",
    " in", " news", " that", " travelled", " far", " beyond", " town", " walls", " again", ".",
)
_ORJSON: Any
try:
    import orjson as _ORJSON
except ImportError:  # pragma: no cover - orjson is a dependency
    _ORJSON = None


def _dumps(obj: Any) -> bytes:
    if _ORJSON is not None:
        data: bytes = _ORJSON.dumps(obj)  # _ORJSON is Any: it may be None
        return data
    import json

    return json.dumps(obj, separators=(",", ":")).encode()


def _loads(data: bytes) -> Any:
    if _ORJSON is not None:
        return _ORJSON.loads(data)
    import json

    return json.loads(data)


_WORDS_JSON = tuple(_dumps(w) for w in VOCAB)
# The part of a chunk after the per-request prefix, one per vocabulary word.
_CHAT_MID = tuple(b'"content":' + w + b'},"logprobs":null,"finish_reason":null}]}\n\n' for w in _WORDS_JSON)
_COMPL_MID = tuple(b'"text":' + w + b',"logprobs":null,"finish_reason":null}]}\n\n' for w in _WORDS_JSON)
_ROLE_MID = b'"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class FakeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    ttft_ms: float = 100.0
    itl_ms: float = 20.0
    slots: int = 0  # 0: no limit
    tokens: int = 16  # output tokens when a request gives no max_tokens
    model: str = "fake-model"
    fail_rate: float = 0.0
    fail_status: int = 500  # the status of an injected failure: 429 plays a gateway shedding load, at once
    abort_rate: float = 0.0
    seed: int | None = None
    usage: bool = True  # honour stream_options.include_usage (off: act like a runtime without it)
    embedding_dim: int = 64
    # like llama-server without room in its physical batch: an input to embed longer than this many
    # tokens gets its 500 "input (N tokens) is too large to process" (0: no limit)
    embed_batch: int = 0
    # what /props says of its chat template's tools (chat_template_caps.supports_tools): None says nothing
    tools: bool | None = None
    # like llama-server: drop the connection this long after each streamed answer, ignoring any
    # request already sent on it (None: keep it alive)
    close_after_stream_ms: float | None = None
    # a prompt cache like a runtime's: remember the last N prompts and report, in
    # usage.prompt_tokens_details.cached_tokens, the longest prefix (in words) shared with one (0: off)
    prefix_cache: int = 0
    fault: str = ""  # a scripted misbehaviour (testing/faults.py) for fault_rate of the requests
    fault_rate: float = 1.0
    fault_bytes: int = 200 * 1024 * 1024  # size of huge-event / huge-body / huge-error
    drip_ms: float = 100.0  # pace of drip / continue-forever
    # only the OpenAI routes: no /props, /slots or /metrics, like a runtime that says nothing
    # about how many requests it runs at once (its capacity must be learned)
    openai_only: bool = False
    # Responses and Messages events without the fields a runtime may leave out (sequence numbers,
    # output and content indexes; Messages' index), as llama-server's /v1/responses stream has them
    bare_events: bool = False


class Slots:
    """Generation slots handed out in arrival order; ``limit == 0`` means unlimited."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.free: deque[int] = deque(range(limit))
        self.busy: set[int] = set()
        self.waiters: deque[asyncio.Future[int]] = deque()
        self._next = 0

    async def acquire(self) -> int:
        if not self.limit:
            self._next += 1
            self.busy.add(self._next)
            return self._next
        if self.free and not self.waiters:
            slot = self.free.popleft()
            self.busy.add(slot)
            return slot
        waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(waiter.result())  # handed a slot just as the client went away
            else:
                with suppress(ValueError):
                    self.waiters.remove(waiter)
            raise

    def release(self, slot: int) -> None:
        self.busy.discard(slot)
        if not self.limit:
            return
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                self.busy.add(slot)
                waiter.set_result(slot)
                return
        self.free.append(slot)


@dataclass
class Counters:
    requests: int = 0
    failed: int = 0
    aborted: int = 0
    completed: int = 0
    disconnected: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    connections: int = 0  # accepted: tells a keep-alive client's reuse from one connection per request
    in_flight: int = 0  # generation requests being answered now (waiting for a slot or generating)
    peak_in_flight: int = 0  # the most at once since start: what a gateway's limits let through
    faults: int = 0  # requests answered with a scripted misbehaviour


class BadRequest(Exception):
    pass


def _error_body(message: str, type_: str, code: int) -> bytes:
    return _dumps({"error": {"message": message, "type": type_, "code": code}})


def _words(value: Any) -> list[str]:
    """The words of every text part, in order (what ``_count_words`` counts)."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list):
        return [w for v in value for w in _words(v)]
    if isinstance(value, dict):
        return _words(value.get("content", "")) + _words(value.get("text", ""))
    return []


class PromptCache:
    """The last ``size`` prompts; ``lookup`` says how many leading words a new one shares with one."""

    def __init__(self, size: int) -> None:
        self.prompts: deque[list[str]] = deque(maxlen=size)

    def lookup(self, words: list[str]) -> int:
        best = 0
        for old in self.prompts:
            n = 0
            for a, b in zip(old, words, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self.prompts.append(words)
        return min(best, max(len(words) - 1, 0))  # like llama-server, the last token is always computed


def _count_words(value: Any) -> int:
    """The fake's "tokenizer": whitespace-separated words of every text part (a stack: a prompt
    may nest as deep as JSON is parsed)."""
    n, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            n += len(v.split())
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack += [v.get("content", ""), v.get("text", "")]
    return n


def tokens_due(now: float, first_at: float, itl: float, sent: int, n_tokens: int) -> int:
    """How many tokens are due by ``now`` (the first at ``first_at``, then one every ``itl``): at
    least ``sent + 1``, since the caller waited for token ``sent``. (Rounding in the division alone
    could say ``sent``, and the empty chunk written then is the chunked body's terminator.)

    >>> tokens_due(1.0 + 3 * 0.00005, 1.0, 0.00005, 3, 10)
    4
    """
    if itl <= 0:
        return n_tokens
    return min(n_tokens, max(sent + 1, int((now - first_at) / itl) + 1))


async def _sleep_until(deadline: float) -> None:
    # The loop's timers have millisecond granularity and may fire early; re-check the real clock.
    while (delay := deadline - time.perf_counter()) > 0:
        await asyncio.sleep(delay)


_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed",
            429: b"Too Many Requests", 500: b"Internal Server Error", 502: b"Bad Gateway",
            503: b"Service Unavailable"}


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: httptools parses, the backend answers, one request at a time.

    A plain protocol rather than a web framework: the fake must stay far faster than any client
    it measures, at hundreds of streams. Losing the connection cancels the request's task, which
    frees its slot.
    """

    def __init__(self, backend: FakeBackend) -> None:
        import httptools

        self.backend = backend
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.pending: deque[tuple[bytes, bytes, bytes, bool]] = deque()
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self._drain: asyncio.Future[None] | None = None
        self._paused = False
        self.received = 0.0  # when the current request's last byte arrived
        self.draining = False  # closing soon: further requests are read and dropped

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.backend.counters.connections += 1

    def data_received(self, data: bytes) -> None:
        import httptools

        if self.draining:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.respond(400, _error_body("malformed HTTP request", "invalid_request_error", 400), False)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.task is not None:
            self.task.cancel()  # the client went away: stop generating, free the slot
        self._wake()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # curl asks before sending a large body; without an answer it waits a second
        if name.lower() == b"expect" and value.lower() == b"100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        elif name.lower() == b"traceparent":
            self.backend.traceparents.append(value.decode("latin-1"))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        request = (self.parser.get_method(), self.url.split(b"?", 1)[0], b"".join(self.body),
                   self.parser.should_keep_alive())
        if self.task is None:
            self._start(request)
        else:  # pipelined: answer in order
            self.pending.append(request)

    def _start(self, request: tuple[bytes, bytes, bytes, bool]) -> None:
        self.received = time.perf_counter()
        self.task = asyncio.get_running_loop().create_task(self._handle(request))

    async def _handle(self, request: tuple[bytes, bytes, bytes, bool]) -> None:
        try:
            await self.backend.dispatch(self, *request)
        except asyncio.CancelledError:
            return
        except Exception as exc:  # a bug in a handler must not hang the client
            if not self.closed:
                self.respond(500, _error_body(f"fake-backend error: {exc}", "server_error", 500), False)
                self.close()
            return
        finally:
            self.task = None
        if self.pending and not self.closed:
            self._start(self.pending.popleft())

    # writing
    def respond(self, status: int, body: bytes, keep_alive: bool,
                content_type: bytes = b"application/json") -> None:
        if self.closed or self.transport is None:
            return
        head = (b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n"
                % (status, _REASONS.get(status, b"Error"), content_type, len(body),
                   b"" if keep_alive else b"Connection: close\r\n"))
        self.transport.write(head + body)
        if not keep_alive:
            self.close()

    def start_stream(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n")

    async def write_chunk(self, data: bytes) -> None:
        if self.closed or self.transport is None:
            raise ConnectionResetError("client disconnected")
        self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        if self._paused:
            await self._wait_drain()

    async def write_raw(self, data: bytes) -> None:
        """Bytes as they are (a fault script's own HTTP), waiting while the reader is behind."""
        if self.closed or self.transport is None:
            raise ConnectionResetError("client disconnected")
        self.transport.write(data)
        if self._paused:
            await self._wait_drain()

    def end_stream(self, keep_alive: bool) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(b"0\r\n\r\n")
            if not keep_alive:
                self.close()

    def close(self) -> None:
        """Close after flushing what was written (mid-stream: the client sees a cut stream)."""
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    async def _wait_drain(self) -> None:
        while self._paused and not self.closed:
            self._drain = asyncio.get_running_loop().create_future()
            await self._drain
        if self.closed:
            raise ConnectionResetError("client disconnected")

    def _wake(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)


@dataclass
class FakeBackend:
    """The routes and their state (slots, counters, the seeded failure draws)."""

    config: FakeConfig
    slots: Slots = field(init=False)
    counters: Counters = field(default_factory=Counters)
    rng: random.Random = field(init=False)
    _ids: int = 0

    def __post_init__(self) -> None:
        self.slots = Slots(self.config.slots)
        self.rng = random.Random(self.config.seed)
        self.prompts_seen: set[int] = set()  # hashes, for tests: does a client ever repeat a prompt?
        self.traceparents: deque[str] = deque(maxlen=256)  # W3C trace contexts received, for tracing tests
        self.cache = PromptCache(self.config.prefix_cache) if self.config.prefix_cache else None
        self.events = Events(VOCAB, bare=self.config.bare_events)
        self.routes = {
            (b"POST", b"/v1/chat/completions"): self.chat,
            (b"POST", b"/v1/completions"): self.completions,
            (b"POST", b"/v1/embeddings"): self.embeddings,
            (b"POST", b"/v1/responses"): self.responses,
            (b"POST", b"/v1/messages"): self.messages,
            (b"POST", b"/v1/messages/count_tokens"): self.count_tokens,
            (b"POST", b"/v1/responses/input_tokens"): self.count_tokens,
            (b"GET", b"/v1/models"): self.models,
            (b"GET", b"/health"): self.health,
            (b"GET", b"/slots"): self.slots_view,
            (b"GET", b"/metrics"): self.metrics,
            (b"GET", b"/props"): self.props,
            (b"POST", b"/tokenize"): self.tokenize,
            (b"GET", b"/fake/stats"): self.stats,
        }
        if self.config.openai_only:
            for path in (b"/slots", b"/metrics", b"/props"):
                del self.routes[(b"GET", path)]

    async def dispatch(self, conn: Connection, method: bytes, path: bytes, body: bytes, keep_alive: bool) -> None:
        handler = self.routes.get((method, path))
        if handler is None:
            known = any(p == path for _, p in self.routes)
            status = 405 if known else 404
            conn.respond(status, _error_body(f"{method.decode()} {path.decode(errors='replace')}: "
                                             f"{'method not allowed' if known else 'not found'}",
                                             "invalid_request_error", status), keep_alive)
            return
        await handler(conn, body, keep_alive)

    # --- small endpoints -------------------------------------------------------------------
    async def models(self, conn: Connection, body: bytes, keep_alive: bool) -> None:
        conn.respond(200, _dumps({"object": "list", "data": [
            {"id": self.config.model, "object": "model", "created": 0, "owned_by": "passerelle-fake"}]}),
            keep_alive)

    async def health(self, conn: Connection, body: bytes, keep_alive: bool) -> None:
        conn.respond(200, b'{"status":"ok"}', keep_alive)

    async def slots_view(self, conn: Connection, body: bytes, keep_alive: bool) -> None:
        ids = range(self.config.slots) if self.config.slots else sorted(self.slots.busy)
        conn.respond(200, _dumps([{"id": i, "is_processing": i in self.slots.busy} for i in ids]), keep_alive)

    async def props(self, conn: Connection, body: bytes, keep_alive: bool) -> None:
        from passerelle import __version__

        props: dict[str, Any] = {"build_info": f"passerelle-fake-backend {__version__}",
                                 "model_path": self.config.model, "total_slots": self.config.slots}
        if self.config.tools is not None:
            props["chat_template"] = "fake"
            props["chat_template_caps"] = {"supports_tools": self.config.tools}
        conn.respond(200, _dumps(props), keep_alive)

    async def tokenize(self, conn: Connection, raw: bytes, keep_alive: bool) -> None:
        """A token id per word of ``content`` (the fake's tokenizer, as embeddings count them)."""
        try:
            content = self._body(raw).get("content")
            if not isinstance(content, str):
                raise BadRequest("'content' must be a string")
        except BadRequest as exc:
            conn.respond(400, _error_body(str(exc), "invalid_request_error", 400), keep_alive)
            return
        conn.respond(200, _dumps({"tokens": list(range(1, _count_words(content) + 1))}), keep_alive)

    async def stats(self, conn: Connection, body: bytes, keep_alive: bool) -> None:
        conn.respond(200, _dumps({**vars(self.counters), "distinct_prompts": len(self.prompts_seen),
                                  "traceparents": list(self.traceparents)}), keep_alive)

    async def metrics(self, conn: Connection, body: bytes, keep_alive: bool) -> None:
        c = self.counters
        text = (
            "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
            "# TYPE llamacpp:prompt_tokens_total counter\n"
            f"llamacpp:prompt_tokens_total {c.prompt_tokens}\n"
            "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.\n"
            "# TYPE llamacpp:tokens_predicted_total counter\n"
            f"llamacpp:tokens_predicted_total {c.completion_tokens}\n"
            "# HELP llamacpp:requests_processing Number of requests processing.\n"
            "# TYPE llamacpp:requests_processing gauge\n"
            f"llamacpp:requests_processing {len(self.slots.busy)}\n"
            "# HELP llamacpp:requests_deferred Number of requests deferred.\n"
            "# TYPE llamacpp:requests_deferred gauge\n"
            f"llamacpp:requests_deferred {len(self.slots.waiters)}\n"
        )
        conn.respond(200, text.encode(), keep_alive, b"text/plain; version=0.0.4; charset=utf-8")

    async def embeddings(self, conn: Connection, raw: bytes, keep_alive: bool) -> None:
        try:
            body = self._body(raw)
            inputs = body.get("input")
            if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and isinstance(inputs[0], int)):
                inputs = [inputs]
            if not isinstance(inputs, list) or not inputs:
                raise BadRequest("'input' must be a string or a list")
        except BadRequest as exc:
            conn.respond(400, _error_body(str(exc), "invalid_request_error", 400), keep_alive)
            return
        data, tokens = [], 0
        for i, item in enumerate(inputs):
            text = item if isinstance(item, str) else " ".join(map(str, item))
            n = len(item) if isinstance(item, list) else _count_words(text)
            if 0 < self.config.embed_batch < n:
                conn.respond(500, _error_body(f"input ({n} tokens) is too large to process. increase the physical "
                                              f"batch size (current batch size: {self.config.embed_batch})",
                                              "server_error", 500), keep_alive)
                return
            tokens += n
            data.append({"object": "embedding", "index": i, "embedding": self._vector(text)})
        conn.respond(200, _dumps({"object": "list", "data": data, "model": body.get("model") or self.config.model,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}), keep_alive)

    async def count_tokens(self, conn: Connection, raw: bytes, keep_alive: bool) -> None:
        """Messages' count_tokens and Responses' input_tokens, as llama-server answers them."""
        try:
            body = self._body(raw)
        except BadRequest as exc:
            conn.respond(400, _error_body(str(exc), "invalid_request_error", 400), keep_alive)
            return
        prompt = body.get("messages", body.get("input"))
        conn.respond(200, _dumps({"input_tokens": _count_words(prompt) + _count_words(body.get("system"))}),
                     keep_alive)

    def _vector(self, text: str) -> list[float]:
        rng = random.Random(hashlib.sha256(text.encode()).digest())
        vec = [rng.gauss(0.0, 1.0) for _ in range(self.config.embedding_dim)]
        norm = math.sqrt(sum(v * v for v in vec)) or 1.0
        return [v / norm for v in vec]

    # --- generation ------------------------------------------------------------------------
    async def chat(self, conn: Connection, body: bytes, keep_alive: bool) -> None:
        await self._generate(conn, body, keep_alive, chat=True)

    async def completions(self, conn: Connection, body: bytes, keep_alive: bool) -> None:
        await self._generate(conn, body, keep_alive, chat=False)

    async def responses(self, conn: Connection, body: bytes, keep_alive: bool) -> None:
        await self._generate(conn, body, keep_alive, chat=False, api="responses")

    async def messages(self, conn: Connection, body: bytes, keep_alive: bool) -> None:
        await self._generate(conn, body, keep_alive, chat=True, api="messages")

    async def _generate(self, conn: Connection, raw: bytes, keep_alive: bool, *, chat: bool, api: str = "") -> None:
        received = conn.received
        try:
            body = self._body(raw)
            n_tokens = self._max_tokens(body)
            field_name = "input" if api == "responses" else "messages" if chat else "prompt"
            prompt = body.get(field_name)
            if prompt is None:
                raise BadRequest(f"'{field_name}' is required")
        except BadRequest as exc:
            conn.respond(400, _error_body(str(exc), "invalid_request_error", 400), keep_alive)
            return
        cfg = self.config
        self.counters.requests += 1
        # Draw both decisions for every request so one rate does not shift the other's sequence.
        fail = self.rng.random() < cfg.fail_rate
        abort = self.rng.random() < cfg.abort_rate
        fault = fault_of(body) or (cfg.fault if cfg.fault and self.rng.random() < cfg.fault_rate else "")
        if fault:
            self.counters.faults += 1
            try:
                await misbehave(conn, fault, chat=chat, stream=bool(body.get("stream")),
                                fault_bytes=cfg.fault_bytes, drip_ms=cfg.drip_ms, api=api)
            except (asyncio.CancelledError, ConnectionResetError):
                self.counters.disconnected += 1
                raise
            return
        if fail:
            self.counters.failed += 1
            status = cfg.fail_status
            conn.respond(status, _error_body("injected failure (fake-backend --fail-rate)",
                                             "rate_limit_exceeded" if status == 429 else "server_error", status),
                         keep_alive)
            return
        prompt_tokens = _count_words(prompt)
        try:
            self.prompts_seen.add(hash(_dumps(prompt)))
        except TypeError:  # nested deeper than orjson writes
            self.prompts_seen.add(hash(raw))
        cached = self.cache.lookup(_words(prompt)) if self.cache is not None else None
        stream = bool(body.get("stream"))
        include_usage = cfg.usage and bool((body.get("stream_options") or {}).get("include_usage"))
        model = body.get("model") or cfg.model
        self._ids += 1
        rid = f"{api or ('chatcmpl' if chat else 'cmpl')}-fake{self._ids:x}"
        finish = "length" if ("max_tokens" in body or "max_completion_tokens" in body) else "stop"

        waited = bool(self.slots.waiters) or (self.slots.limit and not self.slots.free)
        c = self.counters
        c.in_flight += 1
        c.peak_in_flight = max(c.peak_in_flight, c.in_flight)
        try:
            slot = await self.slots.acquire()
        except BaseException:
            c.in_flight -= 1
            raise
        try:
            # The schedule starts when the request arrived, or when it got its slot after a wait.
            start = time.perf_counter() if waited else received
            self.counters.prompt_tokens += prompt_tokens
            if not stream:
                await _sleep_until(start + (cfg.ttft_ms + max(n_tokens - 1, 0) * cfg.itl_ms) / 1000)
                self.counters.completed += 1
                self.counters.completion_tokens += n_tokens
                full = (self.events.full_body(api, rid, model, n_tokens, prompt_tokens) if api
                        else self._full_body(chat, rid, model, n_tokens, prompt_tokens, finish, cached))
                conn.respond(200, full, keep_alive)
                return
            if api:
                await self._stream_events(conn, api, rid, model, n_tokens, prompt_tokens, start, keep_alive)
                return
            # A request may ask for its own pace ("fake_itl_ms"), e.g. a fast long answer in a soak.
            itl_ms = body.get("fake_itl_ms")
            if isinstance(itl_ms, bool) or not isinstance(itl_ms, int | float) or itl_ms < 0:
                itl_ms = cfg.itl_ms
            await self._stream(conn, chat, rid, model, n_tokens, prompt_tokens, finish, include_usage, abort,
                               start, keep_alive, itl_ms, cached)
        except (asyncio.CancelledError, ConnectionResetError):
            self.counters.disconnected += 1
            raise
        finally:
            c.in_flight -= 1
            self.slots.release(slot)

    async def _stream(self, conn: Connection, chat: bool, rid: str, model: str, n_tokens: int,
                      prompt_tokens: int, finish: str, include_usage: bool, abort: bool, start: float,
                      keep_alive: bool, itl_ms: float, cached: int | None = None) -> None:
        cfg = self.config
        conn.start_stream()
        head = (b'data: {"id":"' + rid.encode() + b'","object":"'
                + (b"chat.completion.chunk" if chat else b"text_completion")
                + b'","created":' + str(int(time.time())).encode() + b',"model":' + _dumps(model))
        prefix = head + (b',"choices":[{"index":0,"delta":{' if chat else b',"choices":[{"index":0,')
        mids = _CHAT_MID if chat else _COMPL_MID
        if chat:  # OpenAI's first chunk: the role, empty content; never a token
            await conn.write_chunk(prefix + _ROLE_MID)
        cut_at = max(1, n_tokens // 2) if abort else -1
        ttft, itl = cfg.ttft_ms / 1000, itl_ms / 1000
        sent = 0
        while sent < n_tokens:
            due = start + ttft + sent * itl
            now = time.perf_counter()
            if due > now:
                await _sleep_until(due)
                now = time.perf_counter()
            # Everything already due goes out in one write (all of it when the delays are zero).
            upto = tokens_due(now, start + ttft, itl, sent, n_tokens)
            if cut_at > 0:
                upto = min(upto, cut_at)
            out = b"".join([prefix + mids[i % len(mids)] for i in range(sent, upto)])
            sent = upto
            if sent == cut_at:
                await conn.write_chunk(out)
                self.counters.aborted += 1
                self.counters.completion_tokens += sent
                conn.close()  # no chunked terminator, no [DONE]: the client sees a cut stream
                return
            if sent == n_tokens:
                out += self._tail(chat, prefix, head, finish, n_tokens, prompt_tokens, include_usage, cached)
            await conn.write_chunk(out)
        if n_tokens == 0:
            await conn.write_chunk(self._tail(chat, prefix, head, finish, 0, prompt_tokens, include_usage, cached))
        self.counters.completed += 1
        self.counters.completion_tokens += n_tokens
        conn.end_stream(keep_alive)
        if cfg.close_after_stream_ms is not None:
            conn.draining = True
            asyncio.get_running_loop().call_later(cfg.close_after_stream_ms / 1000, conn.close)

    async def _stream_events(self, conn: Connection, api: str, rid: str, model: str, n_tokens: int,
                             prompt_tokens: int, start: float, keep_alive: bool) -> None:
        """A Responses or Messages stream on the chat stream's schedule (no injected cuts)."""
        cfg = self.config
        conn.start_stream()
        await conn.write_chunk(self.events.head(api, rid, model, prompt_tokens))
        ttft, itl = cfg.ttft_ms / 1000, cfg.itl_ms / 1000
        sent = 0
        while sent < n_tokens:
            due = start + ttft + sent * itl
            if due > time.perf_counter():
                await _sleep_until(due)
            upto = n_tokens if itl <= 0 else min(n_tokens, int((time.perf_counter() - start - ttft) / itl) + 1)
            out = b"".join([self.events.token(api, i) for i in range(sent, upto)])
            sent = upto
            if sent == n_tokens:
                out += self.events.tail(api, rid, model, n_tokens, prompt_tokens)
            await conn.write_chunk(out)
        if n_tokens == 0:
            await conn.write_chunk(self.events.tail(api, rid, model, 0, prompt_tokens))
        self.counters.completed += 1
        self.counters.completion_tokens += n_tokens
        conn.end_stream(keep_alive)

    @staticmethod
    def _tail(chat: bool, prefix: bytes, head: bytes, finish: str, n_tokens: int, prompt_tokens: int,
              include_usage: bool, cached: int | None = None) -> bytes:
        reason = b'"finish_reason":"' + finish.encode() + b'"}]}\n\n'
        out = prefix + (b'},"logprobs":null,' if chat else b'"text":"","logprobs":null,') + reason
        if include_usage:
            details = b"" if cached is None else b',"prompt_tokens_details":{"cached_tokens":%d}' % cached
            out += (head + b',"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,'
                    b'"total_tokens":%d%s}}\n\n' % (prompt_tokens, n_tokens, prompt_tokens + n_tokens, details))
        return out + _DONE

    def _full_body(self, chat: bool, rid: str, model: str, n_tokens: int, prompt_tokens: int,
                   finish: str, cached: int | None = None) -> bytes:
        text = "".join(VOCAB[i % len(VOCAB)] for i in range(n_tokens))
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return _dumps({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens,
                      "total_tokens": prompt_tokens + n_tokens,
                      **({} if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}})},
        })

    # --- helpers ---------------------------------------------------------------------------
    def _max_tokens(self, body: dict[str, Any]) -> int:
        value = body.get("max_tokens", body.get("max_completion_tokens", body.get("max_output_tokens")))
        if value is None:
            return self.config.tokens
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadRequest("'max_tokens' must be a non-negative integer")
        return value

    @staticmethod
    def _body(raw: bytes) -> dict[str, Any]:
        try:
            body = _loads(raw)
        except ValueError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body


async def serve(config: FakeConfig, *, announce: bool = True) -> None:
    """Serve until cancelled; prints ``fake-backend listening on http://HOST:PORT`` once bound."""
    backend = FakeBackend(config)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(backend), config.host, config.port, backlog=4096,
                                      reuse_address=True)
    port = server.sockets[0].getsockname()[1]
    if announce:
        print(f"fake-backend listening on http://{config.host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def run(config: FakeConfig) -> int:
    try:
        import uvloop

        uvloop.run(serve(config))
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass
    return 0


# --- command line --------------------------------------------------------------------------
def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction between 0 and 1")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: pick a free one and print it)")
    parser.add_argument("--ttft-ms", type=_non_negative, default=100.0,
                        help="delay from getting a slot to the first content chunk (default 100)")
    parser.add_argument("--itl-ms", type=_non_negative, default=20.0,
                        help="delay between content chunks, one token each (default 20)")
    parser.add_argument("--slots", type=int, default=0,
                        help="requests generated at once; the rest wait in FIFO order (default: no limit)")
    parser.add_argument("--tokens", type=int, default=16,
                        help="output tokens when a request gives no max_tokens (default 16)")
    parser.add_argument("--model", default="fake-model", help="model id served (default fake-model)")
    parser.add_argument("--fail-rate", type=_fraction, default=0.0,
                        help="fraction of requests answered with HTTP 500 (or --fail-status)")
    parser.add_argument("--fail-status", type=int, default=500, choices=(429, 500, 502, 503),
                        help="the status of those failures (default 500; 429: a gateway shedding load)")
    parser.add_argument("--abort-rate", type=_fraction, default=0.0,
                        help="fraction of streams cut mid-stream (TCP close, no [DONE])")
    parser.add_argument("--seed", type=int, default=None, help="seed for the injected failures")
    parser.add_argument("--no-usage", dest="usage", action="store_false",
                        help="ignore stream_options.include_usage, like runtimes that lack it")
    parser.add_argument("--embedding-dim", type=int, default=64, help="embedding size (default 64)")
    parser.add_argument("--embed-batch", type=int, default=0, metavar="N",
                        help="refuse an input to embed longer than N tokens as llama-server does past its physical "
                             "batch, with a 500 (default 0: no limit)")
    parser.add_argument("--close-after-stream-ms", type=_non_negative, default=None, metavar="MS",
                        help="close the connection MS ms after each streamed answer, dropping requests "
                             "sent on it meanwhile (llama-server does so without notice)")
    parser.add_argument("--openai-only", action="store_true",
                        help="serve only the OpenAI routes (no /props, /slots, /metrics): a runtime that does not "
                             "say how many requests it runs at once")
    parser.add_argument("--prefix-cache", type=int, default=0, metavar="N",
                        help="act as if the last N prompts were cached: report the words a prompt shares "
                             "with one as usage.prompt_tokens_details.cached_tokens (default 0: off)")
    parser.add_argument("--fault", choices=FAULTS, default="",
                        help="misbehave on purpose (see passerelle/testing/faults.py); a request can also "
                             "ask with \"fake_fault\": NAME in its body")
    parser.add_argument("--fault-rate", type=_fraction, default=1.0,
                        help="fraction of requests that get --fault (default 1)")
    parser.add_argument("--fault-bytes", type=int, default=200 * 1024 * 1024,
                        help="size of huge-event, huge-body and huge-error (default 200 MiB)")
    parser.add_argument("--drip-ms", type=_non_negative, default=100.0,
                        help="pace of drip and continue-forever (default 100)")
    parser.add_argument("--bare-events", action="store_true",
                        help="Responses and Messages events without sequence numbers and indexes, as "
                             "llama-server's /v1/responses stream sends them")


def config_from_args(args: argparse.Namespace) -> FakeConfig:
    return FakeConfig(host=args.host, port=args.port, ttft_ms=args.ttft_ms, itl_ms=args.itl_ms,
                      slots=max(args.slots, 0), tokens=args.tokens, model=args.model,
                      fail_rate=args.fail_rate, fail_status=args.fail_status, abort_rate=args.abort_rate,
                      seed=args.seed,
                      usage=args.usage, embedding_dim=args.embedding_dim, embed_batch=max(args.embed_batch, 0),
                      close_after_stream_ms=args.close_after_stream_ms, prefix_cache=max(args.prefix_cache, 0),
                      openai_only=args.openai_only,
                      fault=args.fault, fault_rate=args.fault_rate, fault_bytes=args.fault_bytes,
                      drip_ms=args.drip_ms, bare_events=args.bare_events)


def _main(args: argparse.Namespace) -> int:
    return run(config_from_args(args))


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``fake-backend`` on the ``passerelle`` command line."""
    parser = subparsers.add_parser(
        "fake-backend", help="run a deterministic OpenAI-compatible runtime (tests, benchmarks)",
        description="A deterministic OpenAI-compatible runtime: set TTFT, inter-token latency, "
                    "slots, output length and injected failures.")
    _configure(parser)
    parser.set_defaults(func=_main)
    return parser


# --- Python API for tests: the fake in a subprocess ----------------------------------------
@dataclass
class FakeProcess:
    url: str
    process: subprocess.Popen[str]

    def stats(self) -> dict[str, int]:
        import urllib.request

        with urllib.request.urlopen(self.url + "/fake/stats", timeout=10) as resp:
            stats: dict[str, int] = _loads(resp.read())
            return stats

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_LISTENING = re.compile(r"listening on (http://\S+)")


@contextmanager
def start_fake_backend(timeout: float = 30.0, **options: Any) -> Iterator[FakeProcess]:
    """Run ``python -m passerelle.testing.fake_runtime`` on a free port; yields once ``/health`` answers.

    Options are the command-line flags with underscores (``ttft_ms=100, slots=4, usage=False``).
    """
    import urllib.request

    argv = [sys.executable, "-m", "passerelle.testing.fake_runtime", "--port", "0"]
    for key, value in options.items():
        if key == "usage":
            if not value:
                argv.append("--no-usage")
            continue
        if isinstance(value, bool):  # a flag
            argv += [f"--{key.replace('_', '-')}"] if value else []
            continue
        argv += [f"--{key.replace('_', '-')}", str(value)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    fake: FakeProcess | None = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the server has bound its port (or died)
        match = _LISTENING.search(line)
        if not match:
            raise RuntimeError(f"fake-backend did not start (exit {proc.poll()}): {line!r}")
        fake = FakeProcess(match.group(1), proc)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(fake.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.02)  # polling a condition, not waiting a fixed time
        yield fake
    finally:
        if fake is not None:
            fake.stop()
        elif proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="passerelle fake-backend", description=__doc__.split("\n")[0])
    _configure(parser)
    return _main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
