"""The life of one inference request, start to end, in one place.

    read body (capped) → parse the few fields the gateway needs → admit → queue for a replica
    → one attempt (attempt.py: send upstream, relay the stream or take the body, within the
      request's deadline, deadline.py) → retry elsewhere before the first byte (retry.py)
    → release the slot and the key's concurrency → report an error → account: metrics, usage,
      one access-log line (all in ``handle``'s finally: nothing a client or runtime does skips it)

The body passes through untouched, except that a streaming request that did not ask for
``stream_options.include_usage`` gets it added (so token counts come from the runtime), and the
usage chunk is removed again before it reaches that client.

Races worth knowing:

* The client may leave at any time. A watcher task waits on ASGI ``receive()`` for
  ``http.disconnect`` and cancels the request task; the upstream response is then closed, so the
  runtime sees its socket close and frees the slot. uvicorn also answers ``receive()`` with
  ``http.disconnect`` once the response is complete, so ``Exchange.finishing`` is set before the
  last ``send`` to tell the two apart (exchange.py keeps the request's flags).
* Response headers go out only once the runtime's status is known, so a runtime error before
  the first byte reaches the client with the runtime's status; after that, only an SSE error
  event can report it.
* A client may also stop reading. Every write to it is watched (``Exchange.send``); once a
  second ``_watch_writes`` cuts the clients that took nothing for ``client_write_s``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson

from passerelle.config import ClassConfig, Config
from passerelle.errors import (
    BodyTooLarge,
    Cause,
    ClientDisconnect,
    ClientTimeout,
    GatewayError,
    InternalError,
    InvalidRequest,
    Unauthorized,
    UnknownModel,
    UpstreamError,
)
from passerelle.observe.accesslog import AccessLog
from passerelle.observe.metrics import Metrics, observe_many
from passerelle.observe.record import RequestRecord, State
from passerelle.proxy.attempt import fetch, outcome_of
from passerelle.proxy.deadline import Deadline
from passerelle.proxy.exchange import Exchange, Receive, Scope, Send, header
from passerelle.proxy.retry import RetryBudget, may_retry
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.registry import Registry
from passerelle.scheduling.scheduler import Job, Scheduler
from passerelle.tenants.keys import ApiKey, KeyRing
from passerelle.tenants.limits import FailedAuthThrottle, Grant, KeyLimiter

log = logging.getLogger("passerelle.proxy.gateway")

_REQUIRED = {"chat": "messages", "completions": "prompt", "embeddings": "input"}

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
    for key in ("max_tokens", "max_completion_tokens", "n", "best_of"):
        v = data.get(key)
        least = 0 if key.startswith("max_") else 1
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < least):
            raise InvalidRequest(f"'{key}' must be {'a non-negative' if least == 0 else 'a positive'} integer.",
                                 param=key)
    so = data.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidRequest("'stream_options' must be an object.", param="stream_options")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string.", param="user")
    return data


def output_estimate(data: dict[str, Any], endpoint: str) -> int:
    """Tokens the request may generate, for admission (tokens per minute) and fair share: the
    length limit (``max_completion_tokens``, else ``max_tokens``, else 256) times the sequences
    generated (``n``, and ``best_of`` which generates that many to return ``n``).

    >>> output_estimate({"max_tokens": 500, "n": 1000}, "chat")
    500000
    """
    if endpoint == "embeddings":
        return 0
    length = data.get("max_completion_tokens") or data.get("max_tokens") or 256
    sequences = max(data.get("n") or 1, data.get("best_of") or 1)
    return int(length) * int(sequences)


def with_usage_requested(body: bytes, data: dict[str, Any]) -> bytes:
    """``body`` with ``stream_options.include_usage = true`` (spliced in when absent, so the
    rest of the body keeps its exact bytes)."""
    if "stream_options" not in data:
        i = body.index(b"{")
        return body[: i + 1] + b'"stream_options":{"include_usage":true},' + body[i + 1 :]
    data = dict(data, stream_options=dict(data["stream_options"], include_usage=True))
    return orjson.dumps(data)


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
        self.retry_budget = RetryBudget(ratio=0.2, cap=10.0)
        # Requests in progress, for the watchdog that cuts clients which stopped reading.
        self._live: set[Exchange] = set()
        self._watchdog: asyncio.TimerHandle | None = None
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
        ex = Exchange(scope, receive, send, endpoint)
        rec = ex.rec
        job: Job | None = None
        grant: Grant | None = None
        failure: GatewayError | None = None
        self._live.add(ex)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(1.0, self._watch_writes)
        try:
            try:
                body = await read_request_body(scope, receive, self.cfg.server.max_body_bytes)
                ex.watch()
                key = self.authenticate(scope, rec)
                data = parse_request(body, endpoint)
                rec.model = data["model"]
                rec.stream = bool(data.get("stream")) and endpoint != "embeddings"
                rec.max_tokens = data.get("max_completion_tokens") or data.get("max_tokens")
                cls = self.priority_class(scope, key)
                rec.priority = cls.name
                if key is not None:
                    rec.tenant = key.tenant
                elif data.get("user"):
                    rec.tenant = data["user"]
                pool = self.registry.pool(rec.model, endpoint)
                if pool is None:
                    raise UnknownModel(rec.model, self.registry.models)
                if not pool:
                    raise InvalidRequest(f"The model '{rec.model}' is not served on /v1/{endpoint}.", param="model")
                est_prompt = len(body) // 4  # about 4 bytes of JSON per token; corrected by usage
                est_output = output_estimate(data, endpoint)
                if key is not None:
                    grant = self.limiter.admit(key, est_prompt + est_output)
                job = Job(pool=pool, cls=cls, tenant=rec.tenant, model=rec.model,
                          weight=key.weight if key else 1.0,
                          est_prompt_tokens=est_prompt, est_output_tokens=est_output,
                          can_wait_for_start=any(b.supervised for b in pool),
                          affinity=self.affinity_key(scope, data, endpoint) if len(pool) > 1 else "")
                if self.on_demand is not None and not any(b.stats.up for b in pool):
                    self.on_demand(pool)
                await self._dispatch(ex, job, data, body, cls)
                rec.finish(Cause.OK, 200)
            except asyncio.CancelledError:
                if not ex.take_cancel():
                    raise
                ex.task.uncancel()
                failure = (ClientTimeout("The client took no bytes in time; its connection was cut.") if ex.stalled
                           else ClientDisconnect("client disconnected"))
            except GatewayError as err:
                failure = err
                if isinstance(err, ClientTimeout):
                    ex.cut()
            except Exception:
                log.exception("request %s failed inside the gateway", rec.id)
                failure = InternalError("Internal error in the gateway; see its log.")
            finally:
                # The one place where a request gives back what it holds, whatever happened above (a
                # cancel, a bug): before the client is told anything, so that no write to a client
                # that does not read can keep a slot.
                if failure is not None:
                    rec.finish(failure.cause, failure.status, failure.message)
                elif rec.cause is None:  # cancelled by the server itself (shutdown)
                    rec.finish(Cause.INTERNAL_ERROR, 500, "cancelled by the gateway")
                self._release(rec, job, grant)
            if failure is not None and not isinstance(failure, ClientDisconnect | ClientTimeout):
                await ex.report(failure)  # watched: a client that takes nothing is cut (watchdog)
        except asyncio.CancelledError:
            if not ex.take_cancel():
                raise
            ex.task.uncancel()  # the client left or stopped reading during our error: the cause stays
        finally:
            self._live.discard(ex)
            # (an exception kept in a local would keep this frame, and all it holds, in a reference
            # cycle through its traceback until the cyclic collector runs)
            failure = None
            try:
                ex.close()
            finally:
                self.account(rec)  # one line, one cause, one usage row: whatever happened above

    def _release(self, rec: RequestRecord, job: Job | None, grant: Grant | None) -> None:
        used = None if rec.completion_tokens is None else (rec.prompt_tokens or 0) + rec.completion_tokens
        if job is not None:
            self.scheduler.release(job, prompt_tokens=rec.prompt_tokens, completion_tokens=rec.completion_tokens)
        if grant is not None:
            self.limiter.finish(grant, used)

    def _watch_writes(self) -> None:
        """Once a second: cut every client that has taken no byte for ``client_write_s`` while a
        write to it waited (one timer for all requests rather than one per write)."""
        self._watchdog = None
        if not self._live:
            return
        loop = asyncio.get_running_loop()
        horizon = loop.time() - self.cfg.timeouts.client_write_s
        for ex in [ex for ex in self._live if 0.0 < ex.writing_since <= horizon]:
            log.warning("request %s: the client took no bytes for %g s; cutting its connection", ex.rec.id,
                        self.cfg.timeouts.client_write_s)
            ex.stall()
        self._watchdog = loop.call_later(1.0, self._watch_writes)

    async def _dispatch(self, ex: Exchange, job: Job, data: dict[str, Any], body: bytes, cls: ClassConfig) -> None:
        """Queue for a replica and try it; before the client got a byte, a replica that could not
        take the request is replaced by another (within the retry budget). Each attempt reports
        its outcome to its replica's circuit breaker exactly once."""
        rec = ex.rec
        rec.t_queued = time.perf_counter()
        rec.to(State.QUEUED)
        self.retry_budget.deposit()
        deadline = Deadline(self.cfg.timeouts, rec.t_arrival)
        while True:
            job.max_wait_s = deadline.left_s  # the queue wait is within the total time too
            backend = await self.scheduler.acquire(job)
            rec.backend = backend.name
            rec.t_dispatch = time.perf_counter()
            rec.to(State.DISPATCHED)
            running = self.metrics.running.labels(backend.name, rec.model)
            running.inc()
            error: BaseException | None = None
            try:
                await self._attempt(ex, backend, data, body, cls, deadline)
                return
            except BaseException as err:
                error = err
                if not isinstance(err, UpstreamError) or not may_retry(
                        retryable=err.retryable, started=ex.started, retries=rec.retries,
                        others_left=any(b.name not in job.exclude and b is not backend for b in job.pool),
                        time_left_s=deadline.left_s, budget=self.retry_budget):
                    raise
                log.warning("request %s: %s; retrying on another replica", rec.id, err.message)
                job.exclude.add(backend.name)
                rec.retries += 1
                self.scheduler.release(job)
                rec.to(State.QUEUED)
            finally:
                running.dec()
                backend.breaker.record(outcome_of(error), probe=job.probe, now=self.scheduler.clock())
                job.probe = False
                error = None  # (no reference cycle through the exception's traceback: see handle)

    async def _attempt(self, ex: Exchange, backend: Backend, data: dict[str, Any], body: bytes,
                       cls: ClassConfig, deadline: Deadline) -> None:
        """One try on one replica. Response headers go out only when the first byte does, so a
        replica that fails before that can be replaced without the client noticing."""
        rec, endpoint = ex.rec, ex.rec.endpoint
        strip_usage = False
        collect = not rec.stream and backend.stream_always and endpoint != "embeddings"
        if collect:
            body = orjson.dumps({**data, "stream": True, "stream_options": {"include_usage": True}})
        elif rec.stream and not (data.get("stream_options") or {}).get("include_usage"):
            body, strip_usage = with_usage_requested(body, data), True
        body = backend.prepare(body, cls.rank)
        answer = await fetch(ex, backend, body, deadline, self.cfg, collect=collect, strip_usage=strip_usage)
        if answer is None:
            return  # streamed to the client
        raw, ctype = answer
        # The client's writes are the watchdog's (client_write_s), no longer the runtime's deadline.
        await ex.start(200, [(b"content-type", ctype), (b"content-length", str(len(raw)).encode())])
        await ex.send_whole(raw)

    def account(self, rec: RequestRecord) -> None:
        m = self.metrics
        model = rec.model if self.registry.serves(rec.model) else "unknown"
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
