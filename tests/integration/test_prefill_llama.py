"""The prefill rate the scheduler orders and places by (scheduling/prefill.py), learned from a real
llama-server's own timings: it agrees with the runtime's own average."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.conftest import upstream_config, wait_until
from tests.integration.test_scheduling_llama import chat

pytestmark = pytest.mark.llama


def gauge(url: str, pattern: str) -> float | None:
    m = re.search(rf"^{pattern} (\S+)$", httpx.get(url + "/metrics", timeout=10).text, re.M)
    return float(m.group(1)) if m else None


def test_the_prefill_rate_is_learned_from_the_runtimes_timings(gateway, llama_server):
    gw = gateway(upstream_config(llama_server.url, slots=1))
    sent = 0

    def learned() -> float | None:
        nonlocal sent  # a new prompt each time (nothing cached), until a poll saw its work
        sent += 1
        assert chat(gw.url, prompt=f"Request {sent}: " + "lighthouse keeper " * 60, max_tokens=2).status_code == 200
        return gauge(gw.url, r'passerelle_prefill_tokens_per_second\{backend="b1"\}')

    rate = wait_until(learned, 120, what="a prefill rate measured")
    tokens = gauge(llama_server.url, "llamacpp:prompt_tokens_total")
    seconds = gauge(llama_server.url, "llamacpp:prompt_seconds_total")
    assert tokens and seconds
    own = tokens / seconds  # the runtime's average since it started (other tests' prompts too)
    assert own / 4 < rate < own * 4, (rate, own)
