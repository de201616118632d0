"""Reading a runtime's Prometheus text exposition into plain numbers."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def parse_samples(text: str) -> dict[str, float]:
    """Sum each sample name over its labels: ``{"vllm:num_requests_running": 2.0, …}``.

    Raises ValueError on text that is not the Prometheus exposition format.
    """
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out
