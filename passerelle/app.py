"""The ASGI application: routes, request ids, CORS, and the start and stop of everything.

Inference routes go to :class:`~passerelle.gateway.Gateway`; the rest are small and answered
here. Every response carries ``X-Request-Id``; every error has OpenAI's shape.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from passerelle.accesslog import AccessLog
from passerelle.backends import Backend
from passerelle.config import Config
from passerelle.errors import GatewayError, InvalidRequest
from passerelle.gateway import ENDPOINTS, Gateway, Receive, Scope, Send, header
from passerelle.metrics import Metrics
from passerelle.request import new_request_id
from passerelle.routing import Router
from passerelle.supervisor import Supervisor

log = logging.getLogger("passerelle.app")


class NotFound(InvalidRequest):
    status, code = 404, "not_found"


class MethodNotAllowed(InvalidRequest):
    status, code = 405, "method_not_allowed"


class App:
    """``App(cfg, backends, supervisor)`` is an ASGI 3 application."""

    def __init__(self, cfg: Config, backends: list[Backend], supervisor: Supervisor | None = None) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.router = Router(backends, self.metrics)
        self.supervisor = supervisor
        self.access_log = AccessLog(enabled=cfg.server.access_log, fmt=cfg.server.log_format)
        self.gateway = Gateway(cfg, self.router, self.metrics, self.access_log)
        self.started_at = time.time()
        self._cors = {o.encode() for o in cfg.server.cors_origins}

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
        if method not in ("GET", "HEAD"):
            await self._error(send, NotFound(f"No route for {method} {path}.")
                              if path not in ROUTES else MethodNotAllowed(f"Use GET for {path}."))
            return
        handler = ROUTES.get(path)
        if handler is None:
            await self._error(send, NotFound(f"No route for {method} {path}."))
            return
        await handler(self, scope, send)

    # -- small routes ----------------------------------------------------------------------
    async def health(self, scope: Scope, send: Send) -> None:
        await self._json(send, 200, {"status": "ok"})

    async def ready(self, scope: Scope, send: Send) -> None:
        up = [b.name for b in self.router.backends if b.stats.up]
        status = 200 if up else 503
        await self._json(send, status, {"status": "ready" if up else "unavailable", "backends_up": up})

    async def models(self, scope: Scope, send: Send) -> None:
        created = int(self.started_at)
        data = [{"id": m, "object": "model", "created": created, "owned_by": "passerelle",
                 "backends": [b.name for b in self.router.backends_of(m)]} for m in self.router.models]
        await self._json(send, 200, {"object": "list", "data": data})

    async def prom(self, scope: Scope, send: Send) -> None:
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

    async def startup(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.start_all()
        await self.router.start()
        s = self.cfg.server
        lines = [f"passerelle serving on http://{s.host}:{s.port}/v1  (OpenAI-compatible; "
                 f"metrics at /metrics, health at /health)"]
        for b in self.router.backends:
            lines.append(f"  backend {b.name} ({b.kind}) at {b.url}: models {', '.join(b.models)} "
                         f"[{', '.join(b.cfg.endpoints)}], {b.capacity} slots, {'up' if b.stats.up else 'DOWN'}")
        print("\n".join(lines), file=sys.stderr, flush=True)

    async def shutdown(self) -> None:
        await self.router.stop()
        if self.supervisor is not None:
            await self.supervisor.stop_all()


ROUTES = {
    "/health": App.health,
    "/ready": App.ready,
    "/v1/models": App.models,
    "/metrics": App.prom,
}
