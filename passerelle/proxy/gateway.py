"""The life of one inference request, start to end, in one place.

    read body (capped) → parse the few fields the gateway needs → pick a backend
    → send upstream → relay (stream or body) → account: metrics, usage, one access-log line

The body passes through untouched, except that a streaming request that did not ask for
``stream_options.include_usage`` gets it added (so token counts come from the runtime), and the
usage chunk is removed again before it reaches that client.

Races worth knowing:

* The client may leave at any time. A watcher task waits on ASGI ``receive()`` for
  ``http.disconnect`` and cancels the request task; the upstream response is then closed, so the
  runtime sees its socket close and frees the slot. uvicorn also answers ``receive()`` with
  ``http.disconnect`` once the response is complete, so ``_finishing`` is set before the last
  ``send`` to tell the two apart.
* Response headers go out only once the runtime's status is known, so a runtime error before
  the first byte reaches the client with the runtime's status; after that, only an SSE error
  event can report it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from passerelle.config import ClassConfig, Config
from passerelle.errors import (
    BodyTooLarge,
    Cause,
    ClientDisconnect,
    GatewayError,
    InvalidRequest,
    Unauthorized,
    UpstreamError,
    UpstreamStatus,
)
from passerelle.observe.accesslog import AccessLog
from passerelle.observe.metrics import Metrics, observe_many
from passerelle.observe.record import RequestRecord, State, new_request_id
from passerelle.proxy.assemble import assemble
from passerelle.proxy.relay import StreamRelay, read_body
from passerelle.runtimes.catalogue import Catalogue
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.registry import Registry
from passerelle.scheduling.scheduler import Job, Scheduler
from passerelle.tenants.keys import ApiKey, KeyRing
from passerelle.tenants.limits import FailedAuthThrottle, Grant, KeyLimiter

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}
log = logging.getLogger("passerelle.proxy.gateway")

_REQUIRED = {"chat": "messages", "completions": "prompt", "embeddings": "input"}
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


async def read_request_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole body, refused as soon as it is known to exceed ``limit`` bytes."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                if int(value) > limit:
                    raise BodyTooLarge(limit)
            except ValueError:
                raise InvalidRequest("Content-Length is not a number.") from None
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientDisconnect("client left while sending the body")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not msg.get("more_body"):
            return b"".join(chunks)


def parse_request(body: bytes, endpoint: str) -> dict[str, Any]:
    """Validate the fields the gateway relies on; everything else is the runtime's business."""
    if not body.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}.") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    model = data.get("model")
    if model is None:
        raise InvalidRequest("Missing required parameter: 'model'.", param="model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' must be a non-empty string.", param="model")
    required = _REQUIRED[endpoint]
    value = data.get(required)
    if value is None:
        raise InvalidRequest(f"Missing required parameter: '{required}'.", param=required)
    if endpoint == "chat":
        if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
            raise InvalidRequest("'messages' must be a non-empty array of message objects.", param="messages")
    elif not isinstance(value, str | list):
        raise InvalidRequest(f"'{required}' must be a string or an array.", param=required)
    if "stream" in data and not isinstance(data["stream"], bool | None):
        raise InvalidRequest("'stream' must be a boolean.", param="stream")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        v = data.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (1 if key == "n" else 0)):
            raise InvalidRequest(f"'{key}' must be a non-negative integer.", param=key)
    so = data.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string.", param="user")
    return data


def with_usage_requested(body: bytes, data: dict[str, Any]) -> bytes:
    """``body`` with ``stream_options.include_usage = true`` (spliced in when absent, so the
    rest of the body keeps its exact bytes)."""
    if "stream_options" not in data:
        i = body.index(b"{")
        return body[: i + 1] + b'"stream_options":{"include_usage":true},' + body[i + 1 :]
    data = dict(data, stream_options=dict(data["stream_options"], include_usage=True))
    return orjson.dumps(data)


class _Collector:
    """An ASGI ``send`` that keeps the body, for answers assembled from a stream."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.parts.append(message.get("body", b""))


def header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


class Gateway:
    def __init__(self, cfg: Config, registry: Registry, metrics: Metrics, access_log: AccessLog,
                 scheduler: Scheduler, keyring: KeyRing | None = None) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.access_log = access_log
        self.scheduler = scheduler
        self.keyring = keyring
        self.limiter = KeyLimiter()
        self.auth_throttle = FailedAuthThrottle(cfg.auth.failed_attempts_per_minute)
        self.classes = {c.name: c for c in cfg.classes}
        self._retry_budget = 10.0  # retries allowed now; refilled by 0.2 per request
        self.catalogue = Catalogue((), registry)  # model names -> pools; the app sets the configured one
        # Called with a pool none of whose replicas is up: starts an on-demand runtime.
        self.on_demand: Callable[[list[Backend]], None] | None = None
        # Called with every finished request's record (usage store, the dashboard's window).
        self.listeners: list[Callable[[RequestRecord], None]] = []

    # -- who is asking, and how urgent ---------------------------------------------------------
    def authenticate(self, scope: Scope, rec: RequestRecord) -> ApiKey | None:
        """The caller's key; None when keys are not in use. Raises Unauthorized / RateLimited."""
        ring = self.keyring
        if ring is None:
            return None
        ring.refresh()
        if not (ring.any or self.cfg.auth.required):
            return None
        self.auth_throttle.check(rec.client)
        value = header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        key = ring.lookup(token.strip()) if scheme.lower() == "bearer" and token else None
        if key is None:
            self.auth_throttle.failed(rec.client)
            raise Unauthorized("Missing or invalid API key. Send 'Authorization: Bearer <key>'.")
        return key

    def priority_class(self, scope: Scope, key: ApiKey | None) -> ClassConfig:
        """The key's class (or the anonymous one), lowered by X-Priority, raised only up to the
        key's ``max_priority``."""
        auth = self.cfg.auth
        base = self.classes[(key.priority if key and key.priority in self.classes else None)
                            or auth.anonymous_priority]
        ceiling = self.classes[(key.max_priority if key and key.max_priority in self.classes else None)
                               or (base.name if key else auth.anonymous_max_priority)]
        asked = header(scope, b"x-priority")
        if not asked:
            return base
        wanted = self.classes.get(asked.strip().lower())
        if wanted is None:
            raise InvalidRequest(f"X-Priority must be one of: {', '.join(self.classes)}.", param="X-Priority")
        if wanted.rank < min(ceiling.rank, base.rank):
            return ceiling if ceiling.rank < base.rank else base
        return wanted

    def affinity_key(self, scope: Scope, data: dict[str, Any], endpoint: str) -> str:
        """What keeps related requests on one replica: a session header, else the chat's opening
        (system prompt and first user message, shared by every turn, so llama-server's prompt
        cache is reused), else the OpenAI ``user``."""
        r = self.cfg.routing
        session = header(scope, r.session_header.lower().encode()) if r.session_header else None
        if session:
            return "s:" + session
        if r.prefix_affinity and endpoint == "chat":
            opening = []
            for m in data["messages"]:
                opening.append(m)
                if m.get("role") == "user":
                    break
            return "p:" + hashlib.blake2b(orjson.dumps(opening), digest_size=12).hexdigest()
        return "u:" + data["user"] if isinstance(data.get("user"), str) else ""

    # -- the request's life ----------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        client = scope.get("client")
        rec = RequestRecord(id=new_request_id(), endpoint=endpoint, client=client[0] if client else "")
        started = False  # response headers sent to the client
        finishing = False
        task = asyncio.current_task()
        assert task is not None
        disconnected = False
        watcher: asyncio.Task[None] | None = None
        job: Job | None = None
        grant: Grant | None = None

        async def watch() -> None:
            nonlocal disconnected
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    if not finishing:
                        disconnected = True
                        task.cancel()
                    return

        def mark_finishing() -> None:  # before the last send: see "Races" at the top
            nonlocal finishing
            finishing = True

        async def start(status: int, extra: list[tuple[bytes, bytes]]) -> None:
            nonlocal started
            started = True
            await send({"type": "http.response.start", "status": status,
                        "headers": [*extra, (b"x-request-id", rec.id.encode())]})

        try:
            body = await read_request_body(scope, receive, self.cfg.server.max_body_bytes)
            watcher = asyncio.create_task(watch())
            key = self.authenticate(scope, rec)
            data = parse_request(body, endpoint)
            rec.model = data["model"]
            rec.stream = bool(data.get("stream")) and endpoint != "embeddings"
            cls = self.priority_class(scope, key)
            rec.priority = cls.name
            if key is not None:
                rec.tenant = key.tenant
            elif data.get("user"):
                rec.tenant = data["user"]
            # Model catalogue (runtimes/catalogue.py): name or alias -> public name, pool, served name;
            # parameter defaults/overrides applied; a fallback model when the pool cannot serve in time.
            route = self.catalogue.resolve(rec.model, endpoint, data, body, wait_s=cls.max_queue_wait_s)
            rec.model, pool, data, body = route.name, route.pool, route.data, route.body
            rec.max_tokens = data.get("max_completion_tokens") or data.get("max_tokens")
            est_prompt = len(body) // 4  # about 4 bytes of JSON per token; corrected by usage
            est_output = 0 if endpoint == "embeddings" else (rec.max_tokens or 256)
            if key is not None:
                grant = self.limiter.admit(key, est_prompt + est_output)
            job = Job(pool=pool, cls=cls, tenant=rec.tenant, model=rec.model, weight=key.weight if key else 1.0,
                      est_prompt_tokens=est_prompt, est_output_tokens=est_output,
                      can_wait_for_start=any(b.supervised for b in pool),
                      affinity=self.affinity_key(scope, data, endpoint) if len(pool) > 1 else "")
            if self.on_demand is not None and not any(b.stats.up for b in pool):
                self.on_demand(pool)
            rec.t_queued = time.perf_counter()
            rec.to(State.QUEUED)
            self._retry_budget = min(10.0, self._retry_budget + 0.2)
            deadline = rec.t_arrival + self.cfg.timeouts.total_s
            while True:
                backend = await self.scheduler.acquire(job)
                rec.backend = backend.name
                rec.t_dispatch = time.perf_counter()
                rec.to(State.DISPATCHED)
                running = self.metrics.running.labels(backend.name, rec.model)
                running.inc()
                try:
                    await self._attempt(backend, rec, data, body, endpoint, cls, deadline, send, start,
                                        mark_finishing)
                    break
                except UpstreamError as err:
                    if started or not self._may_retry(err, job, rec, deadline):
                        raise
                    log.warning("request %s: %s; retrying on another replica", rec.id, err.message)
                    backend.record_failure(time.monotonic())
                    job.exclude.add(backend.name)
                    rec.retries += 1
                    self.scheduler.release(job)
                    rec.to(State.QUEUED)
                finally:
                    running.dec()
            if backend.failures:
                backend.record_success()
            rec.finish(Cause.OK, 200)
        except asyncio.CancelledError:
            if not disconnected:
                raise
            task.uncancel()
            rec.finish(Cause.CLIENT_DISCONNECT, 499, "client disconnected")
        except GatewayError as err:
            rec.finish(err.cause, err.status, err.message)
            if not isinstance(err, ClientDisconnect):
                finishing = True
                await self._report(send, rec, err, started=started)
        except Exception:
            log.exception("request %s failed inside the gateway", rec.id)
            rec.finish(Cause.UPSTREAM_ERROR, 500, "internal error")
            finishing = True
            await self._report(send, rec, GatewayError("Internal error in the gateway; see its log."),
                               started=started)
        finally:
            if watcher is not None:
                watcher.cancel()
            if rec.cause is None:  # an unexpected exception: still one cause, one log line
                rec.finish(Cause.UPSTREAM_ERROR, 500, "internal error")
            used = None if rec.completion_tokens is None else (rec.prompt_tokens or 0) + rec.completion_tokens
            if job is not None:
                self.scheduler.release(job, prompt_tokens=rec.prompt_tokens, completion_tokens=rec.completion_tokens)
            if grant is not None:
                self.limiter.finish(grant, used)
            self.account(rec)

    def _may_retry(self, err: UpstreamError, job: Job, rec: RequestRecord, deadline: float) -> bool:
        """Retry on another replica only before the client got a byte, for a runtime that could
        not be reached or said 503/429, within the total timeout and the retry budget."""
        if not err.retryable or rec.retries >= 2 or time.perf_counter() >= deadline - 0.5:
            return False
        if all(b.name in job.exclude or b.name == rec.backend for b in job.pool):
            return False
        if self._retry_budget < 1.0:  # a bounded share of the traffic, so retries never snowball
            return False
        self._retry_budget -= 1.0
        return True

    async def _attempt(self, backend: Backend, rec: RequestRecord, data: dict[str, Any], body: bytes,
                       endpoint: str, cls: ClassConfig, deadline: float, send: Send,
                       start: Callable[[int, list[tuple[bytes, bytes]]], Awaitable[None]],
                       mark_finishing: Callable[[], None]) -> None:
        """One try on one replica. Response headers go out only when the first byte does, so a
        replica that fails before that can be replaced without the client noticing."""
        strip_usage = False
        collect = not rec.stream and backend.stream_always and endpoint != "embeddings"
        if collect:
            body = orjson.dumps({**data, "stream": True, "stream_options": {"include_usage": True}})
        elif rec.stream and not (data.get("stream_options") or {}).get("include_usage"):
            body, strip_usage = with_usage_requested(body, data), True
        body = backend.prepare(body, cls.rank)
        resp = await backend.post(f"/v1/{'chat/completions' if endpoint == 'chat' else endpoint}", body,
                                  request_id=rec.id)
        try:
            if resp.status != 200:
                raw = await read_body(resp, rec, self.cfg.timeouts, deadline)
                raise UpstreamStatus(resp.status, raw, resp.headers.get("Content-Type", "").encode())
            if rec.stream:
                relay = StreamRelay(rec, send, self.cfg.timeouts, strip_usage=strip_usage,
                                    before_first=lambda: start(200, _SSE_HEADERS), on_done=mark_finishing)
                await relay.run(resp, deadline)
                mark_finishing()
                with contextlib.suppress(OSError):  # the client may hang up once it has [DONE]
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if collect:
                sink = _Collector()
                await StreamRelay(rec, sink, self.cfg.timeouts, strip_usage=False).run(resp, deadline)
                raw = assemble(b"".join(sink.parts), endpoint)
                ctype = b"application/json"
            else:
                raw = await read_body(resp, rec, self.cfg.timeouts, deadline)
                ctype = resp.headers.get("Content-Type", "application/json").encode()
            await start(200, [(b"content-type", ctype), (b"content-length", str(len(raw)).encode())])
            mark_finishing()
            await send({"type": "http.response.body", "body": raw, "more_body": False})
        finally:
            resp.close()  # drops the connection if unread: the runtime stops generating

    async def _report(self, send: Send, rec: RequestRecord, err: GatewayError, *, started: bool) -> None:
        """Tell the client: an OpenAI error response, or an SSE error event once streaming began."""
        with contextlib.suppress(OSError):
            if not started:
                await self._send_error(send, rec, err)
            else:
                await send({"type": "http.response.body", "body": err.sse_event(), "more_body": False})

    async def _send_error(self, send: Send, rec: RequestRecord, err: GatewayError) -> None:
        body = err.body()
        ctype = err.content_type if isinstance(err, UpstreamStatus) and err.content_type else b"application/json"
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", rec.id.encode()), *err.headers()]
        await send({"type": "http.response.start", "status": err.status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def account(self, rec: RequestRecord) -> None:
        m = self.metrics
        model = rec.model if self.catalogue.serves(rec.model) else "unknown"
        m.count_request(model, rec.priority, rec.cause.value, rec.tenant)  # type: ignore[union-attr]
        if rec.t_queued and m.enabled:
            if m.tenant_label:
                m.queue_wait.labels(model, rec.priority, m.tenant(rec.tenant)).observe(rec.queue_wait)
            else:
                m.queue_wait.labels(model, rec.priority).observe(rec.queue_wait)
        if rec.backend:
            ttft, itl, tpot, e2e, ptok, gtok = m.request_children(rec.backend, model, rec.priority, rec.tenant)
            if rec.cause is Cause.OK and m.enabled:  # [metrics] enabled = false: no histograms
                e2e.observe(rec.duration)
                if rec.ttft is not None:
                    ttft.observe(rec.ttft)
                observe_many(itl, rec.gaps)  # one bucket update per bucket, not per token
                n = rec.output_tokens
                if rec.stream and n > 1 and rec.ttft is not None:
                    tpot.observe((rec.t_end - rec.t_first) / (n - 1))
            if rec.prompt_tokens:
                ptok.inc(rec.prompt_tokens)
            if rec.completion_tokens:
                gtok.inc(rec.completion_tokens)
        self.access_log.write(rec)
        for listener in self.listeners:
            listener(rec)
