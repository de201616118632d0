"""What a reload changes, decided before anything is touched: :func:`plan_reload`.

Both configurations are the expanded ones (``factory.expand``: the embedded default spelled out
as backends, ``[server] extra_routes`` given to every backend), so the plan compares what runs.

    backends  by name: added, removed, replaced (same name, another configuration: a new runtime
              starts and must be ready before the old one drains), kept (not touched: its
              streams go on)
    boxes     the other boxes by name, the same way: a box added is read at once, one removed
              or replaced stops being read and its replicas drain (runtimes/boxes.py)
    models    the catalogue's public names: an entry's name, or a model id no entry covers
    routes    the operator's added inference paths (``extra_routes``)
    live      every other setting that changed and applies at once (timeouts, classes, the
              scheduler, routing, the memory budget, limits, auth, the admin guard, CORS...)
    restart   settings read once at start-up (the listening address, the state directory, the
              stores, metrics, tracing, the Batch API): named, and kept at their running value
              until the gateway restarts (:func:`effective`)

Example::

    >>> from passerelle.config import BackendConfig, Config, ServerConfig, TimeoutConfig
    >>> a = Config(backends=(BackendConfig("b1", url="http://h:1", models=("m",)),))
    >>> b = Config(backends=(BackendConfig("b1", url="http://h:2", models=("m",)),),
    ...            server=ServerConfig(port=9000), timeouts=TimeoutConfig(total_s=60.0))
    >>> p = plan_reload(a, b)
    >>> p.backends.replaced, p.live, p.restart
    (('b1',), ('timeouts.total_s',), ('server.port',))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from passerelle.config import Config, ModelConfig

ALL = ("*",)
# Settings read once at start-up, by section ("*": the whole section). Everything else applies live.
RESTART: Mapping[str, tuple[str, ...]] = {
    # the listener and its connections are uvicorn's, set up before the app starts
    "server": ("host", "port", "state_dir", "max_connections", "max_head_bytes", "max_headers", "head_timeout_s",
               "keep_alive_s", "log_format", "access_log"),
    "admin": ("host", "port"),  # the admin listener
    "auth": ("db",),  # the SQLite file of keys and usage
    "store": ALL,  # the key store (PostgreSQL)
    "metrics": ALL,  # the Prometheus registry's labels and the dashboard's window
    "tracing": ALL,  # the tracer
    "batches": ALL,  # the Batch API's store and runners
    "rpc_workers": ALL,  # the rpc-servers this box lends (a head holds their connection: never swapped live)
}
# Changes the fleet and the catalogue carry out, reported under backends / models / routes.
_FLEET = frozenset({"backends", "models", "embedded", "server.extra_routes", "boxes"})
_IGNORED = frozenset({"source"})


@dataclass(frozen=True)
class Changes:
    """Names added, removed, replaced (same name, new definition) and kept (untouched)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    replaced: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed or self.replaced)

    def as_dict(self) -> dict[str, list[str]]:
        return {"added": list(self.added), "removed": list(self.removed), "replaced": list(self.replaced),
                "kept": list(self.kept)}


def diff(old: Mapping[str, object], new: Mapping[str, object]) -> Changes:
    """``old`` and ``new`` definitions by name, compared.

    >>> diff({"a": 1, "b": 2, "c": 3}, {"b": 2, "c": 4, "d": 5})
    Changes(added=('d',), removed=('a',), replaced=('c',), kept=('b',))
    """
    return Changes(added=tuple(n for n in new if n not in old), removed=tuple(n for n in old if n not in new),
                   replaced=tuple(n for n in new if n in old and old[n] != new[n]),
                   kept=tuple(n for n in new if n in old and old[n] == new[n]))


@dataclass(frozen=True)
class ReloadPlan:
    backends: Changes
    models: Changes
    routes: Changes
    boxes: Changes = Changes()  # [[boxes]] by name (runtimes/boxes.py: Boxes.reconfigure)
    live: tuple[str, ...] = ()  # "section.key" (or "classes") changed and applied at once
    restart: tuple[str, ...] = ()  # "section.key" changed and waiting for a restart

    @property
    def starts(self) -> tuple[str, ...]:
        """Backends that get a new runtime (added or replaced)."""
        return (*self.backends.added, *self.backends.replaced)

    @property
    def drains(self) -> tuple[str, ...]:
        """Backends that finish their requests and go (removed, or replaced by a new one)."""
        return (*self.backends.removed, *self.backends.replaced)

    def as_dict(self) -> dict[str, Any]:
        """The answer of ``/admin/reload``; ``added``, ``removed`` and ``unchanged`` name the
        backends started, drained and untouched (a replaced one is in the first two)."""
        return {"added": list(self.starts), "removed": list(self.drains), "unchanged": list(self.backends.kept),
                "backends": self.backends.as_dict(), "models": self.models.as_dict(), "routes": self.routes.as_dict(),
                "boxes": self.boxes.as_dict(), "applied": list(self.live), "needs_restart": list(self.restart)}

    def summary(self) -> str:
        """One line for the log."""
        parts = [f"{what} {kind} {', '.join(names)}" for what, ch in
                 (("backends", self.backends), ("models", self.models), ("routes", self.routes),
                  ("boxes", self.boxes))
                 for kind, names in (("added", ch.added), ("removed", ch.removed), ("replaced", ch.replaced))
                 if names]
        if self.live:
            parts.append(f"applied {', '.join(self.live)}")
        if self.restart:
            parts.append(f"NOT applied until a restart: {', '.join(self.restart)}")
        return "; ".join(parts) or "nothing changed"


def _needs_restart(section: str, key: str) -> bool:
    keys = RESTART.get(section, ())
    return keys == ALL or key in keys


def _settings(old: Config, new: Config) -> Iterable[str]:
    """``section.key`` of every setting that differs (a tuple section such as ``classes``: its name)."""
    for f in dataclasses.fields(Config):
        name = f.name
        a, b = getattr(old, name), getattr(new, name)
        if name in _IGNORED or a == b:
            continue
        if dataclasses.is_dataclass(a):
            for g in dataclasses.fields(a):
                if getattr(a, g.name) != getattr(b, g.name):
                    yield f"{name}.{g.name}"
        else:
            yield name


def _public_models(cfg: Config) -> dict[str, ModelConfig | None]:
    """The catalogue's names: each entry, then each model id of a backend no entry covers."""
    out: dict[str, ModelConfig | None] = {m.name: m for m in cfg.models}
    covered = {m.target for m in cfg.models}
    for b in cfg.backends:
        for m in b.models:
            if m not in covered:
                out.setdefault(m, None)
    return out


def _routes(cfg: Config) -> dict[str, tuple[str, ...]]:
    """Each added route, with the backends it goes to."""
    out: dict[str, list[str]] = {}
    for b in cfg.backends:
        for path in b.extra_routes:
            out.setdefault(path, []).append(b.name)
    return {p: tuple(names) for p, names in out.items()}


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    """What going from ``old`` to ``new`` (both expanded) changes, and how each change applies."""
    changed = [s for s in _settings(old, new) if s not in _FLEET and s.partition(".")[0] not in _FLEET]
    restart = tuple(s for s in changed if _needs_restart(*s.partition(".")[::2]))
    return ReloadPlan(backends=diff({b.name: b for b in old.backends}, {b.name: b for b in new.backends}),
                      models=diff(_public_models(old), _public_models(new)),
                      routes=diff(_routes(old), _routes(new)),
                      boxes=diff({b.name: b for b in old.boxes}, {b.name: b for b in new.boxes}),
                      live=tuple(s for s in changed if s not in restart), restart=restart)


def effective(old: Config, new: Config) -> Config:
    """``new`` as it runs after a reload: the settings that need a restart keep ``old``'s values."""
    sections: dict[str, Any] = {}
    for section, keys in RESTART.items():
        if keys == ALL:
            sections[section] = getattr(old, section)
        else:
            sections[section] = dataclasses.replace(getattr(new, section),
                                                    **{k: getattr(getattr(old, section), k) for k in keys})
    return dataclasses.replace(new, **sections)
