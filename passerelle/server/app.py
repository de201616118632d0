"""The ASGI application: routes, request ids, CORS, and the start and stop of everything.

Inference routes go to :class:`~passerelle.proxy.gateway.Gateway`; the rest are small and answered
here. Every response carries ``X-Request-Id``; every error has OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, unquote

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from passerelle import __version__
from passerelle.batches.api import BatchApi
from passerelle.config import Config
from passerelle.errors import ConfigError, GatewayError, InvalidRequest, Standby, Unauthorized, UnknownModel, clip
from passerelle.proxy.exchange import Receive, Scope, Send, StreamGate, header
from passerelle.proxy.protocols import ANTHROPIC, api_for, error_body
from passerelle.runtimes import embedded
from passerelle.runtimes.factory import expand
from passerelle.runtimes.fleet import Fleet
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.reload_plan import effective, plan_reload
from passerelle.runtimes.supervisor import RuntimeFailed, RuntimeProcess
from passerelle.scheduling.scheduler import AFFINITY_ENTRY_BYTES, PreemptionPolicy
from passerelle.server import control
from passerelle.server.admin import AdminGuard, AdminListener
from passerelle.server.build import budget_gib, build
from passerelle.server.connections import BodyBudget, BoundedReceive, ConnectionLimits
from passerelle.server.forwarded import ForwardedTrust
from passerelle.server.keys_api import KeysApi
from passerelle.server.login import AdminLogin
from passerelle.server.responses import error_response, json_response, raw_response
from passerelle.server.routes import Access, NotFound, Route, extra_route, find, is_admin_path, match
from passerelle.server.sdnotify import Notifier
from passerelle.server.shutdown import ShuttingDown, end_open_requests

log = logging.getLogger("passerelle.server.app")
_KEYLESS = frozenset({"/admin/login", "/admin/logout"})  # admin routes the admin key does not guard


class ReloadRefused(InvalidRequest):
    status, code = 409, "reload_refused"


_REFUSED = "Reload refused, the running configuration stays"


# The Batch API's routes: a standby takes no work either (batches stay where they were made)
_BATCH_PATHS = ("/v1/files", "/v1/batches")


class App:
    """``App(cfg, backends, processes)`` is an ASGI 3 application; ``processes`` are the runtimes
    it launches, ``loader`` re-reads the configuration for a reload."""

    def __init__(self, cfg: Config, backends: list[Backend], processes: list[RuntimeProcess] | None = None, *,
                 loader: Callable[[], Config] | None = None, backends_configured: bool | None = None) -> None:
        self.cfg = cfg
        self.loader = loader
        # The configuration lists backends (not the embedded default): a reload to none is refused.
        self.backends_configured = bool(cfg.backends) if backends_configured is None else backends_configured
        self._ending: asyncio.Task[None] | None = None
        self.notifier: Notifier | None = None  # systemd's notify socket (server/sdnotify.py), when set
        self.body_budget = BodyBudget(cfg.server.max_body_bytes_total)
        self.forwarded = ForwardedTrust(cfg.server.trusted_proxies)  # who the client is behind a proxy
        self._tasks: set[asyncio.Future[Any]] = set()
        # Every long-lived part, built and wired in one place (build.py)
        parts = build(cfg, backends, processes, on_queue_change=self._queue_changed)
        self.metrics, self.registry, self.access_log = parts.metrics, parts.registry, parts.access_log
        self.scheduler, self.supervisor, self.swapper = parts.scheduler, parts.supervisor, parts.swapper
        self.runtime_metrics = parts.runtime_metrics
        self.stores, self.key_manager, self.keys = parts.stores, parts.key_manager, parts.keys
        self.keystore, self.usage, self.active_lock = parts.stores.keys, parts.stores.usage, parts.stores.active
        self.catalogue = parts.catalogue
        self.live, self.gateway, self.tracer = parts.live, parts.gateway, parts.tracer
        self.keys_api = KeysApi(cfg.admin.key, self.keystore, self.key_manager, self.keys, self.usage,
                                self.stores.reports)
        # The Batch API: its store beside the keys' database, its lines at the least urgent class.
        self.batches = BatchApi(cfg.batches, cfg.db_path().parent, self.gateway, self.metrics.registry,
                                cfg.admin.key, max(cfg.classes, key=lambda c: c.rank).name)
        self.started_at = time.time()
        self._cors = {o.encode() for o in cfg.server.cors_origins}
        # Requests waiting in passerelle's queue by class (the scheduler may put its own counter here).
        self.waiting_by_class: Callable[[], Mapping[str, int]] = self.scheduler.waiting_by_class
        self.admin_guard = AdminGuard(cfg.admin, own_hosts=(cfg.server.host, cfg.admin.host))
        self.admin_login_form = AdminLogin(self.admin_guard, failed_per_minute=cfg.auth.failed_attempts_per_minute,
                                           body_timeout_s=cfg.server.body_timeout_s)
        self.admin_listener = (AdminListener(self.admin_app, cfg.admin.host, cfg.admin.port,
                                             ConnectionLimits.of(cfg.server, max_connections=64))
                               if cfg.admin.port else None)
        self._ui_page: bytes | None = None
        self.extra_routes: dict[str, Route] = {}
        self._extra_routes_changed()
        # What a reload changes in the backends (runtimes/fleet.py); one reload at a time.
        self.fleet = Fleet(self.registry, self.supervisor, on_ready=self.scheduler.dispatch,
                           on_change=self._extra_routes_changed)
        self._reload_lock = asyncio.Lock()

    def _extra_routes_changed(self) -> None:
        """The operator's added routes (``extra_routes``) of the current backends, by path."""
        self.extra_routes = {e: extra_route(e) for b in self.registry.backends for e in b.endpoints
                             if e.startswith("/")}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if self._cors:
                send = self._with_cors(scope, send)
                if scope["method"] == "OPTIONS":
                    await json_response(send, 204, None)
                    return
            # (straight to the route: every coroutine between the server and the relay loop is
            # passed through again each time a stream's task resumes, a few dozen times a request)
            await self._route(scope, receive, send, on_admin_port=False)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def admin_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app of the separate admin port ([admin] port): admin routes only."""
        if scope["type"] == "http":
            await self._route(scope, receive, send, on_admin_port=True)

    async def _route(self, scope: Scope, receive: Receive, send: Send, *, on_admin_port: bool) -> None:
        """Find the route (routes.py), apply who may call it, and hand over to its handler."""
        self.forwarded.apply(scope)  # before anything reads the client's address
        path, method = scope["path"], scope["method"]
        separate = self.admin_listener is not None
        try:
            admin = is_admin_path(path)
            if on_admin_port and not admin:
                raise NotFound(f"Only the admin routes are served on this port, not {clip(path)}.")
            if admin and separate and not on_admin_port:
                raise NotFound(f"No route for {clip(method)} {clip(path)} on this port.")
            # (the login form and the logout are where a browser has no key yet, or drops it)
            if admin and (err := self.admin_guard.check(scope, need_key=path not in _KEYLESS)) is not None:
                if isinstance(err, Unauthorized) and path == "/ui" and method in ("GET", "HEAD"):
                    await self.admin_login_form.page(send, 401)  # a browser: the login form, not JSON
                    return
                raise err
            route = match(method, path, self.extra_routes)
            if self.active_lock is not None and not self.active_lock.active and (
                    route.access is Access.INFERENCE or path.startswith(_BATCH_PATHS)):
                raise Standby("This gateway is the standby of an active-passive pair; send requests to the "
                              "active one.", retry_after=self.cfg.store.lock_poll_s * 2)
            if route.access is Access.INFERENCE:
                # the body has a deadline (408) and a share of a budget (503), and the shutdown path
                # may end the answer (shutdown.py)
                bounded = BoundedReceive(receive, self.cfg.server.body_timeout_s, self.body_budget)
                try:
                    await self.gateway.handle(scope, bounded, StreamGate(send), route.target)
                finally:
                    bounded.release()
                return
            assert route.handler is not None  # (every route of the app's own names its handler)
            await route.handler(self)(scope, receive, send)
        except GatewayError as err:
            found = find(path)
            if found is not None and found.access is Access.INFERENCE and api_for(found.target).errors == ANTHROPIC:
                body, ctype = error_body(err, ANTHROPIC)  # e.g. GET /v1/messages: Anthropic's shape there
                await raw_response(send, err.status, body, ctype, err.headers())
                return
            await error_response(send, err)

    async def admin_stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        snap = self.live.snapshot(backends=[b.describe() for b in self.registry.backends],
                                  waiting=self.waiting_by_class())
        snap["metrics_enabled"] = self.cfg.metrics.enabled
        snap["slot_holds"] = dict(self.scheduler.hold_counts)  # freed slots kept for a returning tenant
        # fair admission (a tenant's share of a class's queue) and the per-session cap
        snap["fair_admission"] = {"tenant_queue_share": self.scheduler.tenant_queue_share,
                                  "refused_total": self.scheduler.share_refusals,
                                  "sessions_in_flight": len(self.gateway.sessions),
                                  "session_refused_total": self.gateway.sessions.refused}
        snap["runtimes"] = self.supervisor.describe()  # loaded or not, memory estimated and measured
        snap["swaps"] = self.swapper.describe()  # budget, swaps and their cost, what waits for a load
        snap["batches"] = self.batches.snapshot()  # progress of the batches in progress
        snap.update(self.keys.snapshot())  # auth_throttle, tenants, keys (tenants/policy.py)
        # streams suspended for a better class, resumed, and the prompt tokens resuming cost
        preemptor = self.scheduler.preemptor
        snap["preemption"] = {"enabled": preemptor is not None,
                              "suspended": preemptor.suspensions if preemptor else 0,
                              "resumed": preemptor.resumes if preemptor else 0, **self.gateway.preemption_stats}
        await raw_response(send, 200, orjson.dumps(snap), b"application/json", [(b"cache-control", b"no-store")])

    async def ui(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._ui_page is None:
            self._ui_page = (resources.files("passerelle") / "static" / "ui.html").read_bytes()
        # The page is self-contained; the policy makes sure it never reaches anything but this server.
        csp = (b"default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
               b"connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'")
        await raw_response(send, 200, self._ui_page, b"text/html; charset=utf-8",
                        [(b"cache-control", b"no-store"), (b"content-security-policy", csp)])

    # -- small routes ----------------------------------------------------------------------
    async def health(self, scope: Scope, receive: Receive, send: Send) -> None:
        # what answers, and which version: a benchmark's report names it (bench/target.py)
        body: dict[str, Any] = {"status": "ok", "server": "passerelle", "version": __version__}
        store = self.stores.describe()
        if store is None:
            await json_response(send, 200, body)
            return
        # a shared store: whether it answers (serving from cached keys is still 200), and the pair's role
        body["store"] = store
        if not body["store"]["serving_keys"]:  # away for longer than [store] offline_s: requests get 503 too
            body["status"] = "store_unavailable"
            await json_response(send, 503, body)
            return
        if self.active_lock is not None:
            body["active"] = self.active_lock.describe()
            if not self.active_lock.active:
                body["status"] = "standby"
                await json_response(send, 503, body)
                return
        await json_response(send, 200, body)

    def readiness(self) -> tuple[list[str], list[str]]:
        """The backends up, and the on-demand ones that start when asked: ready if either."""
        up = [b.name for b in self.registry.backends if b.stats.up]
        on_demand = [b.name for b in self.registry.backends if b.cfg.on_demand and not b.stats.up and not b.draining]
        return up, on_demand

    def is_ready(self) -> bool:
        return any(self.readiness())

    def service_status(self) -> str:
        """One line for systemd's STATUS= (``systemctl status``)."""
        up, on_demand = self.readiness()
        if not up and not on_demand:
            return "waiting for a backend to come up"
        s = self.cfg.server
        more = f", {len(on_demand)} on demand" if on_demand else ""
        return f"serving on {s.host}:{s.port}: {len(up)} backend(s) up{more}, {len(self.gateway.open)} request(s) open"

    async def ready(self, scope: Scope, receive: Receive, send: Send) -> None:
        up, on_demand = self.readiness()
        status = 200 if up or on_demand else 503
        await json_response(send, status, {"status": "ready" if status == 200 else "unavailable", "backends_up": up,
                                        "on_demand": on_demand})

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        # once keys are in use, only to a key, and only the models it may use
        key = self.keys.authenticate(scope)
        # OpenAI's model list, each with the catalogue's metadata and whether it is loaded
        data = [m for m in self.catalogue.listing(int(self.started_at)) if key is None or key.allows(m["id"])]
        await json_response(send, 200, {"object": "list", "data": data})

    async def model(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/models/{id}`` (an id may hold slashes, and an alias finds its model)."""
        key = self.keys.authenticate(scope)
        name = unquote(scope["path"].removeprefix("/v1/models/"))
        found = self.catalogue.describe(name, int(self.started_at))
        if found is None or (key is not None and not key.allows(found["id"])):
            raise UnknownModel(name, [m for m in self.catalogue.names if key is None or key.allows(m)])
        await json_response(send, 200, found)

    # -- keys: the key holder's /v1/me, the admin key API (keys_api.py) ---------------------
    async def me(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.keys_api.me(scope, receive, send)

    async def me_usage(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.keys_api.me_usage(scope, receive, send)

    async def admin_login(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.admin_login_form.login(scope, receive, send)

    async def admin_logout(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.admin_login_form.logout(scope, receive, send)

    async def keys_collection(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.keys_api.collection(scope, receive, send)

    async def key_item(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.keys_api.item(scope, receive, send)

    async def audit(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.keys_api.audit(scope, receive, send)

    # -- the Batch API (batches/api.py); an upload's body has the inference routes' deadline and budget
    async def _batch_route(self, handler: Callable[[Scope, Receive, Send], Any], scope: Scope, receive: Receive,
                           send: Send) -> None:
        bounded = BoundedReceive(receive, self.cfg.server.body_timeout_s, self.body_budget)
        try:
            await handler(scope, bounded, send)
        finally:
            bounded.release()

    async def files(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._batch_route(self.batches.files, scope, receive, send)

    async def file_item(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._batch_route(self.batches.file_item, scope, receive, send)

    async def batches_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._batch_route(self.batches.batches, scope, receive, send)

    async def batch_item(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._batch_route(self.batches.batch_item, scope, receive, send)

    async def prom(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.swapper.refresh_metrics()
        self.stores.export(self.metrics)
        body = generate_latest(self.metrics.registry)
        await raw_response(send, 200, body, CONTENT_TYPE_LATEST.encode())

    # -- runtime control (control.py) -------------------------------------------------------
    async def reload_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        force = query.get("force", ["0"])[-1].lower() in ("1", "true", "yes")
        await json_response(send, 200, await self.reload(force=force))

    async def runtimes(self, scope: Scope, receive: Receive, send: Send) -> None:
        await json_response(send, 200, control.runtimes(self.supervisor, self.registry.backends,
                                                        self.swapper.describe()))

    async def runtime_action(self, scope: Scope, receive: Receive, send: Send) -> None:
        out = await control.runtime_action(self.supervisor, scope["path"], scope["method"],
                                           scope.get("query_string", b""))
        if isinstance(out, str):
            await raw_response(send, 200, out.encode(), b"text/plain; charset=utf-8")
        else:
            await json_response(send, 200, out)

    # -- plumbing --------------------------------------------------------------------------
    def _with_cors(self, scope: Scope, send: Send) -> Send:
        origin = header(scope, b"origin")
        allowed = origin is not None and (origin.encode() in self._cors or b"*" in self._cors)

        async def cors_send(message: dict[str, Any]) -> None:
            if allowed and message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"access-control-allow-origin", origin.encode()),  # type: ignore[union-attr]
                                      (b"access-control-allow-headers",
                                       b"authorization, content-type, x-priority, x-api-key, anthropic-version, "
                                       b"anthropic-beta"),
                                      (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                                      (b"access-control-expose-headers", b"x-request-id, retry-after")]
            await send(message)

        cors_send.__wrapped__ = send  # type: ignore[attr-defined]  # (the exchange finds the connection)
        return cors_send

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _queue_changed(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        for job in self.scheduler.waiting:
            counts[(job.model, job.cls.name)] = counts.get((job.model, job.cls.name), 0) + 1
        for model in self.catalogue.names:
            for cls in self.cfg.classes:
                self.metrics.waiting.labels(model, cls.name).set(counts.get((model, cls.name), 0))

    async def startup(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.start_all()
        await self.registry.start()
        self.registry.on_up = self.scheduler.dispatch
        await self.stores.start()
        await self.batches.start()
        # What exists after start-up lives as long as the process: keep it out of every
        # collection, and collect less often (full collections paused the loop for 40-50 ms).
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 20, 20)
        if self.loader is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not on Windows / off the main thread
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload_in_background)
        s = self.cfg.server
        if self.admin_listener is not None:
            await self.admin_listener.start()
            admin = f"http://{self.cfg.admin.host}:{self.admin_listener.port}"
        else:
            admin = f"http://{s.host}:{s.port}"
        ring = self.keys.ring
        n_keys = len(ring.active) if ring is not None else 0
        auth = (f"{n_keys} active key{'s' if n_keys != 1 else ''}, a key is required" if self.keys.in_use
                else "no key yet, requests need none")
        lines = [f"passerelle serving on http://{s.host}:{s.port}/v1  (OpenAI-compatible; health at /health)",
                 f"  dashboard at {admin}/ui, metrics at {admin}/metrics",
                 f"  key store {self.keystore.path} ({auth})"]
        for b in self.registry.backends:
            cap = b.capacity_info
            size = f"capacity {cap.describe()}" if b.stats.up or cap.declared else "capacity asked once it is up"
            lines.append(f"  backend {b.name} ({b.kind}) at {b.url}: models {', '.join(b.models)} "
                         f"[{', '.join(b.endpoints)}], {size}, {'up' if b.stats.up else 'DOWN'}")
        e = self.cfg.embedded
        if (not e.model_path and not embedded.BUILTIN[e.model].chat
                and any(b.cfg.name == "local" for b in self.registry.backends)):
            lines.append(f"  note: {e.served_id} is a small base model: it continues text rather than chats "
                         f"([embedded] model = \"{embedded.DEFAULT_MODEL_ID}\" answers; or serve your own GGUF "
                         "with [embedded] model_path)")
        print("\n".join(lines), file=sys.stderr, flush=True)

    def _spawn(self, coro: Any, name: str) -> None:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _reload_in_background(self) -> None:
        async def run() -> None:
            try:
                await self.reload()
            except InvalidRequest as exc:
                log.error("%s", exc.message)
            except Exception:  # (a task's exception nobody retrieves would be logged without context)
                log.exception("reload failed inside the gateway")

        self._spawn(run(), "reload")

    async def reload(self, *, force: bool = False) -> dict[str, Any]:
        """:meth:`_reload`, told to systemd (RELOADING=1, then READY=1) when it runs the gateway."""
        notifier = self.notifier
        if notifier is None:
            return await self._reload(force=force)
        notifier.reloading()
        try:
            return await self._reload(force=force)
        finally:
            notifier.reloaded(self.service_status())

    async def _reload(self, *, force: bool = False) -> dict[str, Any]:
        """Re-read the configuration and carry out its plan (runtimes/reload_plan.py): new runtimes
        start and are ready before those they replace drain (runtimes/fleet.py), unchanged backends
        are not touched and keep their streams, every setting that can applies at once, and the
        answer names those that wait for a restart. A configuration that cannot be read or cannot
        serve (a runtime that fails to start) is refused: the running one stays, whole.

        A file that lists no backend means "the embedded default"; while backends are configured,
        that is far more often a file emptied or cut short by an editor or a deploy than a wish to
        drain them all, so it is refused unless ``force`` (``passerelle reload --force``)."""
        loader = self.loader
        if loader is None:
            raise InvalidRequest("This gateway has no configuration file to reload.")
        async with self._reload_lock:
            try:
                raw = await asyncio.to_thread(loader)
            except (ConfigError, OSError) as exc:
                raise ReloadRefused(f"{_REFUSED}: {exc}") from None
            if raw.uses_embedded and self.backends_configured and not force:
                names = ", ".join(b.name for b in self.registry.backends)
                raise ReloadRefused(f"{_REFUSED}: {raw.source} lists no [[backends]], which would drain every "
                                    f"configured backend ({names}) and start the embedded default. If that is "
                                    "what you want: passerelle reload --force (POST /admin/reload?force=1).")
            try:  # (the embedded default may be built here: minutes, never on the event loop)
                new = await asyncio.to_thread(expand, raw)
            except (ConfigError, OSError) as exc:
                raise ReloadRefused(f"{_REFUSED}: {exc}") from None
            # (what runs: the backends serving now, whatever the file said when they started)
            running_now = dataclasses.replace(self.cfg, backends=tuple(b.cfg for b in self.fleet.serving().values()))
            plan = plan_reload(running_now, new)
            try:
                staged = await self.fleet.stage(plan, new)
            except RuntimeFailed as exc:
                log.error("configuration not reloaded, a new runtime failed to start: %s", exc)
                raise ReloadRefused(f"{_REFUSED}: {exc}") from None
            running = effective(self.cfg, new)
            self.fleet.commit(staged, drain_timeout_s=running.runtimes.drain_timeout_s)
            self._apply_settings(running)
            self.backends_configured = not raw.uses_embedded
            self.catalogue.configure(running.models)
            self._extra_routes_changed()
        log.info("configuration reloaded: %s", plan.summary())
        if plan.restart:
            log.warning("reload: %s changed in the configuration and apply only once passerelle restarts",
                        ", ".join(plan.restart))
        return plan.as_dict()

    def _apply_settings(self, cfg: Config) -> None:
        """A reload's settings, applied at once (those needing a restart are already kept at their
        running values in ``cfg``: reload_plan.effective)."""
        if cfg.runtimes != self.cfg.runtimes:
            self.supervisor.max_loaded_gib = budget_gib(cfg.runtimes)
            self.supervisor.memory_kind = cfg.runtimes.memory
            self.swapper.cfg = cfg.runtimes
        self.cfg = cfg
        s, sc = cfg.server, cfg.scheduler
        self.body_budget.limit = s.max_body_bytes_total
        self.forwarded = ForwardedTrust(s.trusted_proxies)
        self._cors = {o.encode() for o in s.cors_origins}
        # a new admin key: the old one, and the login cookies made from it, stop working at once
        self.admin_guard = self.admin_login_form.guard = AdminGuard(cfg.admin, own_hosts=(s.host, cfg.admin.host))
        self.admin_login_form.body_timeout_s = s.body_timeout_s
        self.keys_api.admin_key = self.batches.admin_key = cfg.admin.key
        self.key_manager.classes = tuple(c.name for c in cfg.classes)
        self.stores.configure(cfg)
        g = self.gateway
        g.cfg = cfg
        g.classes = {c.name: c for c in cfg.classes}
        g.answers.limit = cfg.limits.max_answer_bytes_total
        g.keys.reconfigure(cfg)
        q = self.scheduler
        q.classes = {c.name: c for c in cfg.classes}
        q.aging_s, q.hold_s, q.max_tenants = sc.aging_s, sc.hold_s, sc.max_tenants
        q.policy, q.affinity_slack = cfg.routing.policy, cfg.routing.affinity_slack
        q.affinity_max_entries = cfg.routing.affinity_max_bytes // AFFINITY_ENTRY_BYTES
        q.preemption = PreemptionPolicy(sc.preempt_after_ms / 1000, sc.min_run_s) if sc.preemption else None
        for b in self.registry.backends:
            b.set_timeouts(cfg.timeouts)

    def begin_shutdown(self) -> None:
        """The server stopped accepting: requests still running after ``shutdown_grace_s`` are
        ended with an error event or a 503, and the cause ``shutdown`` (shutdown.py)."""
        grace = self.cfg.server.shutdown_grace_s

        async def end_after_grace() -> None:
            await asyncio.sleep(grace)
            if n := await end_open_requests(self.gateway.open, ShuttingDown(grace)):
                log.warning("shutdown: %d request(s) still running after %g s ended with an error", n, grace)

        if self._ending is None:
            self._ending = asyncio.ensure_future(end_after_grace())

    async def shutdown(self) -> None:
        if self._ending is not None:
            self._ending.cancel()
        if self.admin_listener is not None:
            await self.admin_listener.stop()
        await self.batches.stop()  # (its lines' usage rows are written by the usage store's stop)
        await self.swapper.stop()
        await self.registry.stop()
        if self.supervisor is not None:
            await self.supervisor.stop_all()
        self.access_log.flush()  # (requests cut short after this are flushed at exit)
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # the spans still buffered, sent
        await self.stores.close()  # usage still buffered written, the pair's lock freed for the standby at once

