"""The composition root: every long-lived part of a gateway, built once, wired together, and
handed to a :class:`~passerelle.server.service.Service`, which applies the configuration.

``App`` (app.py) answers HTTP; what it and the :class:`~passerelle.proxy.gateway.Gateway` share
(the key policy, the model catalogue, the swapper, the usage store...) is built here and passed
to both, so that neither reaches into the other for it:

    metrics, registry, access log ─► scheduler (+ preemptor) ─► supervisor ─► swapper
    stores (keys, usage, quotas, the pair's lock) ─► key ring ─► key policy
    catalogue (registry, supervisor, swapper's load estimate)
    gateway (all of the above) ─► listeners: usage rows, key activity, the dashboard's window
    body budget, forwarded trust, admin guard and login, the key and batch APIs

Each part's constructor takes the section it reads (never a default of its own), and the last
step is ``service.configure(cfg)``: the very call a reload makes, so start-up and reload take one
path (service.py).

Example::

    service = build(cfg, backends, processes, loader=load)
    service.gateway.keys is service.keys and service.gateway.catalogue is service.catalogue  # True
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from passerelle.batches.api import BatchApi
from passerelle.config import Config
from passerelle.observe.accesslog import AccessLog
from passerelle.observe.livestats import LiveStats
from passerelle.observe.metrics import Metrics
from passerelle.observe.record import RequestRecord
from passerelle.observe.runtime_metrics import RuntimeMetrics
from passerelle.observe.tracing import start_tracer
from passerelle.proxy.gateway import Gateway
from passerelle.runtimes.boxes import Boxes
from passerelle.runtimes.catalogue import Catalogue
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.memory import MemoryBook
from passerelle.runtimes.registry import Registry
from passerelle.runtimes.supervisor import RuntimeProcess, Supervisor
from passerelle.scheduling.scheduler import Scheduler
from passerelle.scheduling.swapper import Swapper
from passerelle.server.admin import AdminGuard
from passerelle.server.connections import BodyBudget
from passerelle.server.forwarded import ForwardedTrust
from passerelle.server.keys_api import KeysApi
from passerelle.server.login import AdminLogin
from passerelle.server.service import Service
from passerelle.tenants.admin_key import AdminKeyCheck
from passerelle.tenants.keys import KeyRing
from passerelle.tenants.manage import KeyManager
from passerelle.tenants.people import open_book
from passerelle.tenants.policy import KeyPolicy
from passerelle.tenants.stores import Stores

log = logging.getLogger("passerelle.server.build")


def build(cfg: Config, backends: list[Backend], processes: list[RuntimeProcess] | None = None, *,
          loader: Callable[[], Config] | None = None, backends_configured: bool = True) -> Service:
    """Every part of a gateway for ``cfg``, wired, and configured by ``service.configure(cfg)``."""
    metrics = Metrics(tenant_label=cfg.metrics.tenant_label, enabled=cfg.metrics.enabled)
    registry = Registry(backends, metrics)
    scheduler = Scheduler(cfg.scheduler, cfg.routing, cfg.classes)
    counts = scheduler.preempt_counts  # (every preemptor a reload builds counts here)
    metrics.suspensions.read = lambda: counts.suspensions
    metrics.sessions.read = scheduler.sessions.snapshot
    metrics.prefill.read = scheduler.prefill.snapshot
    supervisor = Supervisor(processes or [], cfg.runtimes, book=MemoryBook(cfg.state_path() / "runtime-memory.json"),
                            on_ready=scheduler.dispatch)
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
    people = open_book(cfg)  # names and emails beside the ids a front-end forwards
    listeners: list[Callable[[RequestRecord], None]] = [stores.usage.record, keys.activity.observe, people.observe]
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
    key_manager = KeyManager(stores.keys, [c.name for c in cfg.classes])
    # the admin key's one check (throttled before compared), for the admin routes, the login and batches
    admin_key_check = AdminKeyCheck(cfg.admin, failures=metrics.admin_key_failures)
    admin_guard = AdminGuard(cfg.admin, own_hosts=(cfg.server.host, cfg.admin.host), key_check=admin_key_check)
    body_budget = BodyBudget(cfg.server)  # (the login form's body has its deadline too)
    service = Service(
        cfg, metrics=metrics, registry=registry, access_log=gateway.access_log, scheduler=scheduler,
        supervisor=supervisor, runtime_metrics=runtime_metrics, swapper=swapper, stores=stores,
        key_manager=key_manager, keys=keys, catalogue=catalogue, live=live, tracer=tracer, gateway=gateway,
        keys_api=KeysApi(admin_key_check, stores.keys, key_manager, keys, stores.usage, stores.reports, people),
        body_budget=body_budget, forwarded=ForwardedTrust(cfg.server), admin_guard=admin_guard,
        admin_login=AdminLogin(admin_guard, body_budget),
        loader=loader, backends_configured=backends_configured, people=people,
        boxes=Boxes(cfg.boxes, cfg.timeouts) if cfg.boxes else None)  # other boxes' replicas (runtimes/boxes.py)
    # The Batch API: its store beside the keys' database, its lines at the least urgent class; it
    # reads the service's parts (batches/parts.py), so a reload's are the ones it sees.
    service.batches = BatchApi(cfg.batches, cfg.db_path().parent, service, metrics.registry, admin_key_check)
    service.configure(cfg)  # (the call a reload makes)
    return service
