"""The ASGI front: routes, who may call them, CORS, and the lifespan handed to the service.

Inference routes go to :class:`~passerelle.proxy.gateway.Gateway`; the gateway's own routes to
their handler (server/handlers.py), a function of the :class:`~passerelle.server.service.Service`
that owns every long-lived part. Every response carries ``X-Request-Id``; every error has
OpenAI's shape (Anthropic's on its routes).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from passerelle.config import Config
from passerelle.errors import GatewayError, Standby, clip
from passerelle.proxy.exchange import Receive, Scope, Send, StreamGate, header
from passerelle.proxy.protocols import ANTHROPIC, api_for, error_body
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.supervisor import RuntimeProcess
from passerelle.server.admin import AdminListener
from passerelle.server.build import build
from passerelle.server.connections import BoundedReceive, ConnectionLimits
from passerelle.server.responses import error_response, json_response, raw_response
from passerelle.server.routes import Access, NotFound, Route, extra_route, find, is_admin_path, match
from passerelle.server.sdnotify import Notifier
from passerelle.server.service import ReloadRefused, Service

__all__ = ["App", "ReloadRefused"]

log = logging.getLogger("passerelle.server.app")
_KEYLESS = frozenset({"/admin/login", "/admin/logout"})  # admin routes the admin key does not guard

# The Batch API's routes: a standby takes no work either (batches stay where they were made)
_BATCH_PATHS = ("/v1/files", "/v1/batches")


class App:
    """``App(cfg, backends, processes)`` is an ASGI 3 application; ``processes`` are the runtimes
    it launches, ``loader`` re-reads the configuration for a reload. Its parts are the service's
    (``app.service``; read through the app too: ``app.scheduler`` is ``app.service.scheduler``)."""

    def __init__(self, cfg: Config, backends: list[Backend], processes: list[RuntimeProcess] | None = None, *,
                 loader: Callable[[], Config] | None = None, backends_configured: bool | None = None) -> None:
        svc = build(cfg, backends, processes, loader=loader,
                    backends_configured=bool(cfg.backends) if backends_configured is None else backends_configured)
        self.service: Service = svc
        # What the request path reads, held here once: each is configured in place by the service.
        self.gateway, self.forwarded, self.admin_guard = svc.gateway, svc.forwarded, svc.admin_guard
        self.body_budget, self._cors = svc.body_budget, svc.cors
        self.active_lock = svc.stores.active  # ([store] active_passive: set at start, never by a reload)
        self.admin_listener = (AdminListener(self.admin_app, cfg.admin.host, cfg.admin.port,
                                             ConnectionLimits.of(cfg.server, max_connections=64))
                               if cfg.admin.port else None)
        self.extra_routes: dict[str, Route] = {}
        svc.on_backends_change = self._extra_routes_changed
        self._extra_routes_changed()

    def __getattr__(self, name: str) -> Any:
        # (only for names the app does not have: the service's parts, e.g. app.scheduler)
        if name == "service":
            raise AttributeError(name)
        return getattr(self.service, name)

    @property
    def cfg(self) -> Config:
        """The running configuration."""
        return self.service.cfg

    @property
    def loader(self) -> Callable[[], Config] | None:
        return self.service.loader

    @loader.setter
    def loader(self, loader: Callable[[], Config] | None) -> None:
        self.service.loader = loader

    @property
    def notifier(self) -> Notifier | None:
        return self.service.notifier

    @notifier.setter
    def notifier(self, notifier: Notifier | None) -> None:
        self.service.notifier = notifier

    def _extra_routes_changed(self) -> None:
        """The operator's added routes (``extra_routes``) of the current backends, by path."""
        self.extra_routes = {e: extra_route(e) for b in self.service.registry.backends for e in b.endpoints
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
                # a browser: the login form (401, or 429 while throttled), not JSON
                if path == "/ui" and method in ("GET", "HEAD") and await self.service.admin_login.answer(send, err):
                    return
                raise err
            route = match(method, path, self.extra_routes)
            active_lock = self.active_lock
            if active_lock is not None and not active_lock.active and (
                    route.access is Access.INFERENCE or path.startswith(_BATCH_PATHS)):
                raise Standby("This gateway is the standby of an active-passive pair; send requests to the "
                              "active one.", retry_after=self.cfg.store.lock_poll_s * 2)
            if route.access is Access.INFERENCE:
                # the body has a deadline (408) and a share of a budget (503), and the shutdown path
                # may end the answer (shutdown.py)
                budget = self.body_budget
                bounded = BoundedReceive(receive, budget.timeout_s, budget)
                try:
                    await self.gateway.handle(scope, bounded, StreamGate(send), route.target)
                finally:
                    bounded.release()
                return
            assert route.handler is not None  # (every route of the app's own names its handler)
            await route.handler(self.service, scope, receive, send)
        except GatewayError as err:
            found = find(path)
            if found is not None and found.access is Access.INFERENCE and api_for(found.target).errors == ANTHROPIC:
                body, ctype = error_body(err, ANTHROPIC)  # e.g. GET /v1/messages: Anthropic's shape there
                await raw_response(send, err.status, body, ctype, err.headers())
                return
            await error_response(send, err)

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

    # -- lifespan: the service's start and stop, and the admin listener ---------------------
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

    async def startup(self) -> None:
        await self.service.start()
        s, a = self.cfg.server, self.cfg.admin
        if self.admin_listener is not None:
            await self.admin_listener.start()
            admin = f"http://{a.host}:{self.admin_listener.port}"
        else:
            admin = f"http://{s.host}:{s.port}"
        print(self.service.banner(admin), file=sys.stderr, flush=True)

    def begin_shutdown(self) -> None:
        """The server stopped accepting (server/serving.py): the service ends what outlives the grace."""
        self.service.begin_shutdown()

    def is_ready(self) -> bool:
        return self.service.is_ready()

    def service_status(self) -> str:
        return self.service.service_status()

    async def shutdown(self) -> None:
        if self.admin_listener is not None:
            await self.admin_listener.stop()
        await self.service.stop()
