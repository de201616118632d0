"""The life of one inference request, start to end, in one place.

    read body (capped) → parse the few fields the gateway needs → admit → queue for a replica
    → one attempt (attempt.py: send upstream, relay the stream or take the body, within the
      request's deadline, deadline.py) → retry elsewhere before the first byte (retry.py)
    → release the slot and the key's concurrency → report an error → account: metrics, usage,
      one access-log line (all in ``handle``'s finally: nothing a client or runtime does skips it)

Every inference API goes through this life (protocols.py says what differs: the fields read, the
runtime's path, the stream's grammar, whether it queues for a slot, the error shape). The body
passes through untouched, except that a streaming chat/completions request that did not ask for
``stream_options.include_usage`` gets it added (so token counts come from the runtime), and the
usage chunk is removed again before it reaches that client; vLLM gets the class as ``priority``.

Races worth knowing:

* The client may leave at any time. uvicorn's lost-connection notice (elsewhere, a task waiting
  on ASGI ``receive()`` for ``http.disconnect``) cancels the request task; the upstream response
  is then closed, so the runtime sees its socket close and frees the slot. uvicorn also answers
  ``receive()`` with ``http.disconnect`` (and gives that notice) once the response is complete,
  so ``Exchange.finishing`` is set before the last ``send`` to tell the two apart (exchange.py
  keeps the request's flags).
* Response headers go out only once the runtime's status is known, so a runtime error before
  the first byte reaches the client with the runtime's status; after that, only an SSE error
  event can report it.
* A client may also stop reading. Every write to it is watched (``Exchange.send``); once a
  second ``_watch_writes`` cuts the clients that took nothing for ``client_write_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from passerelle.config import Config
from passerelle.errors import (
    Cause,
    ClientDisconnect,
    ClientTimeout,
    GatewayError,
    InternalError,
    InvalidRequest,
    QueueTimeout,
    UpstreamError,
    encode_request,
)
from passerelle.observe.accesslog import AccessLog
from passerelle.observe.metrics import Metrics
from passerelle.observe.record import RequestRecord, State
from passerelle.observe.tracing import RequestTracer
from passerelle.proxy.answer import AnswerBudget, Piece, size_of
from passerelle.proxy.attempt import fetch, outcome_of
from passerelle.proxy.call import Call
from passerelle.proxy.capabilities import capabilities_needed, check_media, fit_request
from passerelle.proxy.deadline import Deadline
from passerelle.proxy.embed_split import check_input, fetch_embeddings, plan_of
from passerelle.proxy.exchange import Exchange, Receive, Scope, Send, header
from passerelle.proxy.frontend import person_of, task_class, task_of
from passerelle.proxy.intake import (
    affinity_key,
    keeps_kv,
    output_estimate,
    priority_class,
    read_request_body,
    session_hash,
    session_of,
)
from passerelle.proxy.protocols import Api, api_for
from passerelle.proxy.repair import repair_for
from passerelle.proxy.resume import Splice, suspendable
from passerelle.proxy.retry import RetryBudget, may_retry
from passerelle.proxy.upstream_request import upstream_request
from passerelle.runtimes.breaker import Outcome
from passerelle.runtimes.catalogue import Catalogue
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.registry import Registry
from passerelle.scheduling.scheduler import Job, Scheduler
from passerelle.scheduling.session_kv import session_key
from passerelle.tenants.keys import ApiKey
from passerelle.tenants.names import user_tenant
from passerelle.tenants.policy import KeyPolicy
from passerelle.tenants.sessions import SessionGate

_MEDIA = frozenset({"vision", "audio"})
log = logging.getLogger("passerelle.proxy.gateway")

# A request the gateway makes itself (a batch line, batches/internal.py) names in its scope the key
# it runs for, by id (None: no key). uvicorn builds the scope of every HTTP request, so a client
# can never set it.
INTERNAL_KEY = "passerelle.key_id"


_CUT_BY_CLIENT = (Cause.CLIENT_DISCONNECT, Cause.CLIENT_TIMEOUT)


def charge_as_sent(rec: RequestRecord, est_prompt: int) -> None:
    """A stream its client cut (left, or stopped reading) is charged what it was sent, before the
    scheduler, the key's limits, the usage store, the metrics and the access log read its counts:
    the content events relayed (the runtime stops generating when its connection drops), unless
    the runtime's own count came; the prompt, unless the runtime counted it, at the gateway's
    estimate (it was sent to the runtime). Otherwise a client could make any answer cheaper than
    reading it by hanging up before its last event, which carries the runtime's usage."""
    if rec.completion_tokens is None:
        rec.completion_tokens = rec.content_chunks
    if rec.prompt_tokens is None:
        rec.prompt_tokens = est_prompt


class Gateway:
    def __init__(self, cfg: Config, registry: Registry, metrics: Metrics, access_log: AccessLog,
                 scheduler: Scheduler, keys: KeyPolicy, catalogue: Catalogue, *,
                 on_demand: Callable[[list[Backend]], None] | None = None,
                 listeners: list[Callable[[RequestRecord], None]] | None = None,
                 tracer: RequestTracer | None = None) -> None:
        self.registry = registry
        self.metrics = metrics
        self.access_log = access_log
        self.scheduler = scheduler
        self.keys = keys  # keys: who, which models, quotas, limits (tenants/policy.py)
        self.catalogue = catalogue  # model names -> pools (runtimes/catalogue.py)
        self.sessions = SessionGate(cfg.routing)
        self.retry_budget = RetryBudget(ratio=0.2, cap=10.0)
        self.answers = AnswerBudget(cfg.limits)  # answers assembled at once
        self._watchdog: asyncio.TimerHandle | None = None
        self.preemption_stats = {"resumed_streams": 0, "resume_prompt_tokens_processed": 0,
                                 "resume_prompt_tokens_cached": 0}
        # Called with a pool none of whose replicas is up: starts an on-demand runtime.
        self.on_demand = on_demand
        # Called with every finished request's record (usage store, the dashboard's window).
        self.listeners = listeners if listeners is not None else []
        # Requests in progress: the watchdog cuts clients that stopped reading, the shutdown ends those
        # still running past its grace (server/shutdown.py).
        self.open: set[Exchange] = set()
        self.tracer = tracer  # [tracing] on (observe/tracing.py); None: no cost
        self.configure(cfg)

    def configure(self, cfg: Config) -> None:
        """The settings a request reads (``[server]``'s body caps, ``[auth]``, ``[routing]``'s
        sessions, the classes, ``[timeouts]``, ``[limits]``): at start, and at a reload, for the
        requests that arrive from then on."""
        self.cfg = cfg
        self.classes = {c.name: c for c in cfg.classes}
        self.sessions.configure(cfg.routing)
        self.answers.configure(cfg.limits)

    # -- who is asking, and how urgent ---------------------------------------------------------
    def authenticate(self, scope: Scope, rec: RequestRecord) -> ApiKey | None:
        """The caller's key; None when keys are not in use. Raises Unauthorized / RateLimited."""
        if INTERNAL_KEY in scope:
            return self.keys.authenticate_id(scope[INTERNAL_KEY], rec)
        return self.keys.authenticate(scope, rec)

    # -- the request's life ----------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send, endpoint: str) -> None:
        api = api_for(endpoint)
        ex = Exchange(scope, receive, send, endpoint)
        ex.errors, ex.grammar = api.errors, api.grammar
        rec = ex.rec
        if self.tracer is not None:  # (the trace's ids: its spans are made from the record, in account)
            rec.trace = self.tracer.begin(scope)
        call: Call | None = None
        failure: GatewayError | None = None
        self.open.add(ex)
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(1.0, self._watch_writes)
        try:
            try:
                key = self.authenticate(scope, rec)  # before the body: a stranger's body is never read
                limit = self.cfg.server.max_upload_bytes if api.form else self.cfg.server.max_body_bytes
                rec.body = body = await read_request_body(scope, receive, limit)
                ex.watch()
                call = self._intake(ex, api, key, body)
                if key is not None:  # allow-list, quota, rpm/tpm, then a turn among the key's concurrent slots
                    call.grant = await self.keys.admit(key, rec, call.job.cls, call.estimate)
                call.session = self.sessions.enter(rec.tenant, rec.session)  # 429 session_limit
                pool = call.route.pool
                if not any(b.stats.up for b in pool):  # none up: the wait includes a start or a swap
                    rec.cold = True
                    if self.on_demand is not None:
                        self.on_demand(pool)
                await self._dispatch(ex, call)
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
                if call is not None:
                    self._release(rec, call)
                if ex.held is not None:
                    ex.held.release()
            if failure is not None and not isinstance(failure, ClientDisconnect | ClientTimeout):
                await ex.report(failure)  # watched: a client that takes nothing is cut (watchdog)
        except asyncio.CancelledError:
            if not ex.take_cancel():
                raise
            ex.task.uncancel()  # the client left or stopped reading during our error: the cause stays
        finally:
            self.open.discard(ex)
            # (an exception kept in a local would keep this frame, and all it holds, in a reference
            # cycle through its traceback until the cyclic collector runs)
            failure = None
            try:
                ex.close()
            finally:
                self.account(rec)  # one line, one cause, one usage row: whatever happened above

    def _intake(self, ex: Exchange, api: Api, key: ApiKey | None, body: bytes) -> Call:
        """The request's fields (protocols.py), its class, tenant and session, its model resolved to
        a route, its token estimates, its scheduler job: the :class:`Call` every later step takes.
        Raises the 400s of a request the gateway cannot serve as asked."""
        scope, rec, cfg = ex.scope, ex.rec, self.cfg
        ctype = header(scope, b"content-type") or ""
        req = api.parse(body, ctype)
        if req.model is None:  # a route that may leave the model out, when one model serves it
            served = self.registry.models_on(api.name)
            if len(served) != 1:
                raise InvalidRequest("Missing required parameter: 'model' (this gateway serves "
                                     f"{', '.join(served) or 'no model'} on {scope['path']}).", param="model")
            req.model = served[0]
        rec.model = model = req.model
        rec.stream = req.stream
        rec.max_tokens = req.max_tokens if isinstance(req.max_tokens, int) and req.max_tokens >= 0 else None
        cls = priority_class(self.classes, cfg.auth, scope, key)
        trusted = key is not None and key.trust_forwarded_user
        if key is not None:
            rec.tenant = key.tenant
            if trusted and (person := person_of(cfg.auth, scope, time.time())) is not None:
                # a trusted front-end names the person: their own tenant within the key's
                rec.user, rec.user_name, rec.user_email = person.user, person.name, person.email
                rec.tenant = f"{key.tenant}/{rec.user}"
            if trusted and (task := task_of(cfg.auth, scope)):
                # a front-end's background task (title, tags, follow-ups...): its own class and,
                # when it sets no output limit, the configured one
                rec.task, cls = task, task_class(self.classes, cfg.auth, cls)
                if (req.data is not None and api.generates and cfg.auth.task_max_tokens
                        and not any(req.data.get(f) is not None for f in api.budget)):
                    req.data = {**req.data, api.budget[-1]: cfg.auth.task_max_tokens}
                    body = encode_request(req.data)
                    rec.max_tokens = cfg.auth.task_max_tokens
        elif req.user:
            rec.tenant = user_tenant(req.user, cfg.auth.max_user_chars)
        rec.priority = cls.name
        session = session_of(cfg.routing, scope, req.data, cfg.auth.forwarded_chat_header if trusted else "")
        rec.session = session_hash(session[1])
        # Model catalogue (runtimes/catalogue.py): name or alias -> public name, pool, served name;
        # parameter defaults/overrides applied; a fallback model when the pool cannot serve in time.
        needs = capabilities_needed(api.name, req.data, body)
        route = self.catalogue.resolve(model, api.name, req.data, body, wait_s=cls.max_queue_wait_s,
                                       path=scope["path"], routes_of=self._routes_of, needs=needs)
        rec.model = model = route.name
        pool = route.pool
        if needs & _MEDIA:
            check_media(model, route.capabilities, route.data, route.body)  # images to a text model: 400
        ex.warnings += fit_request(route, api.name, needs)  # tools to a model that cannot use them: 400 or warned
        if api.name == "embeddings" and route.data is not None:
            check_input(route.data)  # a shape no runtime embeds: the client's 400, not the runtime's 500
        data = req.data
        if data is not None:  # (a form's model field is rewritten per attempt: upstream_request.py)
            data = route.data
            if route.rewritten and data is not None:
                capped = next((data[f] for f in api.budget if isinstance(data.get(f), int)), None)
                if isinstance(capped, int) and capped >= 0:
                    rec.max_tokens = capped
        # prompt: its text, media at a constant (corrected by usage); an upload is not text, and
        # tokenizing or counting tokens is not the model's work
        slotted = api.scheduled and not api.form
        est_prompt = self.keys.estimate_prompt(data, model) if slotted and data is not None else 0
        job = Job(pool=pool, cls=cls, tenant=rec.tenant, model=model, weight=key.weight if key else 1.0,
                  est_prompt_tokens=est_prompt, est_output_tokens=output_estimate(data, rec.max_tokens)
                  if api.generates else 0, can_wait_for_start=any(b.supervised for b in pool), slotted=slotted,
                  affinity=affinity_key(cfg.routing, scope, data, api.name, session)
                  if len(pool) > 1 or any(b.slot_ids for b in pool) else "",
                  session=session_key(rec.tenant, rec.session) if slotted and keeps_kv(session) else "")
        # A stream of a preemptible class may be cut for a better one and continued (resume.py).
        splice = (Splice(data, api.name) if cls.preemptible and self.scheduler.preemption is not None
                  and data is not None and any(b.continuation for b in pool) and suspendable(data, api.name)
                  else None)
        fmt = route.entry.tool_calls if route.entry is not None else "off"  # (the entry's tool-call repair)
        repair = repair_for(fmt, api.name, data, rec) if fmt != "off" else None
        return Call(api, rec.stream, ctype, route, job, Deadline(cfg.timeouts, rec.t_arrival), splice,
                    repair=repair)

    def _release(self, rec: RequestRecord, call: Call) -> None:
        job = call.job
        if rec.stream and rec.t_dispatch and rec.cause in _CUT_BY_CLIENT:
            charge_as_sent(rec, job.est_prompt_tokens)
        self.scheduler.release(job, prompt_tokens=rec.prompt_tokens, completion_tokens=rec.completion_tokens)
        if job.session:
            self.scheduler.sessions.finished(rec.prompt_tokens, rec.cached_tokens)
        if call.grant is not None:
            self.keys.finish(call.grant, rec)
        self.sessions.leave(call.session)

    def _watch_writes(self) -> None:
        """Once a second: cut every client that has taken no byte for ``client_write_s`` while a
        write to it waited (one timer for all requests rather than one per write)."""
        self._watchdog = None
        if not self.open:
            return
        loop = asyncio.get_running_loop()
        horizon = loop.time() - self.cfg.timeouts.client_write_s
        for ex in [ex for ex in self.open if 0.0 < ex.writing_since <= horizon]:
            log.warning("request %s: the client took no bytes for %g s; cutting its connection", ex.rec.id,
                        self.cfg.timeouts.client_write_s)
            ex.stall()
        self._watchdog = loop.call_later(1.0, self._watch_writes)

    def _routes_of(self, model: str) -> str:
        names = sorted({e for b in self.registry.backends_of(model) for e in b.endpoints})
        return ", ".join(api_for(e).upstream for e in names) or "no route"

    def _direct(self, job: Job) -> Backend | None:
        """For a route that takes no runtime slot (tokenize, token counts): the least busy replica
        up now, without queueing; None when none is (then the scheduler waits for one)."""
        now = time.monotonic()
        usable = [b for b in job.pool if b.name not in job.exclude and b.routable(now)]
        return min(usable, key=lambda b: b.in_flight / b.capacity) if usable else None

    async def _dispatch(self, ex: Exchange, call: Call) -> None:
        """Run the request on a replica until its answer is whole. The resume loop: a stream
        suspended for a better class (the scheduler cut it, freed its slot and queued the job
        again, scheduling/preemption.py) waits here to resume, and its next attempt continues it
        where it was cut (resume.py), as often as it is suspended."""
        rec, splice = ex.rec, call.splice
        rec.t_queued = rec.t_queued or time.perf_counter()  # set already if it waited in its key's queue
        rec.to(State.QUEUED)
        self.retry_budget.deposit()
        while await self._retrying(ex, call) and splice is not None:
            # Cut: the scheduler has freed the slot and queued the job again, SUSPENDED.
            splice.resumed()
            rec.suspensions = splice.suspensions
            rec.suspended_at = [*(rec.suspended_at or ()), splice.tokens_before]
            call.suspended_at = time.perf_counter()
            rec.attempt_ended(call.suspended_at, cut=True)
            ex.finishing = False  # (the cut attempt may have seen its end, the client did not)
            rec.to(State.SUSPENDED)
        if splice is not None:
            rec.prompt_tokens, rec.completion_tokens = splice.totals(rec.prompt_tokens, rec.completion_tokens)
            rec.resume_prompt_tokens = splice.resume_prompt_processed
            if splice.suspensions:
                self.preemption_stats["resumed_streams"] += 1
                self.preemption_stats["resume_prompt_tokens_processed"] += splice.resume_prompt_processed
                self.preemption_stats["resume_prompt_tokens_cached"] += splice.resume_prompt_cached

    async def _retrying(self, ex: Exchange, call: Call) -> bool:
        """The retry loop: queue for a replica and try it; before the client got a byte, a replica
        that could not take the request is replaced by another (within the retry budget). Each
        attempt reports its outcome to its replica's circuit breaker exactly once, a cut one as
        neutral (it says nothing of the runtime). Returns once an attempt has ended: False, the
        answer is whole; True, the scheduler cut the stream (``splice.suspended``) to resume it later."""
        rec, job, deadline, splice = ex.rec, call.job, call.deadline, call.splice
        while True:
            job.max_wait_s = deadline.left_s  # the queue wait is within the total time too
            if job.max_wait_s <= 0:  # never send a request with no time left (nor blame its replica)
                raise QueueTimeout("The request's total timeout ran out before a replica was free.",
                                   retry_after=1.0)
            backend = None if call.api.scheduled else self._direct(job)
            if backend is None:
                backend = await self.scheduler.acquire(job)
            rec.backend, rec.slot = backend.name, job.slot
            rec.t_sent = now = time.perf_counter()
            if call.suspended_at:  # resumed
                rec.suspended_s += now - call.suspended_at
                rec.to(State.STREAMING if rec.content_chunks else State.DISPATCHED)
            else:
                rec.t_dispatch = now
                rec.to(State.DISPATCHED)
            running = self.metrics.labelled(self.metrics.running, backend.name, rec.model)
            running.inc()
            sent_with = backend.in_flight
            error: BaseException | None = None
            try:
                await self._attempt(ex, call, backend)
            except Exception as err:
                if splice is None or not splice.suspended:  # (a cut attempt may end in an error: not this one's)
                    error = err
                    if not isinstance(err, UpstreamError) or not may_retry(
                            retryable=err.retryable, started=ex.started, retries=rec.retries,
                            others_left=any(b.name not in job.exclude and b is not backend for b in job.pool),
                            time_left_s=deadline.left_s, budget=self.retry_budget):
                        raise
                    log.warning("request %s: %s; retrying on another replica", rec.id, err.message)
                    rec.attempt_ended(time.perf_counter(), err.cause.value, err.message)
                    job.exclude.add(backend.name)
                    rec.retries += 1
                    self.scheduler.release(job)
                    rec.to(State.QUEUED)
                    continue
            except BaseException as err:  # (cancelled: the client left, or shutdown)
                error = err
                raise
            finally:
                running.dec()
                cut = splice is not None and splice.suspended
                backend.breaker.record(Outcome.NEUTRAL if cut else outcome_of(error), probe=job.probe,
                                       now=self.scheduler.clock())
                job.probe = False
                error = None  # (no reference cycle through the exception's traceback: see handle)
                if not call.suspended_at and rec.t_first > rec.t_dispatch and (rec.stream or backend.stream_always):
                    # a streamed first token: the signal a runtime's learned capacity follows
                    backend.observe_first_token(rec.t_first - rec.t_dispatch, sent_with, job.est_prompt_tokens)
            return cut

    async def _attempt(self, ex: Exchange, call: Call, backend: Backend) -> None:
        """One try on one replica. Response headers go out only when the first byte does, so a
        replica that fails before that can be replaced without the client noticing. With a
        splice the stream may be cut by the scheduler (then this returns or raises with
        ``splice.suspended`` set), and a later try continues it."""
        on_streaming: Callable[[], None] | None = None
        splice = call.splice
        if splice is not None:
            sp, job = splice, call.job

            def on_streaming() -> None:  # its first token went out: from now on it may be cut
                self.scheduler.allow_suspend(job, sp)
        req = upstream_request(call, backend, self.cfg, on_streaming)
        if req.collect and ex.held is None:  # (the answers assembled at once share a budget: answer.py)
            ex.held = self.answers.hold()
            ex.held.check()
        plan = plan_of(call.route.data, call.route.entry) if call.api.name == "embeddings" else None
        answer: tuple[bytes | list[Piece], bytes] | None
        try:
            if plan is not None:  # a large array split across the runtime's slots; truncation asked
                answer = await fetch_embeddings(ex, req, backend, call.deadline, plan)
            else:
                if call.job.kv is not None:  # a session's KV saved/restored on its slot first
                    await self.scheduler.sessions.before(call.job)
                answer = await fetch(ex, req, backend, call.deadline)
        finally:
            if splice is not None:
                self.scheduler.forbid_suspend(call.job)
                splice.done()
        if answer is None:
            return  # streamed to the client, or suspended
        raw, ctype = answer
        size = len(raw) if isinstance(raw, bytes) else size_of(raw)
        # The client's writes are the watchdog's (client_write_s), no longer the runtime's deadline.
        await ex.start(200, [(b"content-type", ctype), (b"content-length", str(size).encode())])
        await ex.send_whole(raw)

    def account(self, rec: RequestRecord) -> None:
        self.metrics.observe(rec)
        self.access_log.write(rec)
        for listener in self.listeners:  # the usage store, the dashboard's window, the tracer...
            listener(rec)
        rec.body = b""
