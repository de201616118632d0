"""The model catalogue: the names clients use, and how each reaches a runtime.

Clients hard-code model names (``gpt-4o-mini``, a ``claude-*`` name, whatever a RAG tool was set
up with). ``[[models]]`` entries give public names with aliases (globs allowed), the backends'
model id to rewrite to (``served_name``), parameter defaults and overrides, metadata for
``/v1/models``, and fallbacks. A model id a backend serves and no entry covers is a public name
too, as it is, so a configuration without ``[[models]]`` behaves as before.

A name is looked up in this order: an entry's name, an entry's exact alias, a backend's model id
(the first entry serving it, else itself), then glob aliases in the order of the file.

Fallbacks are tried in order, before the request is queued (so before its first byte), when the
model's pool cannot serve it in time: no replica up and none that can be started, or a load
(with the swap it needs) estimated to take longer than the request may wait in the queue.

Example::

    cat = Catalogue(cfg.models, registry, eta=swapper.eta_s)
    route = cat.resolve("gpt-4o-mini", "chat", data, body, wait_s=120)
    route.name, route.served, route.pool      # "chat", "qwen2.5-14b", [Backend ...]
    route.body                                # the body with model rewritten, parameters applied
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from passerelle.config import ModelConfig
from passerelle.endpoints import ENDPOINTS
from passerelle.errors import InvalidRequest, UnknownModel, clip, encode_request
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.model_caps import capability_list, model_capabilities, replica_has, ui_meta
from passerelle.runtimes.registry import Registry
from passerelle.runtimes.supervisor import ProcState, Supervisor

log = logging.getLogger("passerelle.runtimes.catalogue")

# The public path of each inference API, as the route table serves it (the runtime's too): what
# /v1/models lists (endpoints.py).
ROUTES = {e.name: e.upstream for e in ENDPOINTS}
_TOKEN_LIMITS = ("max_tokens", "max_completion_tokens")
# A cap on the output limit bounds each API's own field (set there when the client sent none):
# Responses names it max_output_tokens; routes that generate nothing get none.
_OUTPUT_LIMITS = {"responses": ("max_output_tokens",)}
_GENERATE_NOTHING = frozenset(e.name for e in ENDPOINTS if not e.generates)


@dataclass
class ModelRoute:
    """Where one request goes: the public model it counts as, the name the runtime knows, the
    replicas that may serve it, and the request as the runtime gets it. (A path's handler is a
    ``server.routes.Route``.)"""

    name: str
    served: str
    pool: list[Backend]
    data: dict[str, Any] | None  # None for a form (an upload): the gateway rewrites its model field
    body: bytes
    requested: str = ""  # the name the client sent
    fallback_from: str = ""  # the model asked for, when a fallback serves the request
    rewritten: bool = False
    applied: list[str] = field(default_factory=list)  # parameter changes, for the log
    capabilities: tuple[str, ...] = ()  # what the model serving it declares it can do; () = not declared
    entry: ModelConfig | None = None  # the catalogue entry that serves it
    unfit: list[str] = field(default_factory=list)  # capabilities needed that no replica of the pool has


class Catalogue:
    def __init__(self, models: tuple[ModelConfig, ...], registry: Registry, *,
                 supervisor: Supervisor | None = None,
                 eta: Callable[[list[Backend]], float | None] | None = None) -> None:
        self.registry = registry
        self.supervisor = supervisor
        self.eta = eta
        self.configure(models)

    def configure(self, models: tuple[ModelConfig, ...]) -> None:
        """Serve ``models`` from now on (a reload): every holder of the catalogue sees them."""
        self.models = models
        self._by_name = {m.name: m for m in models}
        self._exact = {a: m for m in models for a in m.aliases if not _is_glob(a)}
        self._globs = [(a, m) for m in models for a in m.aliases if _is_glob(a)]
        self._targets: dict[str, ModelConfig] = {}
        for m in models:
            self._targets.setdefault(m.target, m)

    # -- names ---------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Public model names: the entries, then model ids no entry covers."""
        return [m.name for m in self.models] + [m for m in self.registry.models if m not in self._targets]

    def lookup(self, name: str) -> ModelConfig | None:
        """The entry ``name`` stands for (a plain one for an uncovered model id), or None."""
        found = self._by_name.get(name) or self._exact.get(name)
        if found is not None:
            return found
        if self.registry.serves(name):
            return self._targets.get(name) or ModelConfig(name=name)
        for pattern, m in self._globs:
            if fnmatch.fnmatchcase(name, pattern):
                return m
        return None

    def serves(self, name: str) -> bool:
        """Is ``name`` a public name (the metrics label of a request routed by :meth:`resolve`)?"""
        return name in self._by_name or self.registry.serves(name)

    def pool(self, m: ModelConfig, endpoint: str) -> list[Backend] | None:
        """Replicas of ``m`` on ``endpoint``; None when no backend serves its model at all."""
        pool = self.registry.pool(m.target, endpoint)
        if pool is None or not m.backends:
            return pool
        return [b for b in pool if b.name in m.backends]

    # -- a request -----------------------------------------------------------------------------
    def resolve(self, requested: str, endpoint: str, data: dict[str, Any] | None, body: bytes, *,
                wait_s: float = float("inf"), path: str = "",
                routes_of: Callable[[str], str] | None = None, needs: frozenset[str] = frozenset()) -> ModelRoute:
        """Route a request for ``requested`` on ``endpoint``; raise UnknownModel (404) or
        InvalidRequest (400: the model is not served on this endpoint).

        ``wait_s`` is how long the request may wait in the queue: a fallback is taken when the
        model cannot serve within it. ``data``/``body`` are not changed; the route has copies.
        ``data`` is None for a multipart form (an upload): the route names the served model and
        the body is left as it is (the gateway rewrites the form's ``model`` field alone; the
        entry's parameter rules apply to JSON bodies only).
        ``path`` and ``routes_of`` (model id -> the routes it is served on) word the 400.
        ``needs``: the capabilities the request needs (tools, vision...): a fallback that lacks
        one is not taken, and the pool keeps only the replicas that have them (model_caps.py);
        where none has, ``route.unfit`` names what is missing (the caller refuses or serves it)."""
        entry = self.lookup(requested)
        if entry is None:
            raise UnknownModel(requested, self.names)
        chosen, pool = entry, self.pool(entry, endpoint)
        if entry.fallbacks:
            chosen, pool = self._first_able(entry, endpoint, wait_s, needs)
        if not pool:
            where = path or ROUTES.get(endpoint, f"/v1/{endpoint}")
            served = f" It is served on: {routes_of(chosen.target)}." if routes_of is not None else ""
            raise InvalidRequest(f"The model '{clip(requested)}' is not served on {clip(where)}: no backend of it "
                                 f"serves that route.{served}", param="model")
        unfit: list[str] = []
        for need in sorted(needs):
            fit = [b for b in pool if replica_has(chosen, b, need)]
            if fit:
                pool = fit
            else:
                unfit.append(need)
        route = self._apply(chosen, pool, endpoint, data, body)
        route.requested = requested
        route.capabilities = chosen.capabilities
        route.entry, route.unfit = chosen, unfit
        if chosen is not entry:
            route.fallback_from = entry.name
            log.info("model %s cannot serve within %g s; fallback %s serves the request", entry.name, wait_s,
                     chosen.name)
        return route

    def _first_able(self, entry: ModelConfig, endpoint: str, wait_s: float,
                    needs: frozenset[str] = frozenset()) -> tuple[ModelConfig, list[Backend] | None]:
        first_pool = self.pool(entry, endpoint)
        seen = set()
        for name in (entry.name, *entry.fallbacks):
            m = entry if name == entry.name else self.lookup(name)
            if m is None or m.name in seen:
                continue
            seen.add(m.name)
            pool = self.pool(m, endpoint)
            if not pool:
                continue
            if m is not entry and needs:  # a fallback that cannot do what the request needs is no fallback
                pool = [b for b in pool if all(replica_has(m, b, n) for n in needs)]
                if not pool:
                    continue
            eta = self._eta(pool)
            if eta is not None and eta <= wait_s:
                return m, pool
        return entry, first_pool  # none can: the model asked for answers (wait, or no_backend)

    def _eta(self, pool: list[Backend]) -> float | None:
        if self.eta is not None:
            return self.eta(pool)
        return 0.0 if any(b.stats.up or b.supervised for b in pool) else None

    def _apply(self, m: ModelConfig, pool: list[Backend], endpoint: str, data: dict[str, Any] | None,
               body: bytes) -> ModelRoute:
        served = m.target
        if data is None:
            return ModelRoute(m.name, served, pool, None, body)
        if data.get("model") == served and not (m.defaults or m.set or m.cap or m.strip):
            return ModelRoute(m.name, served, pool, data, body)
        out = dict(data)
        applied: list[str] = []
        out["model"] = served
        for k, v in m.defaults:
            if k not in out:
                out[k] = v
                applied.append(f"{k} default")
        for k, v in m.set:
            out[k] = v
            applied.append(f"{k} set")
        for k, limit in m.cap:
            if k in _TOKEN_LIMITS:  # a cap on either names the output limit, whichever the client used
                fields = _OUTPUT_LIMITS.get(endpoint, _TOKEN_LIMITS)
                keys = [t for t in fields if out.get(t) is not None]
                if not keys and endpoint not in _GENERATE_NOTHING:
                    keys = [k if k in fields else fields[0]]  # no limit asked for: the cap becomes the limit
                limit = int(limit)
            else:
                keys = [k] if out.get(k) is not None else []  # other keys: bounded when sent
            for key in keys:
                v = out.get(key)
                if v is None or (isinstance(v, int | float) and not isinstance(v, bool) and v > limit):
                    out[key] = limit
                    applied.append(f"{key} capped at {limit:g}")
        for k in m.strip:
            if out.pop(k, None) is not None:
                applied.append(f"{k} stripped")
        return ModelRoute(m.name, served, pool, out, encode_request(out), rewritten=True, applied=applied)

    # -- /v1/models ----------------------------------------------------------------------------
    def _backends(self, m: ModelConfig) -> list[Backend]:
        out = self.registry.backends_of(m.target)
        return [b for b in out if b.name in m.backends] if m.backends else out

    def state(self, m: ModelConfig) -> str:
        """``loaded`` (a replica is up), ``loading``, ``unloaded`` (loads when asked), ``down``."""
        backends = self._backends(m)
        if any(b.stats.up and not b.draining for b in backends):
            return "loaded"
        sup = self.supervisor
        procs = [sup.get(b.name) for b in backends] if sup is not None else []
        if any(p is not None and (p.state is ProcState.STARTING or sup.starting(p.backend.name) or p.restarting)
               for p in procs if sup is not None):
            return "loading"
        if any(p is not None and p.backend.cfg.on_demand for p in procs):
            return "unloaded"
        return "down"

    def describe(self, name: str, created: int = 0) -> dict[str, Any] | None:
        """``GET /v1/models/{id}``: OpenAI's model object, with what a UI needs added."""
        m = self.lookup(name)
        if m is None:
            return None
        backends = self._backends(m)
        served = {e for b in backends for e in b.endpoints}
        caps = model_capabilities(m, backends)
        # every route it is served on: the APIs its backends declare or their kind serves, then the
        # operator's extra routes
        routes = [path for e, path in ROUTES.items() if e in served]
        routes += sorted({e for b in backends for e in b.endpoints if e.startswith("/")} - set(routes))
        ctx = m.context_length or next((b.context_length for b in backends if b.context_length), None)
        state = self.state(m)
        sup = self.supervisor
        memory = None
        if sup is not None:
            procs = [p for p in (sup.get(b.name) for b in backends) if p is not None]
            if procs:
                memory = round(max(sup.need_gib(p) for p in procs), 3)
        meta = ui_meta(caps, ctx)
        return {"id": m.name, "object": "model", "created": created, "owned_by": m.owned_by,
                "description": m.description or None, "aliases": list(m.aliases), "served_name": m.target,
                "context_length": ctx, "capabilities": capability_list(caps),
                # the same, in the shapes front-ends read: true/false per capability (unknown: false)
                "meta": {**meta, "llamaswap": {"aliases": list(m.aliases)}},
                "info": {"meta": {"capabilities": meta["capabilities"]}},
                "loaded": state == "loaded", "state": state,
                "routes": routes, "backends": [b.name for b in backends],
                "flavours": sorted({b.cfg.flavour for b in backends if b.cfg.flavour}),
                "fallbacks": list(m.fallbacks), "memory_gib": memory}

    def listing(self, created: int = 0) -> list[dict[str, Any]]:
        return [d for d in (self.describe(n, created) for n in self.names) if d is not None]


def _is_glob(alias: str) -> bool:
    return any(c in alias for c in "*?[")
