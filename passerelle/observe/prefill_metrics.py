"""Metrics of the prefill cost the scheduler orders and places by (scheduling/prefill.py), read
from its book at each scrape.

The book lives in the scheduler (a layer above this one): the gateway wires ``read`` to a function
returning a :class:`PrefillSnapshot`, so the request path adds nothing to keep them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry


@dataclass
class PrefillSnapshot:
    rates: dict[str, float] = field(default_factory=dict)  # backend -> measured prompt tokens/s
    deferred: int = 0
    aged: int = 0


class PrefillCollector(Collector):
    def __init__(self, registry: CollectorRegistry) -> None:
        self.read: Callable[[], PrefillSnapshot] = PrefillSnapshot
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        s = self.read()
        rates = GaugeMetricFamily("passerelle_prefill_tokens_per_second", "Each runtime's prompt processing "
                                  "rate (tokens not cached), from its own timings (a moving average).",
                                  labels=["backend"])
        for name, rate in sorted(s.rates.items()):
            rates.add_metric([name], rate)
        yield rates
        yield CounterMetricFamily("passerelle_prefill_first", "Requests started before an earlier request of "
                                  "their tenant and class, for having less prompt to compute.", value=s.deferred)
        yield CounterMetricFamily("passerelle_prefill_deferred_to_bound", "Requests that started only after "
                                  "waiting [scheduler] prefill_defer_s (no later request passes them then).",
                                  value=s.aged)
