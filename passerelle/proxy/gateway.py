"""The life of one inference request, start to end, in one place.

    read body (capped) → parse the few fields the gateway needs → pick a backend
    → send upstream → relay (stream or body) → account: metrics, usage, one access-log line

Every inference API goes through this life (protocols.py says what differs: the fields read, the
runtime's path, the stream's grammar, whether it queues for a slot, the error shape). The body
passes through untouched, except that a streaming chat/completions request that did not ask for
``stream_options.include_usage`` gets it added (so token counts come from the runtime), and the
usage chunk is removed again before it reaches that client; vLLM gets the class as ``priority``.

Races worth knowing:

* The client may leave at any time. A watcher task waits on ASGI ``receive()`` for
  ``http.disconnect`` and cancels the request task; the upstream response is then closed, so the
  runtime sees its socket close and frees the slot. uvicorn also answers ``receive()`` with
  ``http.disconnect`` once the response is complete, so ``Exchange.finishing`` is set before the
  last ``send`` to tell the two apart (exchange.py keeps the request's flags).
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
from collections.abc import Callable
from typing import Any

import orjson

from passerelle.config import ClassConfig, Config
from passerelle.errors import (
    BodyTooLarge,
    Cause,
    ClientDisconnect,
    GatewayError,
    InvalidRequest,
    UnknownModel,
    UpstreamError,
    UpstreamStatus,
    UpstreamTimeout,
)
from passerelle.observe.accesslog import AccessLog
from passerelle.observe.metrics import Metrics, observe_many
from passerelle.observe.record import RequestRecord, State
from passerelle.proxy import grammars
from passerelle.proxy.assemble import assemble
from passerelle.proxy.assemble_events import assemble_events
from passerelle.proxy.exchange import Exchange, Receive, Scope, Send, header
from passerelle.proxy.protocols import Api, Parsed, api_for
from passerelle.proxy.relay import StreamRelay, read_body
from passerelle.proxy.resume import Splice, suspendable
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.registry import Registry
from passerelle.scheduling.scheduler import Job, Scheduler
from passerelle.tenants.keys import ApiKey, KeyRing
from passerelle.tenants.names import user_tenant
from passerelle.tenants.policy import KeyPolicy, Ticket

log = logging.getLogger("passerelle.proxy.gateway")

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


def with_usage_requested(body: bytes, data: dict[str, Any]) -> bytes:
    """``body`` with ``stream_options.include_usage = true`` (spliced in when absent, so the
    rest of the body keeps its exact bytes)."""
    if "stream_options" not in data:
        i = body.index(b"{")
        return body[: i + 1] + b'"stream_options":{"include_usage":true},' + body[i + 1 :]
    data = dict(data, stream_options={**(data["stream_options"] or {}), "include_usage": True})  # null is valid
    return orjson.dumps(data)


class _Collector:
    """An ASGI ``send`` that keeps the body, for answers assembled from a stream."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.parts.append(message.get("body", b""))



class Gateway:
    def __init__(self, cfg: Config, registry: Registry, metrics: Metrics, access_log: AccessLog,
                 scheduler: Scheduler, keyring: KeyRing | None = None) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.access_log = access_log
        self.scheduler = scheduler
        self.keyring = keyring
        self.keys = KeyPolicy(cfg, keyring)  # keys: who, which models, quotas, limits (tenants/policy.py)
        self.classes = {c.name: c for c in cfg.classes}
        self._retry_budget = 10.0  # retries allowed now; refilled by 0.2 per request
        self.preemption_stats = {"suspensions": 0, "resumed_streams": 0, "resume_prompt_tokens_processed": 0,
                                 "resume_prompt_tokens_cached": 0}
        # Called with a pool none of whose replicas is up: starts an on-demand runtime.
        self.on_demand: Callable[[list[Backend]], None] | None = None
        # Called with every finished request's record (usage store, the dashboard's window).
        self.listeners: list[Callable[[RequestRecord], None]] = []
        # Requests in progress; the server's shutdown ends those still running (server/shutdown.py).
        self.open: set[Exchange] = set()

    # -- who is asking, and how urgent ---------------------------------------------------------
    def authenticate(self, scope: Scope, rec: RequestRecord) -> ApiKey | None:
        """The caller's key; None when keys are not in use. Raises Unauthorized / RateLimited."""
        return self.keys.authenticate(scope, rec)

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

    def affinity_key(self, scope: Scope, data: dict[str, Any] | None, endpoint: str) -> str:
        """What keeps related requests on one replica: a session header, else the conversation's
        opening (system prompt and first user message, shared by every turn, so llama-server's
        prompt cache is reused: chat, Anthropic messages, Responses input), else the ``user``."""
        r = self.cfg.routing
        session = header(scope, r.session_header.lower().encode()) if r.session_header else None
        if session:  # hashed, like the others: a client's string never sets an entry's size
            return "s:" + hashlib.blake2b(session.encode("latin-1"), digest_size=12).hexdigest()
        if data is None:
            return ""
        if r.prefix_affinity and endpoint in ("chat", "messages", "responses"):
            turns = data.get("input" if endpoint == "responses" else "messages")
            opening: list[Any] = [data.get("system" if endpoint == "messages" else "instructions")]
            for m in turns if isinstance(turns, list) else [turns]:
                opening.append(m)
                if not isinstance(m, dict) or m.get("role") == "user":
                    break
            return "p:" + hashlib.blake2b(orjson.dumps(opening), digest_size=12).hexdigest()
        user = data.get("user")
        return "u:" + hashlib.blake2b(user.encode(errors="surrogatepass"), digest_size=12).hexdigest() \
            if isinstance(user, str) else ""

    # -- the request's life ----------------------------------------------------------------
    def _read(self, api: Api, body: bytes, scope: Scope) -> Parsed:
        """The request's fields (protocols.py), its model filled in where a route may leave it out."""
        req = api.parse(body, header(scope, b"content-type"))
        if req.model is None:
            served = self.registry.models_on(api.name)
            if len(served) != 1:
                raise InvalidRequest("Missing required parameter: 'model' (this gateway serves "
                                     f"{', '.join(served) or 'no model'} on {scope['path']}).", param="model")
            req.model = served[0]
        return req

    async def handle(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        api = api_for(endpoint)
        ex = Exchange(scope, receive, send, endpoint)
        ex.errors, ex.grammar = api.errors, api.grammar
        rec = ex.rec
        job: Job | None = None
        grant: Ticket | None = None
        self.open.add(ex)
        try:
            key = self.authenticate(scope, rec)  # before the body: a stranger's body is never read
            limit = self.cfg.server.max_upload_bytes if api.form else self.cfg.server.max_body_bytes
            body = await read_request_body(scope, receive, limit)
            ex.watch()
            req = self._read(api, body, scope)
            rec.model = model = req.model or ""
            rec.stream = req.stream
            rec.max_tokens = req.max_tokens if isinstance(req.max_tokens, int) and req.max_tokens >= 0 else None
            cls = self.priority_class(scope, key)
            rec.priority = cls.name
            if key is not None:
                rec.tenant = key.tenant
            elif req.user:
                rec.tenant = user_tenant(req.user, self.cfg.auth.max_user_chars)
            pool = self.registry.pool(model, endpoint)
            if pool is None:
                raise UnknownModel(model, self.registry.models)
            if not pool:
                raise InvalidRequest(f"The model '{model}' is not served on {scope['path']}: no backend of it "
                                     f"serves that route. It is served on: {self._routes_of(model)}.", param="model")
            # prompt: its text, media at a constant (corrected by usage); an upload is not text, and
            # tokenizing or counting tokens is not the model's work
            est_prompt = (self.keys.estimate_prompt(req.data, model)
                          if api.scheduled and not api.form and req.data is not None else 0)
            est_output = (rec.max_tokens or 256) if api.generates else 0
            if key is not None:  # allow-list, quota, rpm/tpm, then a turn among the key's concurrent slots
                grant = await self.keys.admit(key, rec, cls, est_prompt + est_output)
            job = Job(pool=pool, cls=cls, tenant=rec.tenant, model=model, weight=key.weight if key else 1.0,
                      est_prompt_tokens=est_prompt, est_output_tokens=est_output,
                      can_wait_for_start=any(b.supervised for b in pool), slotted=api.scheduled and not api.form,
                      affinity=self.affinity_key(scope, req.data, endpoint)
                      if len(pool) > 1 or any(b.slot_ids for b in pool) else "")
            if self.on_demand is not None and not any(b.stats.up for b in pool):
                self.on_demand(pool)
            # A stream of a preemptible class may be cut for a better one and continued (resume.py).
            splice = (Splice(req.data, endpoint) if cls.preemptible and self.scheduler.preemption is not None
                      and req.data is not None and any(b.continuation for b in pool)
                      and suspendable(req.data, endpoint) else None)
            await self._dispatch(ex, api, job, req.data, body, cls, splice)
            rec.finish(Cause.OK, 200)
        except asyncio.CancelledError:
            if not ex.disconnected:
                raise
            ex.task.uncancel()
            rec.finish(Cause.CLIENT_DISCONNECT, 499, "client disconnected")
        except GatewayError as err:
            rec.finish(err.cause, err.status, err.message)
            if not isinstance(err, ClientDisconnect):
                await ex.report(err)
        except Exception:
            log.exception("request %s failed inside the gateway", rec.id)
            rec.finish(Cause.UPSTREAM_ERROR, 500, "internal error")
            await ex.report(GatewayError("Internal error in the gateway; see its log."))
        finally:
            ex.close()
            self.open.discard(ex)
            if rec.cause is None:  # an unexpected exception: still one cause, one log line
                rec.finish(Cause.UPSTREAM_ERROR, 500, "internal error")
            if job is not None:
                self.scheduler.release(job, prompt_tokens=rec.prompt_tokens, completion_tokens=rec.completion_tokens)
            if grant is not None:
                self.keys.finish(grant, rec)
            self.account(rec)

    def _routes_of(self, model: str) -> str:
        names = sorted({e for b in self.registry.backends_of(model) for e in b.endpoints})
        return ", ".join(api_for(e).upstream for e in names) or "no route"

    def _direct(self, job: Job) -> Backend | None:
        """For a route that takes no runtime slot (tokenize, token counts): the least busy replica
        up now, without queueing; None when none is (then the scheduler waits for one)."""
        now = time.monotonic()
        usable = [b for b in job.pool if b.name not in job.exclude and b.routable(now)]
        return min(usable, key=lambda b: b.in_flight / b.capacity) if usable else None

    async def _dispatch(self, ex: Exchange, api: Api, job: Job, data: dict[str, Any] | None, body: bytes,
                        cls: ClassConfig, splice: Splice | None = None) -> None:
        """Queue for a replica and try it; before the client got a byte, a replica that could not
        take the request is replaced by another (within the retry budget). A stream suspended
        for a better class queues again and continues where it was cut."""
        rec = ex.rec
        rec.t_queued = rec.t_queued or time.perf_counter()  # set already if it waited in its key's queue
        rec.to(State.QUEUED)
        self._retry_budget = min(10.0, self._retry_budget + 0.2)
        deadline = rec.t_arrival + self.cfg.timeouts.total_s
        suspended_at = 0.0
        while True:
            backend = None if api.scheduled else self._direct(job)
            if backend is None:
                backend = await self.scheduler.acquire(job)
            rec.backend, rec.slot = backend.name, job.slot
            if suspended_at:  # resumed
                rec.suspended_s += time.perf_counter() - suspended_at
                rec.to(State.STREAMING if rec.content_chunks else State.DISPATCHED)
            else:
                rec.t_dispatch = time.perf_counter()
                rec.to(State.DISPATCHED)
            running = self.metrics.running.labels(backend.name, rec.model)
            running.inc()
            sent_with = backend.in_flight
            try:
                await self._attempt(ex, api, backend, job, data, body, cls, deadline, splice)
                if splice is None or not splice.suspended:
                    break
            except (UpstreamError, UpstreamTimeout) as err:
                if splice is not None and splice.suspended:
                    pass  # cut by the scheduler, not a failure of the runtime
                elif isinstance(err, UpstreamTimeout) or ex.started or not self._may_retry(err, job, rec, deadline):
                    raise
                else:
                    log.warning("request %s: %s; retrying on another replica", rec.id, err.message)
                    backend.record_failure(time.monotonic())
                    job.exclude.add(backend.name)
                    rec.retries += 1
                    self.scheduler.release(job)
                    rec.to(State.QUEUED)
                    continue
            finally:
                running.dec()
                if not suspended_at and rec.t_first > rec.t_dispatch and (rec.stream or backend.stream_always):
                    # a streamed first token: the signal a runtime's learned capacity follows
                    backend.observe_first_token(rec.t_first - rec.t_dispatch, sent_with, job.est_prompt_tokens)
            # Suspended: the scheduler has freed the slot and queued the job again.
            assert splice is not None
            splice.resumed()
            rec.suspensions = splice.suspensions
            suspended_at = time.perf_counter()
            ex.finishing = False  # (the cut attempt may have seen its end, the client did not)
            rec.to(State.SUSPENDED)
            self.preemption_stats["suspensions"] += 1
        if splice is not None:
            rec.prompt_tokens, rec.completion_tokens = splice.totals(rec.prompt_tokens, rec.completion_tokens)
            rec.resume_prompt_tokens = splice.resume_prompt_processed
            if splice.suspensions:
                self.preemption_stats["resumed_streams"] += 1
                self.preemption_stats["resume_prompt_tokens_processed"] += splice.resume_prompt_processed
                self.preemption_stats["resume_prompt_tokens_cached"] += splice.resume_prompt_cached
        if backend.failures:
            backend.record_success()

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

    async def _attempt(self, ex: Exchange, api: Api, backend: Backend, job: Job, data: dict[str, Any] | None,
                       body: bytes, cls: ClassConfig, deadline: float, splice: Splice | None = None) -> None:
        """One try on one replica. Response headers go out only when the first byte does, so a
        replica that fails before that can be replaced without the client noticing. With a
        ``splice`` the stream may be cut by the scheduler (then this returns or raises with
        ``splice.suspended`` set), and a later try continues it."""
        rec = ex.rec
        strip_usage = False
        chat_like = api.grammar == "chat"
        collect = not rec.stream and backend.stream_always and api.collect and data is not None
        dialect = backend.continuation if splice is not None else ""
        if dialect and splice is not None:
            data = splice.request_data(dialect)
            body = orjson.dumps(data)
        if collect:
            assert data is not None
            extra = {"stream_options": {"include_usage": True}} if chat_like else {}
            body = orjson.dumps({**data, "stream": True, **extra})
        elif rec.stream and chat_like and data is not None and not (data.get("stream_options") or {}).get(
                "include_usage"):
            body, strip_usage = with_usage_requested(body, data), True
        ctype = b"application/json"
        if api.form:
            ctype = (header(ex.scope, b"content-type") or "").encode("latin-1")
        elif api.scheduled:  # (vLLM's priority, llama-server's slot: for requests that take one)
            body = backend.prepare(body, cls.rank, job.slot)
        resp = await backend.post(api.upstream, body, request_id=rec.id, content_type=ctype)
        try:
            if resp.status != 200:
                raw = await read_body(resp, rec, self.cfg.timeouts, deadline)
                raise UpstreamStatus(resp.status, raw, resp.headers.get("Content-Type", "").encode())
            if collect and splice is not None:
                splice.collector = splice.collector or _Collector()
            send: Any = splice.collector if collect and splice is not None else (_Collector() if collect else ex.send)
            sink = send
            if dialect and splice is not None:
                sp = splice
                send = sp.watch(resp, send, dialect,
                                streaming=lambda: self.scheduler.allow_suspend(job, sp.suspend, lambda: sp.tokens))
            if rec.stream:
                relay = StreamRelay(rec, send, self.cfg.timeouts, strip_usage=strip_usage,
                                    before_first=None if ex.started else lambda: ex.start(200, _SSE_HEADERS),
                                    on_done=ex.mark_finishing, grammar=grammars.make(api.grammar))
                await relay.run(resp, deadline)
                if splice is not None and splice.suspended:
                    return
                ex.mark_finishing()
                with contextlib.suppress(OSError):  # the client may hang up once it has [DONE]
                    await ex.send_body(b"", more=False)
                return
            if collect:
                await StreamRelay(rec, send, self.cfg.timeouts, strip_usage=False,
                                  grammar=grammars.make(api.grammar)).run(resp, deadline)
                if splice is not None and splice.suspended:
                    return
                sse = b"".join(sink.parts)
                raw = assemble(sse, api.name) if chat_like else assemble_events(sse, api.grammar)
                ctype = b"application/json"
            else:
                raw = await read_body(resp, rec, self.cfg.timeouts, deadline)
                ctype = resp.headers.get("Content-Type", "application/json").encode()
                if not rec.usage_from_server and b"_tokens" in raw:  # Responses', Anthropic's, llama-server's names
                    with contextlib.suppress(orjson.JSONDecodeError):
                        p, c = grammars.usage_of(orjson.loads(raw))
                        if p is not None or c is not None:
                            rec.prompt_tokens, rec.completion_tokens, rec.usage_from_server = p, c, True
            await ex.start(200, [(b"content-type", ctype), (b"content-length", str(len(raw)).encode())])
            ex.mark_finishing()
            await ex.send_body(raw, more=False)
        finally:
            if splice is not None:
                self.scheduler.forbid_suspend(job)
                splice.done()
            resp.close()  # drops the connection if unread: the runtime stops generating

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
