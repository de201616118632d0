"""Metrics of the runtimes passerelle loads and unloads: swaps, loaded models, measured memory.

They sit in the same registry as :class:`~passerelle.observe.metrics.Metrics` (one ``/metrics``);
``docs/metrics.md`` documents them. The gauges are set from the supervisor's books when
``/metrics`` is scraped (:meth:`RuntimeMetrics.set_runtime`), the counters as swaps happen.

Example::

    rm = RuntimeMetrics(metrics.registry)
    rm.swap("coder", reason="outranked", drain_s=1.5, load_s=8.2)
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# A swap drains a model's running requests, then loads another: seconds to minutes.
SWAP_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
                180.0, 300.0, 600.0)
MEMORY_KINDS = ("rss", "gpu", "measured", "estimated", "need")


class RuntimeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.swaps = Counter("passerelle_swaps", "Models unloaded to load another within the memory budget, by "
                             "the runtime loaded and the reason (idle, outranked; miss under the naive policy).",
                             ["backend", "reason"], registry=r)
        self.swap_drain = Histogram("passerelle_swap_drain_seconds",
                                    "Time a swap waited for the unloaded runtimes' running requests to finish.",
                                    ["backend"], buckets=SWAP_BUCKETS, registry=r)
        self.load = Histogram("passerelle_runtime_load_seconds",
                              "Time an on-demand start took, launch to ready (in a swap or not).",
                              ["backend"], buckets=SWAP_BUCKETS, registry=r)
        self.starts_failed = Counter("passerelle_runtime_starts_failed", "On-demand starts that failed.",
                                     ["backend"], registry=r)
        self.loaded = Gauge("passerelle_runtime_loaded", "1 while a launched runtime holds memory (loading, "
                            "ready or draining), else 0.", ["backend"], registry=r)
        self.memory = Gauge("passerelle_runtime_memory_bytes",
                            "Memory of a launched runtime: rss and gpu as measured now, measured (what counts "
                            "against the budget, learned), estimated (from the model file), need (what the "
                            "budget counts: measured, else configured, else estimated).",
                            ["backend", "kind"], registry=r)
        self.budget = Gauge("passerelle_runtime_memory_budget_bytes",
                            "The memory budget of launched runtimes (0: none).", registry=r)
        self.budget_used = Gauge("passerelle_runtime_memory_loaded_bytes",
                                 "What the loaded runtimes count for in the budget.", registry=r)
        self.waiting_for_load = Gauge("passerelle_requests_waiting_for_load",
                                      "Requests waiting for a stopped runtime to be loaded (a start or a swap).",
                                      ["backend"], registry=r)

    def swap(self, backend: str, *, reason: str, drain_s: float, load_s: float | None) -> None:
        self.swaps.labels(backend, reason).inc()
        self.swap_drain.labels(backend).observe(drain_s)
        if load_s is not None:
            self.load.labels(backend).observe(load_s)

    def set_runtime(self, backend: str, *, loaded: bool, memory: dict[str, float | None], waiting: int) -> None:
        """Gauges of one runtime; a memory figure that is None is removed, not left stale."""
        self.loaded.labels(backend).set(1 if loaded else 0)
        for kind in MEMORY_KINDS:
            value = memory.get(kind)
            if value is None:
                with contextlib.suppress(KeyError):
                    self.memory.remove(backend, kind)
            else:
                self.memory.labels(backend, kind).set(value)
        self.waiting_for_load.labels(backend).set(waiting)
