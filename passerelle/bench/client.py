"""One streamed request, timed: send, scan the SSE stream, record TTFT, chunk gaps and usage.

Definitions (DESIGN): TTFT runs from the moment the request is sent to the arrival of the first
chunk with content (a role-only or empty chunk does not count); ITL is the gap between content
chunks; e2e ends when the stream ends. "Sent" is when the request body is handed to the socket
(reported by aiohttp's ``on_request_chunk_sent`` trace), not when the coroutine asked for it: on
Python 3.11 aiohttp writes the body from a separate task, and under load that task runs
milliseconds later — the generator's delay, not the server's. A fresh connection's set-up is
outside the clock for the same reason. Token counts come from the server's ``usage`` when it sends
one, otherwise from the number of content chunks.

What the runtime says it took from its prompt cache is kept per request for the cache check
(``bench.cache``): ``usage.prompt_tokens_details.cached_tokens`` (OpenAI's field; llama-server and
vLLM with ``--enable-prompt-tokens-details`` send it), else llama-server's ``timings.cache_n``
(tokens reused) and ``timings.prompt_n`` (tokens evaluated) from the stream's last chunk.

The stream is scanned as bytes: a content chunk is recognised in place, without decoding its
JSON, by the same definition the gateway's relay uses (passerelle/chunks.py: a ``"content":"x``,
``"text"`` or reasoning field with a non-empty string, or a tool call). JSON inside a string
escapes its quotes, so generated text cannot fake the pattern. Only the rare chunks without
content (role, finish, usage, error) are decoded.

The Responses and Anthropic Messages APIs (``--api responses|messages``) say it in their own
events (chunks.py again): a content event is ``response.*.delta`` or a ``text``/``thinking``/
``input_json`` delta; ``response.completed`` and ``message_stop`` end the stream; usage is
``input_tokens``/``output_tokens`` (in ``response.completed``, or ``message_start`` plus
``message_delta``).
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from passerelle.chunks import PATTERNS

_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_END_TYPES = ("response.completed", "response.incomplete", "message_stop")
_ERROR_TYPES = ("error", "response.failed")


def api_of(url: str) -> str:
    """The API a request URL speaks: ``responses``, ``messages``, else OpenAI chunks."""
    tail = url.rstrip("/").rsplit("/", 1)[-1]
    return tail if tail in ("responses", "messages") else "chat"


@dataclass(slots=True)
class RequestResult:
    """The measurement of one request (times in seconds, ``perf_counter`` clock)."""

    cls: str | None = None
    ok: bool = False
    error: str | None = None  # kind: http_500, connect, timeout, stream_aborted, stream_error, no_content...
    detail: str = ""
    t_send: float = 0.0
    t_done: float = 0.0
    t_written: float = 0.0  # set by the trace hook when the body reaches the socket
    retries: int = 0  # re-sent after a pooled connection turned out closed
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0  # content chunks
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage: bool = False  # output_tokens came from the server's usage
    max_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens the runtime says came from its cache
    cache_source: str | None = None  # "usage" (prompt_tokens_details) or "timings" (llama-server)
    prompt_evaluated: int | None = None  # llama-server's timings.prompt_n: prompt tokens computed
    turn: int = 0  # 0: the first request of a conversation (later turns share its history on purpose)

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


class StreamScanner:
    """Feeds on raw bytes as they arrive; splits SSE events and classifies them."""

    __slots__ = ("buf", "cache_n", "cached_tokens", "chunks", "content", "done", "error", "finished", "first", "itl",
                 "last", "prompt_n", "prompt_tokens", "sep", "usage_tokens")

    def __init__(self, api: str = "chat") -> None:
        self.content = PATTERNS[api]  # what marks a content event, matched in place
        self.buf = b""
        self.sep: bytes | None = None
        self.first: float | None = None
        self.last = 0.0
        self.itl: list[float] = []
        self.chunks = 0
        self.usage_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.cache_n: int | None = None
        self.prompt_n: int | None = None
        self.done = False
        self.finished = False
        self.error: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        buf = self.buf + data if self.buf else data
        if self.sep is None:
            # Servers end events with a blank line, "\n\n" or (rarely) "\r\n\r\n".
            if b"\r\n\r\n" in buf:
                self.sep = b"\r\n\r\n"
            elif b"\n\n" in buf:
                self.sep = b"\n\n"
            else:
                self.buf = buf
                return
        sep = self.sep
        step = len(sep)
        search = self.content.search
        start = 0
        # The hot loop: a content event is found in place (no slice, no call) and counted.
        while (end := buf.find(sep, start)) >= 0:
            if search(buf, start, end):
                self.chunks += 1
                if self.first is None:
                    self.first = now
                else:
                    self.itl.append(now - self.last)
                self.last = now
                # a few servers put usage (or llama-server's timings) on a content chunk
                if buf.find(b'"usage"', start, end) >= 0 or buf.find(b'"timings"', start, end) >= 0:
                    self._other(buf[start:end], usage_only=True)
            else:
                self._other(buf[start:end])
            start = end + step
        self.buf = buf[start:]

    def _other(self, event: bytes, usage_only: bool = False) -> None:
        """An event without generated text: role, finish, usage, error, [DONE], comment."""
        if event.startswith(b"data: "):
            payload = event[6:]
        elif event.startswith(b"data:"):
            payload = event[5:]
        else:  # comments (": ping"), "event:" lines before the data line
            i = event.find(b"\ndata:")
            if i < 0:
                return
            payload = event[i + 6:].lstrip()
        if payload.startswith(b"[DONE]"):
            self.done = True
        elif not usage_only or _USAGE.search(payload) or b'"timings"' in payload:
            self._decode(payload)

    def _decode(self, payload: bytes) -> None:
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.error = "invalid_json"
            return
        if not isinstance(obj, dict):
            return
        kind = obj.get("type")
        if obj.get("error") or kind in _ERROR_TYPES:
            self.error = "stream_error"
        if kind in _END_TYPES:
            self.done = True
        usage = obj.get("usage")
        if not isinstance(usage, dict):  # Responses' last event, Anthropic's message_start
            inner = obj.get("response") or obj.get("message")
            usage = inner.get("usage") if isinstance(inner, dict) else None
        if isinstance(usage, dict):
            completion = usage.get("completion_tokens", usage.get("output_tokens"))
            prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
            if isinstance(completion, int):
                self.usage_tokens = completion
            if isinstance(prompt, int):
                # Anthropic counts cached input apart
                self.prompt_tokens = prompt + sum(v for k in ("cache_read_input_tokens", "cache_creation_input_tokens")
                                                  if isinstance(v := usage.get(k), int))
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.cached_tokens = details["cached_tokens"]
            elif isinstance(usage.get("cache_read_input_tokens"), int):
                self.cached_tokens = usage["cache_read_input_tokens"]
        timings = obj.get("timings")
        if isinstance(timings, dict):
            if isinstance(timings.get("cache_n"), int):
                self.cache_n = timings["cache_n"]
            if isinstance(timings.get("prompt_n"), int):
                self.prompt_n = timings["prompt_n"]
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict) and choice.get("finish_reason"):
                self.finished = True


def _error_kind(exc: BaseException, got_response: bool) -> str:
    import aiohttp

    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "stream_aborted"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | ConnectionError):
        return "stream_aborted" if got_response else "disconnected"
    return "client_error"


async def send(session: Any, url: str, body: dict[str, Any], headers: dict[str, str],
               cls: str | None = None, timeout: float | None = None) -> RequestResult:
    """Send one streaming request and measure it; never raises for HTTP or network failures.

    A request that dies on a pooled connection before any response byte is sent once more on a
    fresh one: servers close keep-alive connections at will (llama-server closes one after most
    streamed answers) and a request can be written just before the close reaches us. The server
    never saw it, so the retry is not a second request; ``retries`` counts them.
    """
    data = orjson.dumps(body)  # encoded before the clock starts: encoding is not the server's time
    # vLLM refuses a body without this header (415); aiohttp labels bytes as octet-stream
    headers = {"Content-Type": "application/json", **headers}
    result = RequestResult(cls=cls, max_tokens=body.get("max_tokens", body.get("max_output_tokens", 0)))
    api = api_of(url)
    for attempt in range(STALE_RETRIES + 1):
        result.t_written = 0.0
        scan = StreamScanner(api)
        asked = time.perf_counter()
        # the retry goes out on a new connection: the others in the pool may be closing too
        via = session if attempt == 0 else getattr(session, "fresh", session)
        stale = await _attempt(via, url, data, headers, timeout, result, scan, attempt < STALE_RETRIES)
        if not stale:
            break
        result.retries += 1
    end = time.perf_counter()
    if result.t_done:  # an HTTP error answer, already complete
        return result
    t0 = result.t_written or asked  # no trace (session without it, or failed before sending)
    result.t_send = t0
    result.t_done = end
    result.chunks = scan.chunks
    result.itl = scan.itl
    result.prompt_tokens = scan.prompt_tokens
    result.prompt_evaluated = scan.prompt_n
    if scan.cached_tokens is not None:
        result.cached_tokens, result.cache_source = scan.cached_tokens, "usage"
    elif scan.cache_n is not None:
        result.cached_tokens, result.cache_source = scan.cache_n, "timings"
    if scan.first is not None:
        result.ttft = scan.first - t0
    if result.error is None:
        if scan.error:
            result.error = scan.error
        elif scan.sep is None and scan.buf:
            result.error = "not_streamed"  # a 200 answer without any SSE event (stream ignored?)
            result.detail = scan.buf[:200].decode("utf-8", "replace")
        elif not scan.done and not scan.finished:
            result.error = "stream_incomplete"  # closed cleanly but without its end ([DONE], finish_reason...)
        elif scan.chunks == 0:
            result.error = "no_content"  # TTFT is undefined without a single content chunk
    if result.error is None:
        result.ok = True
        result.e2e = end - t0
    if scan.usage_tokens is not None:
        result.output_tokens, result.usage = scan.usage_tokens, True
    else:
        result.output_tokens = scan.chunks
    return result


STALE_RETRIES = 1


async def _attempt(session: Any, url: str, data: bytes, headers: dict[str, str], timeout: float | None,
                   result: RequestResult, scan: StreamScanner, may_retry: bool) -> bool:
    """One try; True when it failed on a stale pooled connection and may be retried."""
    import aiohttp

    got_response = False
    asked = time.perf_counter()
    try:
        async with session.post(url, data=data, headers=headers, trace_request_ctx=result,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            got_response = True
            if resp.status != 200:
                text = await resp.read()
                result.error = f"http_{resp.status}"
                result.detail = _error_message(text)
                result.t_send = result.t_written or asked
                result.t_done = time.perf_counter()
                return False
            content = resp.content
            while True:
                chunk = await content.readany()
                if not chunk:
                    break
                scan.feed(chunk, time.perf_counter())
    except (TimeoutError, aiohttp.ClientError, ConnectionError) as exc:
        stale = (not got_response and not isinstance(exc, aiohttp.ClientConnectorError)
                 and isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError | ConnectionResetError))
        if stale and may_retry:
            return True
        result.error = _error_kind(exc, got_response)
        result.detail = f"{type(exc).__name__}: {exc}"[:300]
    return False


class HttpClient:
    """The benchmark's HTTP client: a keep-alive pool sized by the caller, and a session without
    keep-alive for re-sending after a stale connection. Both stamp body writes (``trace_config``)."""

    def __init__(self, limit: int) -> None:
        import aiohttp

        def session(connector: Any) -> Any:
            return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                         read_bufsize=1 << 16, trace_configs=[trace_config()])

        self.pooled = session(aiohttp.TCPConnector(limit=limit, limit_per_host=0, ttl_dns_cache=300,
                                                   keepalive_timeout=120))
        self.fresh = session(aiohttp.TCPConnector(limit=0, force_close=True))

    def post(self, *args: Any, **kwargs: Any) -> Any:
        return self.pooled.post(*args, **kwargs)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self.pooled.get(*args, **kwargs)

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pooled.close()
        await self.fresh.close()


def trace_config() -> Any:
    """The aiohttp trace that stamps when each request's body reaches the socket."""
    import aiohttp

    async def on_chunk_sent(session: Any, ctx: Any, params: Any) -> None:
        result = ctx.trace_request_ctx
        if isinstance(result, RequestResult) and not result.t_written:
            result.t_written = time.perf_counter()

    config = aiohttp.TraceConfig()
    config.on_request_chunk_sent.append(on_chunk_sent)
    return config


def _error_message(body: bytes) -> str:
    try:
        obj = orjson.loads(body)
        return str(obj["error"]["message"])[:300]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:300].decode("utf-8", "replace")


async def get_json(session: Any, url: str, headers: dict[str, str], timeout: float = 10.0) -> Any | None:
    """GET a JSON document; ``None`` when it is missing or unreadable (probing optional endpoints)."""
    status, doc = await get_json_status(session, url, headers, timeout)
    return doc if status == 200 else None


async def get_json_status(session: Any, url: str, headers: dict[str, str],
                          timeout: float = 10.0) -> tuple[int | None, Any | None]:
    """GET a JSON document: the HTTP status (``None``: no answer) and the document (``None`` when
    unreadable)."""
    import aiohttp

    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body = await resp.read()
            try:
                return resp.status, orjson.loads(body)
            except orjson.JSONDecodeError:
                return resp.status, None
    except (TimeoutError, aiohttp.ClientError, ConnectionError):
        return None, None
