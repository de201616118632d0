"""Metric definitions (Prometheus). Names and meanings follow vLLM's metrics of the same suffix.

``docs/metrics.md`` documents each one. Label children are cached per label set, because
``Histogram.labels()`` on every observation would cost more than the observation itself.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from passerelle.errors import Cause
from passerelle.observe.prefill_metrics import PrefillCollector
from passerelle.observe.record import RequestRecord
from passerelle.observe.session_metrics import SessionKvCollector

# 5 ms to 60 s, denser where interactive targets sit (100 ms – 3 s).
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                     0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
# One label set's (ttft, itl, tpot, e2e, prompt_tokens, generation_tokens) children.
RequestChildren = tuple[Histogram, Histogram, Histogram, Histogram, Counter, Counter]


def observe_many(child: Histogram, values: Sequence[float]) -> None:
    """``child.observe(v) for v in values``, with one lock round per bucket touched instead of two
    per value: a stream's inter-token gaps are thousands of observations at once.

    Uses prometheus_client's histogram internals (bucket counters, not cumulative, and ``_sum``);
    tests/unit/test_metrics_observe.py checks the exposition equals one-by-one observation.
    """
    if not values:
        return
    bounds = getattr(child, "_upper_bounds", None)
    if bounds is None:  # not the internals this was written for: the plain way
        for v in values:
            child.observe(v)
        return
    # observe() puts v in the first bucket whose bound is >= v: with the values sorted, the
    # number of values up to each bound is one bisection, and a bucket gets the difference.
    xs = sorted(values)
    buckets = child._buckets
    done = 0
    for i, bound in enumerate(bounds):
        upto = bisect_right(xs, bound)
        if upto > done:
            buckets[i].inc(upto - done)
            done = upto
            if done == len(xs):
                break
    child._sum.inc(math.fsum(xs))


def observe_one(child: Histogram, value: float) -> None:
    """``child.observe(value)`` with the bucket found by bisection rather than a scan of the bounds
    (a request observes three or four latencies as it ends). Same internals as :func:`observe_many`;
    a NaN, or a histogram without them, takes the plain way."""
    bounds = getattr(child, "_upper_bounds", None)
    if bounds is None or value != value:
        child.observe(value)
        return
    child._sum.inc(value)
    child._buckets[bisect_left(bounds, value)].inc(1)  # (the first bound >= value; the last is +Inf)


class ReadCounter(Collector):
    """A counter whose one count another object keeps (read at each scrape, never copied)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.read: Callable[[], int] = lambda: 0
        registry.register(self)

    def collect(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.name, self.documentation, value=self.read())]


class Metrics:
    """All of passerelle's metrics, in one registry (one per app, so tests stay independent)."""

    def __init__(self, *, tenant_label: bool = True, enabled: bool = True) -> None:
        self.registry = r = CollectorRegistry()
        self.tenant_label = tenant_label
        # False ([metrics] enabled = false): the gateway skips the per-request latency histograms;
        # counters and gauges are still kept (they cost one addition per request).
        self.enabled = enabled
        req = ["backend", "model", "priority", *(["tenant"] if tenant_label else [])]
        self.ttft = Histogram("passerelle_time_to_first_token_seconds",
                              "Request arrival at the gateway to the first content chunk sent to the client.",
                              req, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("passerelle_inter_token_latency_seconds",
                             "Gap between two consecutive content chunks of a stream.",
                             req, buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.tpot = Histogram("passerelle_request_time_per_output_token_seconds",
                              "(e2e - TTFT) / (output tokens - 1), per request.",
                              req, buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("passerelle_e2e_request_latency_seconds",
                             "Request arrival to the last byte sent to the client.",
                             req, buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("passerelle_queue_wait_seconds",
                                    "Time a request waited in passerelle's queue before dispatch.",
                                    ["model", "priority", *(["tenant"] if tenant_label else [])],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("passerelle_requests_running", "Requests dispatched to a backend, not finished.",
                             ["backend", "model"], registry=r)
        self.waiting = Gauge("passerelle_requests_waiting", "Requests waiting in passerelle's queue.",
                             ["model", "priority"], registry=r)
        self.prompt_tokens = Counter("passerelle_prompt_tokens", "Prompt tokens processed (from usage).",
                                     req, registry=r)
        self.generation_tokens = Counter("passerelle_generation_tokens", "Tokens generated (from usage).",
                                         req, registry=r)
        self.requests = Counter("passerelle_requests", "Requests by termination cause.",
                                ["model", "priority", "cause", *(["tenant"] if tenant_label else [])],
                                registry=r)
        # [[models]] tool_calls (proxy/repair.py): calls a runtime left as text, delivered as tool calls or not
        self.tool_call_repairs = Counter("passerelle_tool_call_repairs", "Tool calls a runtime left as text, by "
                                         "model, format and outcome (repaired, unrepaired).",
                                         ["model", "format", "outcome"], registry=r)
        # tenants/admin_key.py: route is login, admin or batches; reason wrong_key (compared, wrong)
        # or throttled (refused before anything was compared)
        self.admin_key_failures = Counter("passerelle_admin_key_failures", "Attempts at the admin key refused, by "
                                          "route and reason (wrong_key, throttled).", ["route", "reason"],
                                          registry=r)
        # a shared store ([store] url); set when /metrics is read
        self.store_up = Gauge("passerelle_store_up", "1 when the shared store (PostgreSQL) answers; 0 while the "
                              "gateway serves cached keys and spools usage to disk.", registry=r)
        self.usage_spooled = Gauge("passerelle_usage_spool_bytes", "Usage rows on disk not yet written to the "
                                   "shared store.", registry=r)
        self.usage_dropped = Gauge("passerelle_usage_rows_dropped", "Usage rows lost since start: a full "
                                   "spool ([store] spool_max_mib), or past the rows kept while the disk is full.",
                                   registry=r)
        self.usage_waiting = Gauge("passerelle_usage_rows_waiting", "Usage rows in memory because the disk "
                                   "refused them (full): SQLite's failed commits, PostgreSQL's spool; retried.",
                                   registry=r)
        self.usage_damaged = Gauge("passerelle_usage_spool_lines_damaged", "Usage spool lines that could not be "
                                   "read and were skipped, since start.", registry=r)
        self.quota_counted_alone = Gauge("passerelle_quota_counted_alone", "Quota reservations this gateway made "
                                         "alone (the shared counter out of reach, after retries), since start.",
                                         registry=r)
        self.store_worker_restarts = Gauge("passerelle_store_worker_restarts", "Times a store's writer thread "
                                           "failed and was restarted, since start.", ["worker"], registry=r)
        self.active = Gauge("passerelle_active", "1 when this gateway serves; 0 while it is the standby of an "
                            "active-passive pair.", registry=r)
        self.backend_up = Gauge("passerelle_backend_up", "1 when the backend answers its health check.",
                                ["backend"], registry=r)
        self.slots_busy = Gauge("passerelle_backend_slots_busy", "Slots (sequences) the runtime is processing.",
                                ["backend"], registry=r)
        self.slots_total = Gauge("passerelle_backend_slots_total", "Slots the runtime has.", ["backend"],
                                 registry=r)
        self.kv_usage = Gauge("passerelle_backend_kv_cache_usage_ratio", "KV cache in use, 0 to 1.",
                              ["backend"], registry=r)
        self.backend_queue = Gauge("passerelle_backend_queue_depth",
                                   "Requests waiting inside the runtime itself.", ["backend"], registry=r)
        # the scheduler's preemptor counts them (scheduling/preemption.py); read when scraped
        self.suspensions = ReadCounter("passerelle_suspensions", "Streams suspended for a better class.", r)
        # [tracing]'s exporter counts them (observe/span_pipe.py); read when scraped
        self.trace_spans_dropped = ReadCounter(
            "passerelle_trace_spans_dropped", "Finished spans never sent: the exporter was behind or gone.", r)
        self.trace_exporter_restarts = ReadCounter(
            "passerelle_trace_exporter_restarts", "Times [tracing]'s exporter process died and was started again.", r)
        # sessions' KV (scheduling/session_kv.py): its counts, read when scraped
        self.sessions = SessionKvCollector(r)
        # the scheduler's prefill costs (scheduling/prefill.py): rates and reorderings, read when scraped
        self.prefill = PrefillCollector(r)
        self._children: dict[tuple[str, ...], RequestChildren] = {}
        self._labelled: dict[tuple[object, ...], Any] = {}  # (metric, *label values) -> child: labelled()
        # Which tenants get a label of their own (the app answers: those of the API keys); every
        # other one, e.g. a client's `user` field without keys, is counted as "other".
        self.is_known_tenant: Callable[[str], bool] = lambda name: False
        # Which model names get a label of their own (the catalogue's); any other a client sent
        # is counted as "unknown".
        self.is_known_model: Callable[[str], bool] = lambda name: False

    KNOWN = frozenset({"anonymous"})  # a request with neither key nor `user`

    def tenant(self, name: str) -> str:
        """The tenant label value: ``name`` for a known tenant, else ``other``, so that no string a
        client chooses becomes a time series (20 `user` values of 100 KB made one scrape 310 MB)."""
        return name if name in self.KNOWN or self.is_known_tenant(name) else "other"

    def request_children(self, backend: str, model: str, priority: str, tenant: str) -> RequestChildren:
        """(ttft, itl, tpot, e2e, prompt_tokens, generation_tokens) children for one label set."""
        key = (backend, model, priority, self.tenant(tenant)) if self.tenant_label else (backend, model, priority)
        children = self._children.get(key)
        if children is None:
            children = (self.ttft.labels(*key), self.itl.labels(*key), self.tpot.labels(*key), self.e2e.labels(*key),
                        self.prompt_tokens.labels(*key), self.generation_tokens.labels(*key))
            self._children[key] = children
        return children

    def labelled(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, kept: the child of a label set is looked up once, not built
        again by prometheus_client on every request (its ``labels()`` validates and locks, about
        three times the cost of the increment it serves). Label values here are bounded sets (the
        catalogue's models, the known tenants, the classes, the causes), as the metrics need anyway."""
        key = (metric, *values)
        child = self._labelled.get(key)
        if child is None:
            child = self._labelled[key] = metric.labels(*values)
        return child

    def observe(self, rec: RequestRecord) -> None:
        """Count one finished request: its cause, its queue wait, its latencies (unless
        ``enabled`` is off) and its tokens."""
        model = rec.model if self.is_known_model(rec.model) else "unknown"
        assert rec.cause is not None
        self.count_request(model, rec.priority, rec.cause.value, rec.tenant)
        if rec.tool_call_format:  # (repair on for the request: tools offered to a model with tool_calls set)
            if rec.tool_calls_repaired:
                self.tool_call_repairs.labels(model, rec.tool_call_format, "repaired").inc(rec.tool_calls_repaired)
            if rec.tool_calls_unrepaired:
                self.tool_call_repairs.labels(model, rec.tool_call_format, "unrepaired").inc(
                    rec.tool_calls_unrepaired)
        if rec.t_queued and self.enabled:
            labels = (model, rec.priority, self.tenant(rec.tenant)) if self.tenant_label else (model, rec.priority)
            observe_one(self.labelled(self.queue_wait, *labels), rec.queue_wait)
        if not rec.backend:
            return
        ttft, itl, tpot, e2e, ptok, gtok = self.request_children(rec.backend, model, rec.priority, rec.tenant)
        if rec.cause is Cause.OK and self.enabled:  # [metrics] enabled = false: no histograms
            observe_one(e2e, rec.duration)
            if rec.ttft is not None:
                observe_one(ttft, rec.ttft)
            observe_many(itl, rec.gaps)  # one bucket update per bucket, not per token
            n = rec.output_tokens
            if rec.stream and n > 1 and rec.ttft is not None:
                observe_one(tpot, (rec.t_end - rec.t_first) / (n - 1))
        if rec.prompt_tokens:
            ptok.inc(rec.prompt_tokens)
        if rec.completion_tokens:
            gtok.inc(rec.completion_tokens)

    def count_request(self, model: str, priority: str, cause: str, tenant: str) -> None:
        if self.tenant_label:
            self.labelled(self.requests, model, priority, cause, self.tenant(tenant)).inc()
        else:
            self.labelled(self.requests, model, priority, cause).inc()
