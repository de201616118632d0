"""The composition root: every long-lived part of a gateway, built once and wired together.

``App`` (app.py) answers HTTP; what it and the :class:`~passerelle.proxy.gateway.Gateway` share
(the key policy, the model catalogue, the swapper, the usage store...) is built here and passed
to both, so that neither reaches into the other for it:

    metrics, registry, access log ─► scheduler (+ preemptor) ─► supervisor ─► swapper
    key store ─► key ring ─► key policy (quotas read the usage store)
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
from passerelle.server.active import ActiveLock
from passerelle.tenants.db import connect
from passerelle.tenants.keys import KeyRing, KeyStore
from passerelle.tenants.manage import KeyManager
from passerelle.tenants.pgquota import PgQuotas
from passerelle.tenants.pgusage import PgUsage, PgUsageReader
from passerelle.tenants.policy import KeyPolicy
from passerelle.tenants.store import open_key_store
from passerelle.tenants.usage import UsageReader, UsageRecorder, UsageReports, UsageSink

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
    keystore: KeyStore
    key_manager: KeyManager
    keys: KeyPolicy
    catalogue: Catalogue
    usage: UsageSink
    usage_reader: UsageReports
    shared_quotas: PgQuotas | None  # [store] url: quotas' counters in PostgreSQL
    active_lock: ActiveLock | None  # [store] active_passive: the pair's lock
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
    # Keys, usage and the audit log: one SQLite file per instance (Config.db_path), a
    # connection each for the keys, the usage writer and the reports (tenants/db.py); with
    # [store] url, all of them in PostgreSQL, shared by several gateways (tenants/pg*.py).
    keystore = open_key_store(cfg)
    keyring = KeyRing(keystore)
    usage: UsageSink
    usage_reader: UsageReports
    shared_quotas: PgQuotas | None = None
    active_lock: ActiveLock | None = None
    if cfg.store.url:  # usage rows and quotas' counters in PostgreSQL too (tenants/pgusage.py, pgquota.py)
        st = cfg.store
        usage = PgUsage(st.url, cfg.state_path() / "usage-spool.jsonl", timeout_s=st.timeout_s,
                        retry_s=st.poll_s, spool_max_bytes=st.spool_max_mib << 20)
        usage_reader = PgUsageReader(st.url, timeout_s=st.timeout_s)
        shared_quotas = PgQuotas(st.url, timeout_s=st.timeout_s, retry_s=st.poll_s)
        keys = KeyPolicy(cfg, keyring, load_usage=shared_quotas.load)
        keys.quotas.shared = shared_quotas
        if st.active_passive:
            active_lock = ActiveLock(st.url, poll_s=st.lock_poll_s, timeout_s=st.timeout_s, offline_s=st.offline_s)
    else:
        recorder = UsageRecorder(connect(cfg.db_path()),
                                 refused_retention_s=cfg.auth.usage_refused_retention_days * 86400.0,
                                 max_rows=cfg.auth.usage_max_rows)
        reader = UsageReader(cfg.db_path())

        async def usage_since(key_id: str, starts: list[float]) -> list[tuple[int, int]]:
            """A key's tokens and requests since each of ``starts``, for its quotas (rows still
            buffered included)."""
            await recorder.flush()
            return await reader.used_since(key_id, starts)

        usage, usage_reader = recorder, reader
        keys = KeyPolicy(cfg, keyring, load_usage=usage_since)  # who, which models, quotas, limits
    # A tenant label is a key's tenant or "other": a client's `user` never makes a series.
    metrics.is_known_tenant = keyring.has_tenant
    catalogue = Catalogue(cfg.models, registry, supervisor=supervisor, eta=swapper.eta_s)
    metrics.is_known_model = catalogue.serves
    # The dashboard's rolling window (/admin/stats, /ui), fed with every finished request.
    live = LiveStats(window_s=cfg.metrics.window_s, classes=[c.name for c in cfg.classes])
    listeners: list[Callable[[RequestRecord], None]] = [usage.record, keys.activity.observe]
    if cfg.metrics.enabled:
        listeners.append(live.observe)
    tracer = start_tracer(cfg.tracing, cfg.source) if cfg.tracing.enabled else None  # (off: never imported)
    if tracer is not None and (pipe := tracer.pipe) is not None:
        metrics.trace_spans_dropped.read = lambda: pipe.dropped
    gateway = Gateway(cfg, registry, metrics, AccessLog(enabled=cfg.server.access_log, fmt=cfg.server.log_format),
                      scheduler, keys, catalogue, on_demand=swapper.poke, listeners=listeners, tracer=tracer)
    return Parts(metrics=metrics, registry=registry, access_log=gateway.access_log, scheduler=scheduler,
                 supervisor=supervisor, runtime_metrics=runtime_metrics, swapper=swapper, keystore=keystore,
                 key_manager=KeyManager(keystore, [c.name for c in cfg.classes]), keys=keys, catalogue=catalogue,
                 usage=usage, usage_reader=usage_reader, shared_quotas=shared_quotas, active_lock=active_lock,
                 live=live, tracer=tracer, gateway=gateway)
