"""Runtime control over HTTP, for ``passerelle runtime …`` and ``passerelle reload``.

    GET  /admin/runtimes                       state of every launched runtime
    POST /admin/runtimes/NAME/start|stop|restart
    GET  /admin/runtimes/NAME/logs?lines=N     the tail of its output
    POST /admin/reload                         re-read the configuration (also on SIGHUP)

They are admin routes: the same guard as ``/admin/*`` applies (loopback by default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import parse_qs

import orjson

from passerelle.errors import GatewayError, InvalidRequest, NoBackend
from passerelle.runtimes.supervisor import RuntimeFailed

if TYPE_CHECKING:
    from passerelle.proxy.gateway import Receive, Scope, Send
    from passerelle.server.app import App


def is_control_path(path: str) -> bool:
    return path == "/admin/reload" or path == "/admin/runtimes" or path.startswith("/admin/runtimes/")


class NotFound(InvalidRequest):
    status, code = 404, "not_found"


async def handle(app: App, scope: Scope, receive: Receive, send: Send) -> None:
    path, method = scope["path"], scope["method"]
    sup = app.supervisor
    try:
        if path == "/admin/reload":
            if method != "POST":
                raise InvalidRequest("Use POST /admin/reload.")
            await app._json(send, 200, await app.reload())
            return
        if path == "/admin/runtimes":
            await app._json(send, 200, {"runtimes": sup.describe() if sup else [],
                                        "budget": sup.budget() if sup else {},
                                        "swaps": app.swapper.describe() if sup else {}})
            return
        parts = path.removeprefix("/admin/runtimes/").split("/")
        if len(parts) != 2 or sup is None or sup.get(parts[0]) is None:
            raise NotFound(f"No runtime at {path}; GET /admin/runtimes lists them.")
        name, action = parts
        proc = sup.get(name)
        assert proc is not None
        if action == "logs" and method in ("GET", "HEAD"):
            query = parse_qs(scope.get("query_string", b"").decode())
            lines = int(query.get("lines", ["100"])[0])
            await app._raw(send, 200, (proc.log_tail(lines) + "\n").encode(), b"text/plain; charset=utf-8")
            return
        if method != "POST" or action not in ("start", "stop", "restart"):
            raise InvalidRequest(f"Use POST /admin/runtimes/{name}/start, stop or restart, "
                                 f"or GET /admin/runtimes/{name}/logs.")
        try:
            await getattr(sup, action)(name)
        except RuntimeFailed as exc:
            raise NoBackend(str(exc)) from None
        await app._json(send, 200, {"runtime": name, "state": proc.state.value, "pid": proc.pid})
    except GatewayError as err:
        await app._error(send, err)


def _gib(v: object) -> str:
    return f"{v:.2f}" if isinstance(v, int | float) else "-"


def render(body: bytes) -> str:
    """A runtime list as a table, for the command line: state, and memory estimated from the model
    file against what was measured (RAM and GPU), then the budget and the swaps."""
    data = orjson.loads(body)
    rows = data["runtimes"]
    out = [f"{'NAME':16}{'KIND':14}{'STATE':10}{'PID':>8}{'UP':>4}{'BUSY':>6}{'RESTARTS':>10}"
           f"{'EST GiB':>9}{'MEASURED':>10}{'RAM':>7}{'GPU':>7}{'COUNTS':>8}  URL"]
    for r in rows:
        flags = [f for f, on in (("on demand", r.get("on_demand")), ("persistent", r.get("persistent")),
                                 ("unloading", r.get("fenced"))) if on]
        measured = _gib(r.get("measured_gib")) + ("" if r.get("measured_now") or r.get("measured_gib") is None
                                                  else "*")
        out.append(f"{r['name']:16}{r['kind']:14}{r['state']:10}{r['pid'] or '-':>8}{'yes' if r['up'] else 'no':>4}"
                   f"{r['in_flight']:>6}{r['restarts']:>10}{_gib(r.get('estimated_gib')):>9}{measured:>10}"
                   f"{_gib(r.get('rss_gib')):>7}{_gib(r.get('gpu_gib')):>7}{_gib(r.get('need_gib')):>8}"
                   f"  {r['url'] or '-'}" + (f"  ({', '.join(flags)})" if flags else ""))
    budget = data.get("budget") or {}
    swaps = data.get("swaps") or {}
    if budget.get("max_loaded_gib"):
        reasons = ", ".join(f"{k} {n}" for k, n in (swaps.get("by_reason") or {}).items())
        out.append(f"memory budget: {_gib(budget.get('loaded_gib'))} of {_gib(budget['max_loaded_gib'])} GiB "
                   f"loaded ({budget.get('memory', 'total')}); swaps: {swaps.get('swaps', 0)}"
                   + (f" ({reasons})" if reasons else ""))
    if any(r.get("measured_gib") is not None and not r.get("measured_now") for r in rows):
        out.append("* measured when it last ran (learned; kept across restarts of passerelle)")
    out.append("COUNTS: what the budget counts (measured, else configured memory_gib, else the estimate)")
    return "\n".join(out)
