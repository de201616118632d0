"""The composition root: every long-lived part of a gateway, built once and wired together.

``App`` (app.py) answers HTTP; what it and the :class:`~passerelle.proxy.gateway.Gateway` share
(the key policy, the model catalogue, the swapper, the usage store...) is built here and passed
to both, so that neither reaches into the other for it:

    metrics, registry, access log ─► scheduler (+ preemptor) ─► supervisor ─► swapper
    stores (keys, usage, quotas, the pair's lock) ─► key ring ─► key policy
    catalogue (registry, supervisor, swapper's load estimate)
    gateway (all of the above) ─► listeners: usage rows, key activity, the dashboard's window

Example::

    parts = build(cfg, backends, processes, on_queue_change=app.queue_changed)
    parts.gateway.keys is parts.keys and parts.gateway.catalogue is parts.catalogue  # True
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from passerelle.config import Config, RuntimesConfig, budget_share
from passerelle.observe.accesslog import AccessLog
from passerelle.observe.livestats import LiveStats
from passerelle.observe.metrics import Metrics
from passerelle.observe.record import RequestRecord
from passerelle.observe.runtime_metrics import RuntimeMetrics
from passerelle.observe.tracing import RequestTracer, start_tracer
from passerelle.proxy.gateway import Gateway
from passerelle.runtimes.catalogue import Catalogue
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.memory import MemoryBook, machine_gib
from passerelle.runtimes.registry import Registry
from passerelle.runtimes.supervisor import RuntimeProcess, Supervisor
from passerelle.scheduling.scheduler import AFFINITY_ENTRY_BYTES, PreemptionPolicy, Scheduler
from passerelle.scheduling.swapper import Swapper
from passerelle.tenants.keys import KeyRing
from passerelle.tenants.manage import KeyManager
from passerelle.tenants.policy import KeyPolicy
from passerelle.tenants.stores import Stores

log = logging.getLogger("passerelle.server.build")


def budget_gib(rt: RuntimesConfig) -> float:
    """The memory budget in GiB: ``max_loaded_gib``, or ``max_loaded`` (a share) of the machine."""
    share = budget_share(rt.max_loaded) if rt.max_loaded else None
    if share is None:
        return rt.max_loaded_gib
    total = machine_gib(rt.memory)
    log.info("memory budget: %s of %.1f GiB (%s) = %.1f GiB", rt.max_loaded, total, rt.memory, share * total)
    return share * total


@dataclass
class Parts:
    """A gateway's long-lived parts, as :func:`build` wired them."""

    metrics: Metrics
    registry: Registry
    access_log: AccessLog
    scheduler: Scheduler
    supervisor: Supervisor
    runtime_metrics: RuntimeMetrics
    swapper: Swapper
    stores: Stores
    key_manager: KeyManager
    keys: KeyPolicy
    catalogue: Catalogue
    live: LiveStats
    tracer: RequestTracer | None
    gateway: Gateway


def build(cfg: Config, backends: list[Backend], processes: list[RuntimeProcess] | None = None, *,
          on_queue_change: Callable[[], None] | None = None) -> Parts:
    """Every part of a gateway for ``cfg``, wired (``on_queue_change``: the scheduler's queue changed)."""
    metrics = Metrics(tenant_label=cfg.metrics.tenant_label, enabled=cfg.metrics.enabled)
    registry = Registry(backends, metrics)
    sc = cfg.scheduler
    scheduler = Scheduler(cfg.classes, aging_s=sc.aging_s, on_change=on_queue_change,
                          policy=cfg.routing.policy, affinity_slack=cfg.routing.affinity_slack,
                          hold_s=sc.hold_s, max_tenants=sc.max_tenants, tenant_queue_share=sc.tenant_queue_share,
                          affinity_max_entries=cfg.routing.affinity_max_bytes // AFFINITY_ENTRY_BYTES,
                          preemption=PreemptionPolicy(sc.preempt_after_ms / 1000, sc.min_run_s)
                          if sc.preemption else None)
    if (preemptor := scheduler.preemptor) is not None:
        metrics.suspensions.read = lambda: preemptor.suspensions
    supervisor = Supervisor(processes or [], max_loaded_gib=budget_gib(cfg.runtimes), memory_kind=cfg.runtimes.memory,
                            book=MemoryBook(cfg.state_path() / "runtime-memory.json"), on_ready=scheduler.dispatch)
    for proc in supervisor.processes.values():
        proc.on_ready = scheduler.dispatch
    # Loading and unloading models as the queue asks (scheduling/swapper.py)
    runtime_metrics = RuntimeMetrics(metrics.registry)
    swapper = Swapper(scheduler, supervisor, cfg.runtimes, runtime_metrics)
    scheduler.on_need = supervisor.on_change = swapper.poke
    # Keys, usage, quotas' counters and the pair's lock: SQLite or PostgreSQL, chosen once (tenants/stores.py)
    stores = Stores.open(cfg)
    keyring = KeyRing(stores.keys)
    keys = KeyPolicy(cfg, keyring, load_usage=stores.load_usage)  # who, which models, quotas, limits
    keys.quotas.shared = stores.quotas
    # A tenant label is a key's tenant or "other": a client's `user` never makes a series.
    metrics.is_known_tenant = keyring.has_tenant
    catalogue = Catalogue(cfg.models, registry, supervisor=supervisor, eta=swapper.eta_s)
    metrics.is_known_model = catalogue.serves
    # The dashboard's rolling window (/admin/stats, /ui), fed with every finished request.
    live = LiveStats(window_s=cfg.metrics.window_s, classes=[c.name for c in cfg.classes])
    listeners: list[Callable[[RequestRecord], None]] = [stores.usage.record, keys.activity.observe]
    if cfg.metrics.enabled:
        listeners.append(live.observe)
    tracer = start_tracer(cfg.tracing, cfg.source) if cfg.tracing.enabled else None  # (off: never imported)
    if tracer is not None:
        listeners.append(tracer.observe)  # a finished record's spans (observe/tracing.py)
        if (pipe := tracer.pipe) is not None:
            metrics.trace_spans_dropped.read = lambda: pipe.dropped
            metrics.trace_exporter_restarts.read = lambda: pipe.restarts
    gateway = Gateway(cfg, registry, metrics, AccessLog(enabled=cfg.server.access_log, fmt=cfg.server.log_format),
                      scheduler, keys, catalogue, on_demand=swapper.poke, listeners=listeners, tracer=tracer)
    return Parts(metrics=metrics, registry=registry, access_log=gateway.access_log, scheduler=scheduler,
                 supervisor=supervisor, runtime_metrics=runtime_metrics, swapper=swapper, stores=stores,
                 key_manager=KeyManager(stores.keys, [c.name for c in cfg.classes]), keys=keys, catalogue=catalogue,
                 live=live, tracer=tracer, gateway=gateway)
