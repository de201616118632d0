"""observe_many() must expose exactly what one observe() per value exposes."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from passerelle.observe.metrics import TOKEN_GAP_BUCKETS, observe_many


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
