"""The ASGI application: routes, request ids, CORS, and the start and stop of everything.

Inference routes go to :class:`~passerelle.proxy.gateway.Gateway`; the rest are small and answered
here. Every response carries ``X-Request-Id``; every error has OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any
from urllib.parse import unquote

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from passerelle.config import Config, RuntimesConfig, budget_share
from passerelle.errors import ConfigError, GatewayError, InvalidRequest, UnknownModel
from passerelle.observe.accesslog import AccessLog
from passerelle.observe.livestats import LiveStats
from passerelle.observe.metrics import Metrics
from passerelle.observe.record import new_request_id
from passerelle.observe.runtime_metrics import RuntimeMetrics
from passerelle.paths import state_dir
from passerelle.proxy.gateway import ENDPOINTS, Gateway, Receive, Scope, Send, header
from passerelle.runtimes.catalogue import Catalogue
from passerelle.runtimes.factory import build_runtime, expand
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.memory import MemoryBook, machine_gib
from passerelle.runtimes.registry import Registry
from passerelle.runtimes.supervisor import RuntimeProcess, Supervisor
from passerelle.scheduling.scheduler import Scheduler
from passerelle.scheduling.swapper import Swapper
from passerelle.server import control
from passerelle.server.admin import AdminGuard, AdminListener, is_admin_path
from passerelle.server.control import is_control_path
from passerelle.tenants.keys import KeyRing, KeyStore
from passerelle.tenants.usage import UsageRecorder

log = logging.getLogger("passerelle.server.app")


class NotFound(InvalidRequest):
    status, code = 404, "not_found"


class MethodNotAllowed(InvalidRequest):
    status, code = 405, "method_not_allowed"


def budget_gib(rt: RuntimesConfig) -> float:
    """The memory budget in GiB: ``max_loaded_gib``, or ``max_loaded`` (a share) of the machine."""
    share = budget_share(rt.max_loaded) if rt.max_loaded else None
    if share is None:
        return rt.max_loaded_gib
    total = machine_gib(rt.memory)
    log.info("memory budget: %s of %.1f GiB (%s) = %.1f GiB", rt.max_loaded, total, rt.memory, share * total)
    return share * total


class App:
    """``App(cfg, backends, processes)`` is an ASGI 3 application; ``processes`` are the runtimes
    it launches, ``loader`` re-reads the configuration for a reload."""

    def __init__(self, cfg: Config, backends: list[Backend], processes: list[RuntimeProcess] | None = None, *,
                 loader: Callable[[], Config] | None = None) -> None:
        self.cfg = cfg
        self.loader = loader
        self._tasks: set[asyncio.Future[Any]] = set()
        self.metrics = Metrics(tenant_label=cfg.metrics.tenant_label, enabled=cfg.metrics.enabled)
        self.registry = Registry(backends, self.metrics)
        self.access_log = AccessLog(enabled=cfg.server.access_log, fmt=cfg.server.log_format)
        self.scheduler = Scheduler(cfg.classes, aging_s=cfg.scheduler.aging_s, on_change=self._queue_changed,
                                   policy=cfg.routing.policy, affinity_slack=cfg.routing.affinity_slack,
                                   hold_s=cfg.scheduler.hold_s)
        self.supervisor = Supervisor(processes or [], max_loaded_gib=budget_gib(cfg.runtimes),
                                     memory_kind=cfg.runtimes.memory,
                                     book=MemoryBook(state_dir() / "runtime-memory.json"),
                                     on_ready=self.scheduler.dispatch)
        for proc in self.supervisor.processes.values():
            proc.on_ready = self.scheduler.dispatch
        # Loading and unloading models as the queue asks (scheduling/swapper.py)
        self.runtime_metrics = RuntimeMetrics(self.metrics.registry)
        self.swapper = Swapper(self.scheduler, self.supervisor, cfg.runtimes, self.runtime_metrics)
        self.scheduler.on_need = self.supervisor.on_change = self.swapper.poke
        self.keystore = KeyStore(cfg.auth.db or None)
        self.gateway = Gateway(cfg, self.registry, self.metrics, self.access_log, self.scheduler,
                               KeyRing(self.keystore))
        self.gateway.on_demand = self.swapper.poke
        self.gateway.catalogue = self._catalogue(cfg)
        self.usage = UsageRecorder(self.keystore.conn)
        self.gateway.listeners.append(self.usage.record)
        self.started_at = time.time()
        self._cors = {o.encode() for o in cfg.server.cors_origins}
        # The dashboard's rolling window (/admin/stats, /ui), fed with every finished request.
        self.live = LiveStats(window_s=cfg.metrics.window_s, classes=[c.name for c in cfg.classes])
        if cfg.metrics.enabled:
            self.gateway.listeners.append(self.live.observe)
        # Requests waiting in passerelle's queue by class (the scheduler may put its own counter here).
        self.waiting_by_class: Callable[[], Mapping[str, int]] = self.scheduler.waiting_by_class
        self.admin_guard = AdminGuard(cfg.admin)
        self.admin_listener = (AdminListener(self.admin_app, cfg.admin.host, cfg.admin.port)
                               if cfg.admin.port else None)
        self._ui_page: bytes | None = None

    def _catalogue(self, cfg: Config) -> Catalogue:
        return Catalogue(cfg.models, self.registry, supervisor=self.supervisor, eta=self.swapper.eta_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if self._cors:
                send = self._with_cors(scope, send)
                if scope["method"] == "OPTIONS":
                    await self._json(send, 204, None)
                    return
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None:
            if method != "POST":
                await self._error(send, MethodNotAllowed(f"Use POST for {path}."))
                return
            await self.gateway.handle(scope, receive, send, endpoint)
            return
        if method not in ("GET", "HEAD") and not is_control_path(path):
            await self._error(send, NotFound(f"No route for {method} {path}.")
                              if path not in ROUTES else MethodNotAllowed(f"Use GET for {path}."))
            return
        if is_admin_path(path):
            await self._admin(scope, send, on_admin_port=False, receive=receive)
            return
        handler = ROUTES.get(path)
        if handler is None and path.startswith("/v1/models/"):
            handler = App.model
        if handler is None:
            await self._error(send, NotFound(f"No route for {method} {path}."))
            return
        await handler(self, scope, send)

    # -- admin routes (/admin/*, /ui, /metrics): see admin.py ------------------------------
    async def admin_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app of the separate admin port ([admin] port): admin routes only."""
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if not is_admin_path(path):
            await self._error(send, NotFound(f"Only the admin routes are served on this port, not {path}."))
        elif method not in ("GET", "HEAD") and not is_control_path(path):
            await self._error(send, MethodNotAllowed(f"Use GET for {path}."))
        else:
            await self._admin(scope, send, on_admin_port=True, receive=receive)

    async def _admin(self, scope: Scope, send: Send, *, on_admin_port: bool, receive: Receive | None = None) -> None:
        path = scope["path"]
        if is_control_path(path) and (self.admin_listener is not None) == on_admin_port and receive is not None:
            if (err := self.admin_guard.check(scope)) is not None:
                await self._error(send, err)
                return
            await control.handle(self, scope, receive, send)
            return
        handler = ROUTES.get(path)
        if handler is None or (self.admin_listener is not None) != on_admin_port:
            where = " on this port" if self.admin_listener is not None and not on_admin_port else ""
            await self._error(send, NotFound(f"No route for {scope['method']} {path}{where}."))
            return
        if (err := self.admin_guard.check(scope)) is not None:
            await self._error(send, err)
            return
        await handler(self, scope, send)

    async def admin_stats(self, scope: Scope, send: Send) -> None:
        snap = self.live.snapshot(backends=[b.describe() for b in self.registry.backends],
                                  waiting=self.waiting_by_class())
        snap["metrics_enabled"] = self.cfg.metrics.enabled
        snap["slot_holds"] = dict(self.scheduler.hold_counts)  # freed slots kept for a returning tenant
        snap["runtimes"] = self.supervisor.describe()  # loaded or not, memory estimated and measured
        snap["swaps"] = self.swapper.describe()  # budget, swaps and their cost, what waits for a load
        await self._raw(send, 200, orjson.dumps(snap), b"application/json", [(b"cache-control", b"no-store")])

    async def ui(self, scope: Scope, send: Send) -> None:
        if self._ui_page is None:
            self._ui_page = (resources.files("passerelle") / "static" / "ui.html").read_bytes()
        # The page is self-contained; the policy makes sure it never reaches anything but this server.
        csp = (b"default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
               b"connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'")
        await self._raw(send, 200, self._ui_page, b"text/html; charset=utf-8",
                        [(b"cache-control", b"no-store"), (b"content-security-policy", csp)])

    # -- small routes ----------------------------------------------------------------------
    async def health(self, scope: Scope, send: Send) -> None:
        await self._json(send, 200, {"status": "ok"})

    async def ready(self, scope: Scope, send: Send) -> None:
        up = [b.name for b in self.registry.backends if b.stats.up]
        # an on-demand runtime can serve too: it starts when asked
        on_demand = [b.name for b in self.registry.backends if b.cfg.on_demand and not b.stats.up and not b.draining]
        status = 200 if up or on_demand else 503
        await self._json(send, status, {"status": "ready" if status == 200 else "unavailable", "backends_up": up,
                                        "on_demand": on_demand})

    async def models(self, scope: Scope, send: Send) -> None:
        """OpenAI's model list, each with the catalogue's metadata and whether it is loaded."""
        data = self.gateway.catalogue.listing(int(self.started_at))
        await self._json(send, 200, {"object": "list", "data": data})

    async def model(self, scope: Scope, send: Send) -> None:
        """``GET /v1/models/{id}`` (an id may hold slashes, and an alias finds its model)."""
        name = unquote(scope["path"].removeprefix("/v1/models/"))
        found = self.gateway.catalogue.describe(name, int(self.started_at))
        if found is None:
            await self._error(send, UnknownModel(name, self.gateway.catalogue.names))
            return
        await self._json(send, 200, found)

    async def prom(self, scope: Scope, send: Send) -> None:
        self.swapper.refresh_metrics()
        body = generate_latest(self.metrics.registry)
        await self._raw(send, 200, body, CONTENT_TYPE_LATEST.encode())

    # -- plumbing --------------------------------------------------------------------------
    def _with_cors(self, scope: Scope, send: Send) -> Send:
        origin = header(scope, b"origin")
        allowed = origin is not None and (origin.encode() in self._cors or b"*" in self._cors)

        async def cors_send(message: dict[str, Any]) -> None:
            if allowed and message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"access-control-allow-origin", origin.encode()),  # type: ignore[union-attr]
                                      (b"access-control-allow-headers", b"authorization, content-type, x-priority"),
                                      (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                                      (b"access-control-expose-headers", b"x-request-id, retry-after")]
            await send(message)

        return cors_send

    async def _raw(self, send: Send, status: int, body: bytes, ctype: bytes,
                   extra: list[tuple[bytes, bytes]] | None = None) -> None:
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", new_request_id().encode()), *(extra or [])]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _json(self, send: Send, status: int, obj: Any) -> None:
        await self._raw(send, status, b"" if obj is None else orjson.dumps(obj), b"application/json")

    async def _error(self, send: Send, err: GatewayError) -> None:
        await self._raw(send, err.status, err.body(), b"application/json", err.headers())

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
        for model in self.gateway.catalogue.names:
            for cls in self.cfg.classes:
                self.metrics.waiting.labels(model, cls.name).set(counts.get((model, cls.name), 0))

    async def startup(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.start_all()
        await self.registry.start()
        self.registry.on_up = self.scheduler.dispatch
        self.usage.start()
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
        lines = [f"passerelle serving on http://{s.host}:{s.port}/v1  (OpenAI-compatible; health at /health)",
                 f"  dashboard at {admin}/ui, metrics at {admin}/metrics"]
        for b in self.registry.backends:
            lines.append(f"  backend {b.name} ({b.kind}) at {b.url}: models {', '.join(b.models)} "
                         f"[{', '.join(b.cfg.endpoints)}], {b.capacity} slots, {'up' if b.stats.up else 'DOWN'}")
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

        self._spawn(run(), "reload")

    async def reload(self) -> dict[str, list[str]]:
        """Re-read the configuration: added backends start, removed ones drain (finish their
        requests, then stop), unchanged ones are not touched and keep their streams."""
        if self.loader is None:
            raise InvalidRequest("This gateway has no configuration file to reload.")
        try:
            new = expand(await asyncio.to_thread(self.loader))
        except ConfigError as exc:
            raise InvalidRequest(f"Reload refused, the running configuration stays: {exc}") from None
        current = {b.name: b for b in self.registry.backends}
        wanted = {bc.name: bc for bc in new.backends}
        kept = [n for n, b in current.items() if n in wanted and wanted[n] == b.cfg]
        removed = [n for n in current if n not in kept]
        added = [n for n in wanted if n not in kept]
        for name in removed:
            current[name].draining = True
            self._spawn(self._retire(current[name]), f"retire-{name}")
        backends = [current[n] for n in kept]
        for name in added:
            backend, proc = build_runtime(wanted[name], self.cfg.timeouts)
            await backend.start()
            backends.append(backend)
            if proc is not None:
                proc.on_ready = self.scheduler.dispatch
                self.supervisor.adopt(proc)
                if not backend.cfg.on_demand:
                    self._spawn(self.supervisor.start(name), f"start-{name}")
        self.registry.set_backends(backends + [current[n] for n in removed])
        self.gateway.catalogue = self._catalogue(new)
        log.info("configuration reloaded: added %s, removed %s, unchanged %s", added, removed, kept)
        return {"added": added, "removed": removed, "unchanged": kept}

    async def _retire(self, backend: Backend) -> None:
        while backend.in_flight:
            await asyncio.sleep(0.2)
        proc = self.supervisor.get(backend.name)
        if proc is not None and proc.backend is backend:
            await proc.stop()
            del self.supervisor.processes[backend.name]
        self.registry.set_backends([b for b in self.registry.backends if b is not backend])
        await backend.close()

    async def shutdown(self) -> None:
        if self.admin_listener is not None:
            await self.admin_listener.stop()
        await self.usage.stop()
        await self.swapper.stop()
        await self.registry.stop()
        if self.supervisor is not None:
            await self.supervisor.stop_all()
        self.access_log.flush()  # (requests cut short after this are flushed at exit)


ROUTES = {
    "/health": App.health,
    "/ready": App.ready,
    "/v1/models": App.models,
    "/metrics": App.prom,
    "/admin/stats": App.admin_stats,
    "/ui": App.ui,
}
