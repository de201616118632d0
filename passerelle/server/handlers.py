"""The gateway's own routes (not inference): each a function of the service and one ASGI request.

The route table (routes.py) names these functions, as starlette's ``Route(path, endpoint)`` does;
the app (app.py) calls ``route.handler(service, scope, receive, send)`` once the admin guard and
the standby check passed. Each takes what it works on from the :class:`Service`, never from the
gateway.

Example::

    await health(service, scope, receive, send)     # GET /health
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, unquote

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from passerelle import __version__
from passerelle.errors import UnknownModel
from passerelle.proxy.exchange import Receive, Scope, Send
from passerelle.server import control
from passerelle.server.connections import BoundedReceive
from passerelle.server.responses import json_response, raw_response

if TYPE_CHECKING:
    from passerelle.server.service import Service

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]
Endpoint = Callable[["Service", Scope, Receive, Send], Awaitable[None]]

_UI_CSP = (b"default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
           b"connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'")
_ui_page: list[bytes] = []  # the dashboard, read once


# -- public: health, readiness, the model list ---------------------------------------------------
async def health(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    # what answers, and which version: a benchmark's report names it (bench/target.py)
    body: dict[str, Any] = {"status": "ok", "server": "passerelle", "version": __version__}
    if svc.boxes is not None:  # other boxes: each one's state and, when it is not up, why (runtimes/boxes.py)
        body["boxes"] = svc.boxes.health()
    troubles = svc.supervisor.troubles()  # a split replica out, its member named (the gateway still serves)
    if troubles:
        body["runtimes_out"] = troubles
    store = svc.stores.describe()
    if store is None:
        await json_response(send, 200, body)
        return
    # a shared store: whether it answers (serving from cached keys is still 200), and the pair's role
    body["store"] = store
    if not store["serving_keys"]:  # away for longer than [store] offline_s: requests get 503 too
        body["status"] = "store_unavailable"
        await json_response(send, 503, body)
        return
    active = svc.stores.active
    if active is not None:
        body["active"] = active.describe()
        if not active.active:
            body["status"] = "standby"
            await json_response(send, 503, body)
            return
    await json_response(send, 200, body)


async def ready(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    up, on_demand = svc.readiness()
    status = 200 if up or on_demand else 503
    await json_response(send, status, {"status": "ready" if status == 200 else "unavailable", "backends_up": up,
                                       "on_demand": on_demand})


async def models(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    # once keys are in use, only to a key, and only the models it may use
    key = svc.keys.authenticate(scope)
    # OpenAI's model list, each with the catalogue's metadata and whether it is loaded
    data = [m for m in svc.catalogue.listing(int(svc.started_at)) if key is None or key.allows(m["id"])]
    await json_response(send, 200, {"object": "list", "data": data})


async def model(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /v1/models/{id}`` (an id may hold slashes, and an alias finds its model)."""
    key = svc.keys.authenticate(scope)
    name = unquote(scope["path"].removeprefix("/v1/models/"))
    found = svc.catalogue.describe(name, int(svc.started_at))
    if found is None or (key is not None and not key.allows(found["id"])):
        raise UnknownModel(name, [m for m in svc.catalogue.names if key is None or key.allows(m)])
    await json_response(send, 200, found)


# -- keys: the key holder's /v1/me, the admin key API (keys_api.py), the dashboard's login ------
async def me(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    await svc.keys_api.me(scope, receive, send)


async def me_usage(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    await svc.keys_api.me_usage(scope, receive, send)


async def keys_collection(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    await svc.keys_api.collection(scope, receive, send)


async def key_item(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    await svc.keys_api.item(scope, receive, send)


async def audit(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    await svc.keys_api.audit(scope, receive, send)


async def admin_login(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    await svc.admin_login.login(scope, receive, send)


async def admin_logout(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    await svc.admin_login.logout(scope, receive, send)


# -- the Batch API (batches/api.py): an upload's body has the inference routes' deadline and budget
async def _bounded(svc: Service, handler: Handler, scope: Scope, receive: Receive, send: Send) -> None:
    bounded = BoundedReceive(receive, svc.body_budget.timeout_s, svc.body_budget)
    try:
        await handler(scope, bounded, send)
    finally:
        bounded.release()


async def files(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    await _bounded(svc, svc.batches.files, scope, receive, send)


async def file_item(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    await _bounded(svc, svc.batches.file_item, scope, receive, send)


async def batches(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    await _bounded(svc, svc.batches.batches, scope, receive, send)


async def batch_item(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    await _bounded(svc, svc.batches.batch_item, scope, receive, send)


# -- admin: metrics, the dashboard, runtime control ------------------------------------------
async def prom(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    svc.swapper.refresh_metrics()
    svc.stores.export(svc.metrics)
    await raw_response(send, 200, generate_latest(svc.metrics.registry), CONTENT_TYPE_LATEST.encode())


async def ui(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    if not _ui_page:
        _ui_page.append((resources.files("passerelle") / "static" / "ui.html").read_bytes())
    # The page is self-contained; the policy makes sure it never reaches anything but this server.
    await raw_response(send, 200, _ui_page[0], b"text/html; charset=utf-8",
                       [(b"cache-control", b"no-store"), (b"content-security-policy", _UI_CSP)])


async def admin_stats(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    sched, gateway = svc.scheduler, svc.gateway
    snap = svc.live.snapshot(backends=[b.describe() for b in svc.registry.backends], waiting=svc.waiting_by_class())
    snap["metrics_enabled"] = svc.cfg.metrics.enabled
    snap["slot_holds"] = dict(sched.hold_counts)  # freed slots kept for a returning tenant
    # fair admission (a tenant's share of a class's queue) and the per-session cap
    snap["fair_admission"] = {"tenant_queue_share": sched.tenant_queue_share, "refused_total": sched.share_refusals,
                              "sessions_in_flight": len(gateway.sessions),
                              "session_refused_total": gateway.sessions.refused}
    snap["runtimes"] = svc.supervisor.describe()  # loaded or not, memory estimated and measured
    if svc.boxes is not None:  # other boxes: state, replicas, where each model runs (fits or split)
        snap["boxes"] = svc.boxes.describe()
    snap["swaps"] = svc.swapper.describe()  # budget, swaps and their cost, what waits for a load
    snap["batches"] = svc.batches.snapshot()  # progress of the batches in progress
    snap.update(svc.keys.snapshot())  # auth_throttle, tenants, keys (tenants/policy.py)
    snap["admin_key_throttle"] = svc.admin_guard.key_check.snapshot()
    # streams suspended for a better class, resumed, and the prompt tokens resuming cost
    counts = sched.preempt_counts
    snap["preemption"] = {"enabled": sched.preemptor is not None, "suspended": counts.suspensions,
                          "resumed": counts.resumes, **gateway.preemption_stats}
    await raw_response(send, 200, orjson.dumps(snap), b"application/json", [(b"cache-control", b"no-store")])


async def reload(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    force = query.get("force", ["0"])[-1].lower() in ("1", "true", "yes")
    await json_response(send, 200, await svc.reload(force=force))


async def runtimes(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    await json_response(send, 200, control.runtimes(svc.supervisor, svc.registry.backends, svc.swapper.describe(),
                                                    boxes=svc.boxes.describe() if svc.boxes is not None else None))


async def runtime_action(svc: Service, scope: Scope, receive: Receive, send: Send) -> None:
    out = await control.runtime_action(svc.supervisor, scope["path"], scope["method"], scope.get("query_string", b""))
    if isinstance(out, str):
        await raw_response(send, 200, out.encode(), b"text/plain; charset=utf-8")
    else:
        await json_response(send, 200, out)
