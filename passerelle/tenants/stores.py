"""Where a gateway keeps its keys, usage, quotas' counters and the pair's lock: chosen once.

``[store] url`` set: all of them in PostgreSQL, shared by several gateways (tenants/pg*.py, and
tenants/active.py for an active-passive pair). Unset: the instance's own SQLite file
(``Config.db_path``), a connection each for the keys, the usage writer and the reports
(tenants/db.py). Everything else asks this object, never ``cfg.store.url``.

Example::

    stores = Stores.open(cfg)
    await stores.start()
    stores.describe()     # the shared store's state for /health (SQLite: None unless amiss)
    stores.export(metrics)  # the same for /metrics
    await stores.close()
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from passerelle.config import Config
from passerelle.observe.metrics import Metrics
from passerelle.tenants.active import ActiveLock
from passerelle.tenants.db import connect
from passerelle.tenants.keys import KeyStore
from passerelle.tenants.pgquota import PgQuotas
from passerelle.tenants.pgstore import PgKeyStore
from passerelle.tenants.pgusage import PgUsage, PgUsageReader
from passerelle.tenants.store import open_key_store
from passerelle.tenants.usage import UsageReader, UsageRecorder, UsageReports, UsageSink
from passerelle.tenants.workers import Worker

LoadUsage = Callable[[str, list[float]], Awaitable[list[tuple[int, int]]]]


@dataclass
class Stores:
    """The stores of one gateway (``quotas`` and ``active`` only with ``[store] url``)."""

    keys: KeyStore
    usage: UsageSink
    reports: UsageReports
    load_usage: LoadUsage  # a key's tokens and requests since each start, for its quotas
    quotas: PgQuotas | None = None  # [store] url: quotas' counters in PostgreSQL
    active: ActiveLock | None = None  # [store] active_passive: the pair's lock

    @property
    def shared(self) -> bool:
        """In PostgreSQL, shared with other gateways."""
        return isinstance(self.keys, PgKeyStore)

    @classmethod
    def open(cls, cfg: Config) -> Stores:
        st = cfg.store
        keys = open_key_store(cfg)
        if st.url:
            quotas = PgQuotas(st.url, timeout_s=st.timeout_s, retry_s=st.poll_s)
            return cls(keys=keys,
                       usage=PgUsage(st.url, cfg.state_path() / "usage-spool.jsonl", timeout_s=st.timeout_s,
                                     retry_s=st.poll_s, spool_max_bytes=st.spool_max_mib << 20),
                       reports=PgUsageReader(st.url, timeout_s=st.timeout_s), load_usage=quotas.load, quotas=quotas,
                       active=ActiveLock(st.url, poll_s=st.lock_poll_s, timeout_s=st.timeout_s,
                                         offline_s=st.offline_s) if st.active_passive else None)
        recorder = UsageRecorder(connect(cfg.db_path()),
                                 refused_retention_s=cfg.auth.usage_refused_retention_days * 86400.0,
                                 max_rows=cfg.auth.usage_max_rows)
        reader = UsageReader(cfg.db_path())

        async def usage_since(key_id: str, starts: list[float]) -> list[tuple[int, int]]:
            """A key's tokens and requests since each of ``starts`` (rows still buffered included)."""
            await recorder.flush()
            return await reader.used_since(key_id, starts)

        return cls(keys=keys, usage=recorder, reports=reader, load_usage=usage_since)

    def configure(self, cfg: Config) -> None:
        """The settings a reload may change (SQLite's retention; PostgreSQL's table is not pruned)."""
        if isinstance(self.usage, UsageRecorder):
            self.usage.refused_retention_s = cfg.auth.usage_refused_retention_days * 86400.0
            self.usage.max_rows = cfg.auth.usage_max_rows

    def workers(self) -> list[Worker]:
        """The writer threads (and SQLite's writer task), each supervised (tenants/workers.py)."""
        out: list[Worker] = []
        if isinstance(self.usage, (PgUsage, UsageRecorder)):
            out.append(self.usage.worker)
        if self.quotas is not None:
            out.append(self.quotas.worker)
        if isinstance(self.keys, PgKeyStore):
            out.append(self.keys.worker)
        if self.active is not None:
            out.append(self.active.worker)
        return out

    def describe(self) -> dict[str, Any] | None:
        """The store as /health shows it: for PostgreSQL, whether it answers (keys, usage written
        back, quotas), what waits on disk or in memory, and the writer threads; for the instance's own
        SQLite file, ``None`` unless something is amiss (a commit failing, rows dropped, a writer
        restarted)."""
        workers = {w.name: w.describe() for w in self.workers()}
        restarted = sum(w["restarts"] for w in workers.values())
        if isinstance(self.usage, UsageRecorder):
            rec = self.usage
            if not (rec.failing or rec.dropped or restarted):
                return None
            usage_up = not rec.failing and not rec.worker.failing
            return {"up": usage_up, "serving_keys": True, "usage_up": usage_up,
                    "usage_rows_waiting": rec.held, "usage_rows_dropped": rec.dropped, "workers": workers}
        if not isinstance(self.keys, PgKeyStore) or not isinstance(self.usage, PgUsage):
            return None
        keys = self.keys.describe()
        usage_up = self.usage.up and not self.usage.worker.failing  # (a copier that fails carries nothing)
        out = {**keys, "usage_up": usage_up, "usage_spooled_bytes": self.usage.pending_bytes,
               "usage_rows_waiting": self.usage.held, "usage_rows_dropped": self.usage.dropped,
               "usage_lines_damaged": self.usage.damaged, "workers": workers}
        up = keys["up"] and usage_up
        if self.quotas is not None:
            out["quotas_up"] = not self.quotas.down
            out["quota_counted_alone"] = self.quotas.counted_alone
            up = up and not self.quotas.down
        out["up"] = up
        return out

    def export(self, metrics: Metrics) -> None:
        """Set the store's metrics from its state (at each scrape of /metrics)."""
        state = self.describe()
        if isinstance(self.usage, UsageRecorder):
            metrics.usage_dropped.set(self.usage.dropped)
            metrics.usage_waiting.set(self.usage.held)
        elif state is not None:
            metrics.store_up.set(1 if state["up"] else 0)
            metrics.usage_spooled.set(state["usage_spooled_bytes"])
            metrics.usage_dropped.set(state["usage_rows_dropped"])
            metrics.usage_waiting.set(state["usage_rows_waiting"])
            metrics.usage_damaged.set(state["usage_lines_damaged"])
            metrics.active.set(1 if self.active is None or self.active.active else 0)
        if self.quotas is not None:
            metrics.quota_counted_alone.set(self.quotas.counted_alone)
        for w in self.workers():
            metrics.store_worker_restarts.labels(w.name).set(w.restarts)

    async def start(self) -> None:
        self.usage.start()
        if self.quotas is not None:
            self.quotas.start()
        if self.active is not None:
            await asyncio.to_thread(self.active.start)

    async def close(self) -> None:
        """Usage rows still buffered written, connections and threads closed (the pair's lock freed
        for the standby at once)."""
        await self.usage.stop()
        self.usage.close()
        self.reports.close()
        if self.quotas is not None:
            await asyncio.to_thread(self.quotas.close)
        if self.shared:
            await asyncio.to_thread(self.keys.close)  # (its polling thread)
        if self.active is not None:
            await asyncio.to_thread(self.active.close)
