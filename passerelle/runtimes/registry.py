"""The backends by model and route, and their health (the choice of a replica is the scheduler's).

A background poller scrapes every backend on a short interval (health plus the load figures its
runtime reports) and re-exports them as ``passerelle_backend_*`` gauges. A backend that is down
or answers garbage is marked down; it never breaks ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from passerelle.observe.metrics import Metrics
from passerelle.runtimes.kinds import Backend

log = logging.getLogger("passerelle.runtimes.registry")


class Registry:
    """Which backends serve which model on which route, kept up to date by a health poller."""

    def __init__(self, backends: list[Backend], metrics: Metrics, *, poll_interval_s: float = 2.0) -> None:
        self.backends = backends
        self.metrics = metrics
        self.poll_interval_s = poll_interval_s
        self._task: asyncio.Task[None] | None = None
        self.on_up: Callable[[], None] | None = None  # a backend came up: queued requests may go
        self._last_up: dict[str, bool] = {}
        self._by_model: dict[str, list[Backend]] = {}
        self._rebuild()

    def _rebuild(self) -> None:
        by_model: dict[str, list[Backend]] = {}
        pools: dict[tuple[str, str], list[Backend]] = {}
        for b in self.backends:
            for m in b.models:
                by_model.setdefault(m, []).append(b)
                for e in b.endpoints:
                    pools.setdefault((m, e), []).append(b)
        self._by_model, self._pools = by_model, pools

    def set_backends(self, backends: list[Backend]) -> None:
        """Replace the backend list (a reload); requests already dispatched are not affected."""
        self.backends = backends
        self._rebuild()

    @property
    def models(self) -> list[str]:
        return list(self._by_model)

    def serves(self, model: str) -> bool:
        return model in self._by_model

    def backends_of(self, model: str) -> list[Backend]:
        return self._by_model.get(model, [])

    def models_on(self, endpoint: str) -> list[str]:
        """The models some backend serves on ``endpoint``."""
        return [m for (m, e) in self._pools if e == endpoint]

    def pool(self, model: str, endpoint: str) -> list[Backend] | None:
        """The backends serving ``model`` on ``endpoint`` (chat, responses, messages...);
        None when no backend serves the model at all, [] when none serves it there."""
        if model not in self._by_model:
            return None
        return self._pools.get((model, endpoint), [])

    # -- polling ---------------------------------------------------------------------------
    async def start(self) -> None:
        for b in self.backends:
            await b.start()
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever(), name="passerelle-poller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for b in self.backends:
            await b.close()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(b) for b in self.backends))

    async def _poll(self, b: Backend) -> None:
        was_up = self._last_up.get(b.name, False)
        endpoints = b.endpoints
        s = await b.scrape()
        if b.endpoints != endpoints:  # the runtime said what it does not serve: its pools change
            self._rebuild()
            log.info("backend %s serves %s (not %s)", b.name, ", ".join(b.endpoints),
                     ", ".join(e for e in endpoints if e not in b.endpoints) or "-")
        self._last_up[b.name] = s.up
        m, name = self.metrics, b.name
        # 0 for a runtime that is down or answers garbage; routing still follows its health
        m.backend_up.labels(name).set(1 if s.up and not s.error else 0)
        for gauge, value in ((m.slots_busy, s.slots_busy), (m.slots_total, s.slots_total),
                             (m.kv_usage, s.kv_cache_usage_ratio), (m.backend_queue, s.queue_depth)):
            if value is not None:
                gauge.labels(name).set(value)
            else:  # a figure the runtime no longer reports must not stay frozen at its last value
                with contextlib.suppress(KeyError):
                    gauge.remove(name)
        if s.up and not was_up and self.on_up is not None:
            self.on_up()
        if was_up != s.up:  # coming up is news; going down is a warning
            log.log(logging.INFO if s.up else logging.WARNING, "backend %s is %s%s", name,
                    "up" if s.up else "down", f" ({s.error})" if s.error else "")

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll_once()
            except Exception:  # the poller must outlive any one runtime's misbehaviour
                log.exception("backend poll failed")
