"""The one route table: every path the gateway answers, its methods, who may call it, and what
handles it.

    INFERENCE  POST, routed by model through the scheduler (proxy/gateway.py): the paths of
               every endpoint of passerelle/endpoints.py (its runtime path, stream grammar,
               error shape; proxy/protocols.py reads its fields), its name the route's target.
               Only these, and the operator's ``extra_routes``, reach a runtime: its management
               routes (/slots, /props, /models/load, vLLM's /sleep, /reset_prefix_cache...) are
               not here and never forwarded.
    PUBLIC     small answers of the app itself (health, readiness, the model list)
    ADMIN      /admin/*, /ui, /metrics: the admin guard applies (loopback by default), and with
               ``[admin] port`` they move to the admin listener

The app's own routes name their handler, a function of the service and one ASGI request
(server/handlers.py, as starlette's ``Route(path, endpoint)``): ``handler(service, scope, receive, send)``.

A path matches a route exactly, or, for a route whose path ends in ``/``, by prefix
(``/admin/runtimes/`` covers ``/admin/runtimes/NAME/start``).

Example::

    >>> match("POST", "/v1/chat/completions").target
    'chat'
    >>> match("GET", "/v1/chat/completions")
    Traceback (most recent call last):
    ...
    passerelle.errors.MethodNotAllowed: Use POST for /v1/chat/completions.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from passerelle.endpoints import ENDPOINTS
from passerelle.errors import MethodNotAllowed, NotFound, clip
from passerelle.server import handlers as h
from passerelle.server.handlers import Endpoint

__all__ = ["ROUTES", "Access", "MethodNotAllowed", "NotFound", "Route", "extra_route", "find", "is_admin_path",
           "match"]


class Access(enum.Enum):
    INFERENCE = "inference"
    PUBLIC = "public"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Route:
    path: str
    methods: tuple[str, ...]
    access: Access
    target: str = ""  # an inference route's endpoint name, as the gateway knows it (proxy/protocols.py)
    handler: Endpoint | None = None  # the app's own route: a function of the service and the request


GET = ("GET", "HEAD")
POST = ("POST",)
PATCH = ("PATCH",)
DELETE = ("DELETE",)

ROUTES: tuple[Route, ...] = (
    # every public path of every inference endpoint (endpoints.py), to its name
    *(Route(path, POST, Access.INFERENCE, e.name) for e in ENDPOINTS for path in e.paths),
    Route("/health", GET, Access.PUBLIC, handler=h.health),
    Route("/ready", GET, Access.PUBLIC, handler=h.ready),
    Route("/v1/models", GET, Access.PUBLIC, handler=h.models),
    # /v1/models/{id}: an id may hold slashes
    Route("/v1/models/", GET, Access.PUBLIC, handler=h.model),
    # the calling key (tenants/policy.py, server/keys_api.py)
    Route("/v1/me", GET, Access.PUBLIC, handler=h.me),
    Route("/v1/me/usage", GET, Access.PUBLIC, handler=h.me_usage),
    # the Batch API (passerelle/batches/api.py): keyed like inference, answered by the app
    Route("/v1/files", (*GET, *POST), Access.PUBLIC, handler=h.files),
    Route("/v1/files/", (*GET, *DELETE), Access.PUBLIC, handler=h.file_item),  # {id}[/content]
    Route("/v1/batches", (*GET, *POST), Access.PUBLIC, handler=h.batches),
    Route("/v1/batches/", (*GET, *POST), Access.PUBLIC, handler=h.batch_item),  # {id}[/cancel]
    Route("/metrics", GET, Access.ADMIN, handler=h.prom),
    Route("/ui", GET, Access.ADMIN, handler=h.ui),
    Route("/admin/stats", GET, Access.ADMIN, handler=h.admin_stats),
    # the dashboard's login (server/login.py)
    Route("/admin/login", (*GET, *POST), Access.ADMIN, handler=h.admin_login),
    Route("/admin/logout", POST, Access.ADMIN, handler=h.admin_logout),
    Route("/admin/reload", POST, Access.ADMIN, handler=h.reload),
    Route("/admin/runtimes", GET, Access.ADMIN, handler=h.runtimes),
    Route("/admin/runtimes/", (*GET, *POST), Access.ADMIN, handler=h.runtime_action),
    Route("/admin/keys", (*GET, *POST), Access.ADMIN, handler=h.keys_collection),
    Route("/admin/keys/", (*GET, *PATCH, *DELETE), Access.ADMIN, handler=h.key_item),
    Route("/admin/audit", GET, Access.ADMIN, handler=h.audit),
)

_EXACT = {r.path: r for r in ROUTES if not r.path.endswith("/")}
_PREFIX = tuple(r for r in ROUTES if r.path.endswith("/"))


def find(path: str) -> Route | None:
    """The route serving ``path``, whatever the method."""
    route = _EXACT.get(path)
    if route is None:
        route = next((r for r in _PREFIX if path.startswith(r.path) and len(path) > len(r.path)), None)
    return route


def extra_route(path: str) -> Route:
    """An operator-added inference route (``extra_routes``): forwarded as is to the backends that
    have it (its endpoint name is the path itself)."""
    return Route(path, POST, Access.INFERENCE, path)


def match(method: str, path: str, extra: Mapping[str, Route] | None = None) -> Route:
    """The route for ``method path`` (``extra``: the operator's added routes, by path); raises
    NotFound or MethodNotAllowed."""
    route = find(path)
    if route is None and extra:
        route = extra.get(path)
    if route is None:
        raise NotFound(f"No route for {clip(method)} {clip(path)}.")
    if method not in route.methods:
        raise MethodNotAllowed(f"Use {' or '.join(m for m in route.methods if m != 'HEAD')} for {clip(path)}.")
    return route


def is_admin_path(path: str) -> bool:
    """Paths the admin guard covers: the admin routes, and anything under /admin (so an unknown
    admin path tells a stranger nothing more than a known one)."""
    route = find(path)
    return (route is not None and route.access is Access.ADMIN) or path == "/admin" or path.startswith("/admin/")
