"""Runtime control over HTTP, for ``passerelle runtime …`` and ``passerelle reload``.

    GET  /admin/runtimes                       state of every launched runtime
    POST /admin/runtimes/NAME/start|stop|restart
    GET  /admin/runtimes/NAME/logs?lines=N     the tail of its output
    POST /admin/reload                         re-read the configuration (also on SIGHUP); answers the plan

They are admin routes (routes.py): the same guard as ``/admin/*`` applies (loopback by default).
The functions here return data or raise a GatewayError; the app writes the response.

Example::

    text_or_obj = await runtime_action(supervisor, "/admin/runtimes/llama/restart", "POST", b"")
    # {"runtime": "llama", "state": "ready", "pid": 4242}
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs

import orjson

from passerelle.errors import InvalidRequest, NoBackend, NotFound, clip
from passerelle.runtimes.boxes import BoxBackend
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.supervisor import RuntimeFailed, Supervisor


def runtimes(sup: Supervisor | None, backends: Iterable[Backend] = (),
             swaps: dict[str, Any] | None = None, *, boxes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every launched runtime, then every backend passerelle reaches at a URL (state ``external``;
    another box's replica: its box's state, ``where`` naming the box), the memory budget, the
    swaps (``swaps``: the swapper's account), and the other boxes with where each model runs
    (``boxes``: runtimes/boxes.py)."""
    rows = sup.describe() if sup else []
    for r in rows:
        r["where"] = "local"
    launched = {r["name"] for r in rows}
    for b in backends:
        if b.name not in launched:
            box = b.box.cfg.name if isinstance(b, BoxBackend) else ""
            rows.append({"name": b.name, "kind": b.kind, "flavour": b.cfg.flavour or None,
                         "state": b.box.status.state.value if isinstance(b, BoxBackend) else "external",
                         "pid": None, "url": b.url, "restarts": 0, "in_flight": b.in_flight, "up": b.stats.up,
                         "on_demand": False, "where": box or "external", "remote": bool(box),
                         "remote_state": b.remote_state if isinstance(b, BoxBackend) else None,
                         "models": list(b.models), **b.capacity_info.as_dict()})
    out = {"runtimes": rows, "budget": sup.budget() if sup else {}, "swaps": (swaps or {}) if sup else {}}
    if boxes is not None:
        out["boxes"] = boxes
    return out


async def runtime_action(sup: Supervisor | None, path: str, method: str, query: bytes) -> dict[str, Any] | str:
    """Start, stop or restart one runtime (a JSON object comes back), or its log tail (text)."""
    parts = path.removeprefix("/admin/runtimes/").split("/")
    proc = sup.get(parts[0]) if sup is not None and len(parts) == 2 else None
    if sup is None or proc is None:
        raise NotFound(f"No runtime at {clip(path)}; GET /admin/runtimes lists them.")
    name, action = parts
    if action == "logs" and method in ("GET", "HEAD"):
        raw = parse_qs(query.decode("latin-1")).get("lines", ["100"])[0]
        try:
            lines = max(1, min(int(raw), 10_000))
        except ValueError:
            raise InvalidRequest(f"'lines' must be a whole number, not '{clip(raw)}'.", param="lines") from None
        return proc.log_tail(lines) + "\n"
    if method != "POST" or action not in ("start", "stop", "restart"):
        raise InvalidRequest(f"Use POST /admin/runtimes/{name}/start, stop or restart, "
                             f"or GET /admin/runtimes/{name}/logs.")
    try:
        await getattr(sup, action)(name)
    except RuntimeFailed as exc:
        raise NoBackend(str(exc)) from None
    return {"runtime": name, "state": proc.state.value, "pid": proc.pid}


def _gib(v: object) -> str:
    return f"{v:.2f}" if isinstance(v, int | float) else "-"


def render(body: bytes) -> str:
    """A runtime list as a table, for the command line: state, how many requests it is sent at
    once and where that figure came from, memory estimated from the model file against what was
    measured (RAM and GPU), then the budget and the swaps."""
    data = orjson.loads(body)
    rows = data["runtimes"]
    out = [f"{'NAME':16}{'KIND':14}{'FLAVOUR':13}{'STATE':10}{'PID':>8}{'UP':>4}{'BUSY':>6}{'CAPACITY':>9} {'FROM':9}"
           f"{'RESTARTS':>9}{'EST GiB':>9}{'MEASURED':>10}{'RAM':>7}{'GPU':>7}{'COUNTS':>8}  URL"]
    for r in rows:
        flags = [f for f, on in (("on demand", r.get("on_demand")), ("persistent", r.get("persistent")),
                                 ("unloading", r.get("fenced")), (f"box {r.get('where')}", r.get("remote"))) if on]
        measured = _gib(r.get("measured_gib")) + ("" if r.get("measured_now") or r.get("measured_gib") is None
                                                  else "*")
        out.append(f"{r['name']:15} {r['kind']:14}{r.get('flavour') or '-':13}"
                   f"{r['state']:10}{r['pid'] or '-':>8}{'yes' if r['up'] else 'no':>4}"
                   f"{r['in_flight']:>6}{r.get('capacity', '-'):>9} {r.get('capacity_source', '-'):9}"
                   f"{r['restarts']:>9}{_gib(r.get('estimated_gib')):>9}{measured:>10}"
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
    for r in rows:
        if split := r.get("split"):
            members = ", ".join(f"{m['endpoint']} {'up' if m['up'] else 'DOWN' if m['up'] is False else '?'}"
                                for m in split["members"])
            out.append(f"split {r['name']}: {split['state']}; members {members}"
                       + (f"; out: {split['cause']}" if split.get("cause") else ""))
    out += _render_boxes(data.get("boxes"))
    details = [f"  {r['name']}: {r['capacity_detail']}" for r in rows if r.get("capacity_detail")]
    if details:
        out += ["", "capacity, requests at once:", *details]
    return "\n".join(out)


def _render_boxes(boxes: dict[str, Any] | None) -> list[str]:
    """The other boxes (state, cause, budget) and where each model runs: replicas (it fits a box)
    or split (it fits none alone)."""
    if not boxes:
        return []
    out = ["", "boxes:"]
    for b in boxes.get("boxes", []):
        mem = b.get("memory") or {}
        budget = f"{_gib(mem.get('loaded_gib'))} of {_gib(mem.get('max_loaded_gib'))} GiB loaded"
        cause = f" ({b['cause']})" if b.get("cause") else ""
        out.append(f"  {b['name']:14}{b['state']:9}{budget:28}{b['url']}{cause}")
    out.append("placement:")
    for p in boxes.get("placements", []):
        where = ", ".join(p["boxes"]) or "-"
        out.append(f"  {p['model']:24}{p['mode']:10}{_gib(p.get('need_gib')):>7} GiB  on {where}  ({p['why']})")
    return out
