"""Metrics of sessions' KV (scheduling/session_kv.py), read from its counts at each scrape.

The counts live in the scheduler's ``SessionKv`` (a layer above this one): the gateway wires
``read`` to a function returning a :class:`SessionKvSnapshot`, so a scrape copies nothing else and
the request path adds nothing to keep them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry


@dataclass
class SessionKvSnapshot:
    saves: dict[str, int] = field(default_factory=dict)  # outcome -> saves
    restores: dict[str, int] = field(default_factory=dict)  # outcome -> restores
    holds: dict[str, int] = field(default_factory=dict)  # outcome -> holds
    erases: int = 0
    evictions: int = 0
    bytes: int = 0
    files: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


class SessionKvCollector(Collector):
    def __init__(self, registry: CollectorRegistry) -> None:
        self.read: Callable[[], SessionKvSnapshot] = SessionKvSnapshot
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        s = self.read()
        saves = CounterMetricFamily("passerelle_session_kv_saves", "Slots' session KV saved to disk before "
                                    "another request took the slot, by outcome (ok, failed).", labels=["outcome"])
        for outcome, n in s.saves.items():
            saves.add_metric([outcome], n)
        yield saves
        restores = CounterMetricFamily("passerelle_session_kv_restores", "Sessions' saved KV restored into a "
                                       "slot before their turn, by outcome (ok, failed, missing).", labels=["outcome"])
        for outcome, n in s.restores.items():
            restores.add_metric([outcome], n)
        yield restores
        holds = CounterMetricFamily("passerelle_session_holds", "Slots held for a session's next turn, by how "
                                    "they ended (kept by the session, taken by another request, lapsed).",
                                    labels=["outcome"])
        for outcome, n in s.holds.items():
            holds.add_metric([outcome], n)
        yield holds
        yield CounterMetricFamily("passerelle_session_kv_erases", "Slots erased as they passed from one tenant's "
                                  "session to another tenant's request.", value=s.erases)
        yield CounterMetricFamily("passerelle_session_kv_evictions", "Saved session KV files removed to stay "
                                  "within [sessions] max_saved_bytes / max_saved_files (least recently used).",
                                  value=s.evictions)
        yield GaugeMetricFamily("passerelle_session_kv_bytes", "Saved session KV on disk, all runtimes.",
                                value=s.bytes)
        yield GaugeMetricFamily("passerelle_session_kv_files", "Saved session KV files on disk, all runtimes.",
                                value=s.files)
        yield CounterMetricFamily("passerelle_session_prompt_tokens", "Prompt tokens of sessions' turns.",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily("passerelle_session_cached_prompt_tokens", "Prompt tokens of sessions' turns "
                                  "the runtime took from its cache (as it reported them).", value=s.cached_tokens)
