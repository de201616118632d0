"""Every long-lived part of one gateway, and the one path a setting takes to its part.

:func:`~passerelle.server.build.build` makes the parts and hands them to a :class:`Service`,
which applies the configuration through :meth:`Service.configure`; a reload re-reads the file
and calls the same method with what may apply at once. Each part takes its own section through
its own ``configure``, so no setting is copied anywhere else:

    [server]    body budget and deadline (the login form's too), forwarded trust, CORS, the gateway's body caps
    [timeouts]  every backend's timeouts, the gateway's deadline and write watchdog
    [admin]     the admin guard (allow, key, hosts) and its key check, which the login form, the
                key API and the Batch API hold too (one reading of the key)
    [auth]      the key policy (throttle, anonymous classes, forwarded users), usage retention
    [scheduler] [routing] classes   the scheduler and its preemptor, the session gate
    [runtimes]  the supervisor's budget, the swapper's policy
    [limits]    the answer budget, the key policy's media costs

One setting, from the file to its part (``[routing] max_session_in_flight``): ``load_config`` →
``Service.configure(cfg)`` → ``Gateway.configure(cfg)`` → ``SessionGate.configure(cfg.routing)``
→ ``gate.max_in_flight``, read by ``enter`` for every request with a session.

Example::

    service = build(cfg, backends, processes, loader=load)   # configured: service.cfg is cfg
    await service.start()
    await service.reload()                                    # the file again: plan, fleet, configure
    await service.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from passerelle.batches.api import BatchApi
from passerelle.config import Config
from passerelle.errors import ConfigError, InvalidRequest
from passerelle.observe.accesslog import AccessLog
from passerelle.observe.livestats import LiveStats
from passerelle.observe.metrics import Metrics
from passerelle.observe.runtime_metrics import RuntimeMetrics
from passerelle.observe.tracing import RequestTracer
from passerelle.proxy.gateway import Gateway
from passerelle.runtimes import embedded
from passerelle.runtimes.boxes import BoxBackend, Boxes
from passerelle.runtimes.catalogue import Catalogue
from passerelle.runtimes.factory import expand
from passerelle.runtimes.fleet import Fleet, drain
from passerelle.runtimes.kinds import Backend
from passerelle.runtimes.registry import Registry
from passerelle.runtimes.reload_plan import effective, plan_reload
from passerelle.runtimes.supervisor import RuntimeFailed, Supervisor
from passerelle.scheduling.scheduler import Scheduler
from passerelle.scheduling.swapper import Swapper
from passerelle.server.admin import AdminGuard
from passerelle.server.connections import BodyBudget
from passerelle.server.forwarded import ForwardedTrust
from passerelle.server.keys_api import KeysApi
from passerelle.server.login import AdminLogin
from passerelle.server.sdnotify import Notifier
from passerelle.server.shutdown import ShuttingDown, end_open_requests
from passerelle.tenants.manage import KeyManager
from passerelle.tenants.people import PeopleBook
from passerelle.tenants.policy import KeyPolicy
from passerelle.tenants.stores import Stores

log = logging.getLogger("passerelle.server.service")


class ReloadRefused(InvalidRequest):
    status, code = 409, "reload_refused"


_REFUSED = "Reload refused, the running configuration stays"


@dataclass(eq=False, repr=False)
class Service:
    """The parts (built and wired by build.py), their settings, start, reload and stop."""

    cfg: Config
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
    keys_api: KeysApi
    body_budget: BodyBudget  # request bodies held at once, and their deadline
    forwarded: ForwardedTrust  # who the client is behind a proxy
    admin_guard: AdminGuard
    admin_login: AdminLogin
    loader: Callable[[], Config] | None = None  # re-reads the configuration for a reload
    # The configuration lists backends (not the embedded default): a reload to none is refused.
    backends_configured: bool = True
    people: PeopleBook | None = None  # the names and emails a front-end forwards (tenants/people.py)
    boxes: Boxes | None = None  # [[boxes]]: other boxes' models as replicas here (runtimes/boxes.py)
    # What a reload changes in the backends (runtimes/fleet.py), and who hears the list changed.
    batches: BatchApi = field(init=False)  # (built by build.py with the service itself: batches/parts.py)
    fleet: Fleet = field(init=False)
    on_backends_change: Callable[[], None] | None = field(init=False, default=None)
    cors: set[bytes] = field(init=False, default_factory=set)  # [server] cors_origins, encoded (the app reads it)
    notifier: Notifier | None = field(init=False, default=None)  # systemd's notify socket (server/sdnotify.py)
    started_at: float = field(init=False, default_factory=time.time)
    _tasks: set[asyncio.Future[Any]] = field(init=False, default_factory=set)
    _reload_lock: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)  # one reload at a time
    _ending: asyncio.Future[None] | None = field(init=False, default=None)
    # passerelle_requests_waiting as last set, per (model, class): _queue_changed sets what changed
    _waiting_shown: dict[tuple[str, str], int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.fleet = Fleet(self.registry, self.supervisor, on_ready=self.scheduler.dispatch,
                           on_change=self._backends_changed)
        self.scheduler.on_change = self._queue_changed

    # -- settings: the one path ----------------------------------------------------------------
    def configure(self, cfg: Config) -> None:
        """Apply ``cfg`` to every part, each through its own ``configure``: at start-up (build.py)
        and at every reload (with the settings that need a restart kept at their running values,
        reload_plan.effective)."""
        self.cfg = cfg
        s = cfg.server
        self.scheduler.configure(cfg.scheduler, cfg.routing, cfg.classes)  # (its preemptor too)
        self.scheduler.sessions.configure(cfg.sessions)  # (held slots, saved KV's bounds)
        self.gateway.configure(cfg)  # what requests read, the session gate, the answer budget
        self.keys.configure(cfg)
        self.supervisor.configure(cfg.runtimes)
        self.swapper.configure(cfg.runtimes)
        self.stores.configure(cfg)
        self.key_manager.configure([c.name for c in cfg.classes])
        self.live.configure([c.name for c in cfg.classes])  # (the dashboard's rows)
        self.admin_guard.configure(cfg.admin)  # a new key: the old one and its login cookies fail at once
        self.forwarded.configure(s)
        self.body_budget.configure(s)
        for b in self.registry.backends:
            b.configure(cfg.timeouts)
        self.cors.clear()
        self.cors.update(o.encode() for o in s.cors_origins)

    # -- life ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.supervisor.start_all()
        await self.registry.start()
        self.registry.on_up = self.scheduler.dispatch
        if self.boxes is not None:
            self.boxes.on_change = self._box_replicas
            await self.boxes.start()
        await self.stores.start()
        if self.people is not None:
            self.people.start()
        await self.batches.start()
        # What exists after start-up lives as long as the process: keep it out of every
        # collection, and collect less often (full collections paused the loop for 40-50 ms).
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 20, 20)
        if self.loader is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not on Windows / off the main thread
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload_in_background)

    def begin_shutdown(self) -> None:
        """The server stopped accepting: requests still running after ``shutdown_grace_s`` are
        ended with an error event or a 503, and the cause ``shutdown`` (shutdown.py)."""
        grace = self.cfg.server.shutdown_grace_s

        async def end_after_grace() -> None:
            await asyncio.sleep(grace)
            if n := await end_open_requests(self.gateway.open, ShuttingDown(grace)):
                log.warning("shutdown: %d request(s) still running after %g s ended with an error", n, grace)

        if self._ending is None:
            self._ending = asyncio.ensure_future(end_after_grace())

    async def stop(self) -> None:
        if self._ending is not None:
            self._ending.cancel()
        await self.batches.stop()  # (its lines' usage rows are written by the usage store's stop)
        await self.swapper.stop()
        if self.boxes is not None:
            await self.boxes.stop()
        await self.registry.stop()
        await self.supervisor.stop_all()
        self.access_log.flush()  # (requests cut short after this are flushed at exit)
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # the spans still buffered, sent
        if self.people is not None:
            await self.people.stop()
            await asyncio.to_thread(self.people.close)
        await self.stores.close()  # usage still buffered written, the pair's lock freed for the standby at once

    def banner(self, admin_url: str) -> str:
        """What start-up prints: where it serves, the key store, each backend."""
        s = self.cfg.server
        ring = self.keys.ring
        n_keys = len(ring.active) if ring is not None else 0
        auth = (f"{n_keys} active key{'s' if n_keys != 1 else ''}, a key is required" if self.keys.in_use
                else "no key yet, requests need none")
        lines = [f"passerelle serving on http://{s.host}:{s.port}/v1  (OpenAI-compatible; health at /health)",
                 f"  dashboard at {admin_url}/ui, metrics at {admin_url}/metrics",
                 f"  key store {self.stores.keys.path} ({auth})"]
        for b in self.registry.backends:
            cap = b.capacity_info
            size = f"capacity {cap.describe()}" if b.stats.up or cap.declared else "capacity asked once it is up"
            lines.append(f"  backend {b.name} ({b.kind}) at {b.url}: models {', '.join(b.models)} "
                         f"[{', '.join(b.endpoints)}], {size}, {'up' if b.stats.up else 'DOWN'}")
        e = self.cfg.embedded
        if (not e.model_path and not embedded.BUILTIN[e.model].chat
                and any(b.cfg.name == "local" for b in self.registry.backends)):
            lines.append(f"  note: {e.served_id} is a small base model: it continues text rather than chats "
                         f"([embedded] model = \"{embedded.DEFAULT_MODEL_ID}\" answers; or serve your own GGUF "
                         "with [embedded] model_path)")
        return "\n".join(lines)

    # -- what it says about itself ---------------------------------------------------------------
    def waiting_by_class(self) -> Mapping[str, int]:
        """Requests waiting in passerelle's queue, by class."""
        return self.scheduler.waiting_by_class()

    def readiness(self) -> tuple[list[str], list[str]]:
        """The backends up, and the on-demand ones that start when asked: ready if either."""
        up = [b.name for b in self.registry.backends if b.stats.up]
        on_demand = [b.name for b in self.registry.backends if b.cfg.on_demand and not b.stats.up and not b.draining]
        return up, on_demand

    def is_ready(self) -> bool:
        return any(self.readiness())

    def service_status(self) -> str:
        """One line for systemd's STATUS= (``systemctl status``)."""
        up, on_demand = self.readiness()
        if not up and not on_demand:
            return "waiting for a backend to come up"
        s = self.cfg.server
        more = f", {len(on_demand)} on demand" if on_demand else ""
        return f"serving on {s.host}:{s.port}: {len(up)} backend(s) up{more}, {len(self.gateway.open)} request(s) open"

    def _queue_changed(self) -> None:
        counts: dict[tuple[str, str], int] = {}
        for job in self.scheduler.waiting:
            counts[(job.model, job.cls.name)] = counts.get((job.model, job.cls.name), 0) + 1
        # (called on every request's dispatch: only a count that changed is set, through a kept child)
        shown, metrics, waiting = self._waiting_shown, self.metrics, self.metrics.waiting
        for model in self.catalogue.names:
            for cls in self.cfg.classes:
                key = (model, cls.name)
                n = counts.get(key, 0)
                if shown.get(key) != n:
                    shown[key] = n
                    metrics.labelled(waiting, model, cls.name).set(n)

    def _box_replicas(self, replicas: list[Backend]) -> None:
        """Other boxes' replicas came, went, or changed health: the registry holds them beside this
        box's backends, and queued requests may go to one that is up now."""
        current = self.registry.backends
        if [b for b in current if isinstance(b, BoxBackend)] != replicas:
            self.registry.set_backends([b for b in current if not isinstance(b, BoxBackend)] + replicas)
            self._backends_changed()
        self.scheduler.dispatch()

    def _reload_boxes(self, cfg: Config) -> None:
        """A reload's ``[[boxes]]`` (runtimes/boxes.py: Boxes.reconfigure): boxes added are read at
        once; the replicas of boxes removed take no new request, finish theirs (at most
        ``[runtimes] drain_timeout_s``) and go."""
        if self.boxes is None:
            if not cfg.boxes:
                return
            self.boxes = Boxes((), cfg.timeouts)
            self.boxes.on_change = self._box_replicas
        boxes = self.boxes
        leaving = boxes.reconfigure(cfg.boxes, cfg.timeouts)
        if not leaving:
            return

        async def retire() -> None:
            timeout_s = cfg.runtimes.drain_timeout_s
            _, cut = await drain(leaving, timeout_s)
            if cut:
                log.warning("reload: drain timeout (%g s): %d request(s) on removed boxes' replicas cut", timeout_s,
                            cut)
            await boxes.forget(leaving)

        self._spawn(retire(), "retire-box-replicas")

    def _backends_changed(self) -> None:
        if self.on_backends_change is not None:
            self.on_backends_change()

    # -- reload --------------------------------------------------------------------------------
    def _spawn(self, coro: Any, name: str) -> None:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def reload_in_background(self) -> None:
        """SIGHUP's: :meth:`reload`, its refusal or failure logged."""
        async def run() -> None:
            try:
                await self.reload()
            except InvalidRequest as exc:
                log.error("%s", exc.message)
            except Exception:  # (a task's exception nobody retrieves would be logged without context)
                log.exception("reload failed inside the gateway")

        self._spawn(run(), "reload")

    async def reload(self, *, force: bool = False) -> dict[str, Any]:
        """:meth:`_reload`, told to systemd (RELOADING=1, then READY=1) when it runs the gateway."""
        notifier = self.notifier
        if notifier is None:
            return await self._reload(force=force)
        notifier.reloading()
        try:
            return await self._reload(force=force)
        finally:
            notifier.reloaded(self.service_status())

    async def _reload(self, *, force: bool = False) -> dict[str, Any]:
        """Re-read the configuration and carry out its plan (runtimes/reload_plan.py): new runtimes
        start and are ready before those they replace drain (runtimes/fleet.py), unchanged backends
        are not touched and keep their streams, every setting that can applies at once (through
        :meth:`configure`, as at start-up), and the answer names those that wait for a restart. A
        configuration that cannot be read or cannot serve (a runtime that fails to start) is
        refused: the running one stays, whole.

        A file that lists no backend means "the embedded default"; while backends are configured,
        that is far more often a file emptied or cut short by an editor or a deploy than a wish to
        drain them all, so it is refused unless ``force`` (``passerelle reload --force``)."""
        loader = self.loader
        if loader is None:
            raise InvalidRequest("This gateway has no configuration file to reload.")
        async with self._reload_lock:
            try:
                raw = await asyncio.to_thread(loader)
            except (ConfigError, OSError) as exc:
                raise ReloadRefused(f"{_REFUSED}: {exc}") from None
            if raw.uses_embedded and self.backends_configured and not force:
                names = ", ".join(b.name for b in self.registry.backends)
                raise ReloadRefused(f"{_REFUSED}: {raw.source} lists no [[backends]], which would drain every "
                                    f"configured backend ({names}) and start the embedded default. If that is "
                                    "what you want: passerelle reload --force (POST /admin/reload?force=1).")
            try:  # (the embedded default may be built here: minutes, never on the event loop)
                new = await asyncio.to_thread(expand, raw)
            except (ConfigError, OSError) as exc:
                raise ReloadRefused(f"{_REFUSED}: {exc}") from None
            # (what runs: the backends serving now, whatever the file said when they started)
            running_now = dataclasses.replace(self.cfg, backends=tuple(b.cfg for b in self.fleet.serving().values()))
            plan = plan_reload(running_now, new)
            try:
                staged = await self.fleet.stage(plan, new)
            except RuntimeFailed as exc:
                log.error("configuration not reloaded, a new runtime failed to start: %s", exc)
                raise ReloadRefused(f"{_REFUSED}: {exc}") from None
            running = effective(self.cfg, new)
            self.fleet.commit(staged, drain_timeout_s=running.runtimes.drain_timeout_s)
            self.configure(running)
            self._reload_boxes(running)
            self.backends_configured = not raw.uses_embedded
            self.catalogue.configure(running.models)
            self._backends_changed()
        log.info("configuration reloaded: %s", plan.summary())
        if plan.restart:
            log.warning("reload: %s changed in the configuration and apply only once passerelle restarts",
                        ", ".join(plan.restart))
        return plan.as_dict()
