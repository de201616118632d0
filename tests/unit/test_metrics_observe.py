"""observe_many() must expose exactly what one observe() per value exposes."""

from __future__ import annotations

import asyncio
import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from passerelle.observe.metrics import LATENCY_BUCKETS, TOKEN_GAP_BUCKETS, observe_many, observe_one
from tests.inprocess import fake_runtime, gateway
from tests.waiting import until


def test_observe_many_equals_observe_one_by_one():
    rng = random.Random(5)
    # values on bucket bounds, between them, below the first and above the last finite one
    values = [*TOKEN_GAP_BUCKETS, 0.0, 1e-6, 0.0042, 75.0, 1e9] + [rng.expovariate(30) for _ in range(2000)]
    texts = []
    for bulk in (False, True):
        registry = CollectorRegistry()
        h = Histogram("gap_seconds", "x", ["backend"], buckets=TOKEN_GAP_BUCKETS, registry=registry)
        child = h.labels("b1")
        if bulk:
            observe_many(child, values[:1000])
            observe_many(child, values[1000:])
            observe_many(child, [])
        else:
            for v in values:
                child.observe(v)
        texts.append([line for line in generate_latest(registry).decode().splitlines()
                      if not line.startswith("gap_seconds_created")])
    def split(lines: list[str]) -> tuple[list[str], float]:
        (total,) = [float(x.split()[-1]) for x in lines if x.startswith("gap_seconds_sum")]
        return [x for x in lines if not x.startswith("gap_seconds_sum")], total

    (one, one_sum), (bulk, bulk_sum) = split(texts[0]), split(texts[1])
    assert one == bulk  # every bucket and the count
    assert abs(one_sum - bulk_sum) <= 1e-12 * one_sum  # the sum, to the order of additions
    assert f'gap_seconds_count{{backend="b1"}} {float(len(values))}' in texts[1]


def test_observe_counts_one_record_under_the_catalogues_names_only():
    """Metrics.observe(record): the cause, the queue wait, the latencies and the tokens of one
    finished request; a model name the catalogue does not serve is never a label of its own."""
    from passerelle.errors import Cause
    from passerelle.observe.metrics import Metrics
    from passerelle.observe.record import RequestRecord

    m = Metrics(tenant_label=False)
    m.is_known_model = lambda name: name == "served"
    for model in ("served", "made-up-by-a-client"):
        rec = RequestRecord(id="r", endpoint="chat", model=model, backend="b1", priority="batch", stream=True)
        rec.t_queued = rec.t_arrival
        rec.t_dispatch = rec.t_first = rec.t_arrival + 0.1
        rec.gaps.extend([0.01, 0.02])
        rec.prompt_tokens, rec.completion_tokens = 7, 3
        rec.finish(Cause.OK, 200)
        m.observe(rec)
    text = generate_latest(m.registry).decode()
    assert 'passerelle_requests_total{cause="ok",model="served",priority="batch"} 1.0' in text
    assert 'passerelle_requests_total{cause="ok",model="unknown",priority="batch"} 1.0' in text
    assert "made-up" not in text
    assert 'passerelle_prompt_tokens_total{backend="b1",model="served",priority="batch"} 7.0' in text
    assert 'passerelle_inter_token_latency_seconds_count{backend="b1",model="served",priority="batch"} 2.0' in text
    assert 'passerelle_queue_wait_seconds_count{model="unknown",priority="batch"} 1.0' in text


async def test_the_waiting_gauge_follows_the_queue_through_kept_children():
    """passerelle_requests_waiting is set only where a count changed, through children kept by
    Metrics.labelled: it must still show the queue as it grows and empties, per class."""
    body = {"model": "fake-model", "stream": True, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with fake_runtime(ttft_ms=200, itl_ms=1) as fake, gateway(fake.backend_config(max_concurrency=1)) as gw:
        metrics = gw.app.metrics

        def waiting() -> float | None:
            return metrics.registry.get_sample_value("passerelle_requests_waiting",
                                                     {"model": "fake-model", "priority": "standard"})

        tasks = [asyncio.ensure_future(gw.post("/v1/chat/completions", body)) for _ in range(3)]
        await until(lambda: waiting() == 2.0, what="two requests queued behind the one running")
        assert metrics.labelled(metrics.waiting, "fake-model", "standard") is \
            metrics.labelled(metrics.waiting, "fake-model", "standard")  # one child, kept
        await until(lambda: waiting() == 1.0, timeout=10, what="the first one done, the next one running")
        assert [r.status for r in await asyncio.gather(*tasks)] == [200, 200, 200]
        assert waiting() == 0.0
        assert metrics.registry.get_sample_value(
            "passerelle_requests_total", {"model": "fake-model", "priority": "standard", "cause": "ok",
                                          "tenant": "anonymous"}) == 3.0


def test_observe_one_equals_observe():
    """observe_one() (the bucket by bisection) must expose what observe() does, on the bounds, between
    them, past the last finite one, negative, infinite and NaN."""
    rng = random.Random(9)
    values = [*LATENCY_BUCKETS, 0.0, -1.0, 1e-9, 0.0051, 61.0, float("inf"), float("nan")]
    values += [rng.lognormvariate(-2, 2) for _ in range(500)]
    texts = []
    for fast in (False, True):
        registry = CollectorRegistry()
        child = Histogram("lat_seconds", "x", ["b"], buckets=LATENCY_BUCKETS, registry=registry).labels("b1")
        for v in values:
            observe_one(child, v) if fast else child.observe(v)
        texts.append([line for line in generate_latest(registry).decode().splitlines()
                      if not line.startswith("lat_seconds_created")])
    assert texts[0] == texts[1]
