"""What an answer assembled from a stream (llama-server's non-streamed requests, proxy/assemble.py)
costs the gateway in memory: at most twice its size at the peak, whatever the API, and all answers
being assembled at once stay within ``[limits] max_answer_bytes_total`` (503 ``answers_busy`` past
it, the runtime's connection closed). Measured with tracemalloc in-process, the client's own copy
of the body left out (``keep_body=False``)."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc

import pytest

from passerelle.config import LimitsConfig, TimeoutConfig
from passerelle.errors import Cause
from tests.inprocess import fake_runtime, gateway
from tests.waiting import until

SIZE = 8 * 1024 * 1024
ASK = {"model": "fake-model", "max_tokens": 5}
BODIES = {
    "/v1/chat/completions": {**ASK, "messages": [{"role": "user", "content": "Write a lot."}]},
    "/v1/completions": {**ASK, "prompt": "Write a lot."},
    "/v1/messages": {**ASK, "messages": [{"role": "user", "content": "Write a lot."}]},
}


def llama(fake, **changes):
    return fake.backend_config(kind="llama-server", endpoints=("chat", "completions", "messages"), **changes)


@pytest.mark.parametrize("path", list(BODIES))
async def test_an_assembled_answer_costs_the_gateway_at_most_twice_its_size(path):
    async with fake_runtime(fault_bytes=SIZE) as fake, gateway(llama(fake)) as gw:
        assert (await gw.post(path, BODIES[path])).status == 200  # (imports and caches warmed up)
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            resp = await gw.post(path, {**BODIES[path], "fake_fault": "big-answer"}, keep_body=False, timeout=60)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert resp.status == 200, resp.body[:300]
        assert resp.size > SIZE
        assert peak <= 2 * resp.size, f"peak {peak / 2**20:.1f} MiB for an answer of {resp.size / 2**20:.1f} MiB"
        assert gw.records[-1].cause is Cause.OK


async def test_answers_held_at_once_stay_within_their_budget_and_each_request_gives_its_share_back():
    limits = LimitsConfig(max_answer_bytes=2 * 1024 * 1024, max_answer_bytes_total=2 * 1024 * 1024)
    timeouts = TimeoutConfig(first_token_s=5, between_tokens_s=0.5, total_s=10)
    path, body = "/v1/chat/completions", BODIES["/v1/chat/completions"]
    async with fake_runtime(fault_bytes=1536 * 1024) as fake, \
            gateway(llama(fake), limits=limits, timeouts=timeouts) as gw:
        budget = gw.app.gateway.answers
        # one answer of 1.5 MiB that never ends is held...
        held = asyncio.create_task(gw.post(path, {**body, "fake_fault": "big-answer-stall"}, keep_body=False))
        await until(lambda: budget.used >= 1024 * 1024, 10)
        # ...so another of 1.5 MiB cannot be: 503, Retry-After, its own cause, in the API's shape
        refused = await gw.post(path, {**body, "fake_fault": "big-answer"}, keep_body=False)
        assert refused.status == 503 and refused.headers[b"retry-after"] == b"1"
        err = refused.json()["error"]
        assert err["code"] == "answers_busy" and "max_answer_bytes_total" in err["message"]
        stalled = await held
        assert stalled.status == 504  # the stalled one ends at its between-tokens timeout
        assert budget.used == 0  # every request gave its share back
        ok = await gw.post(path, {**body, "fake_fault": "big-answer"}, keep_body=False)
        assert ok.status == 200 and budget.used == 0
        causes = sorted(r.cause.value for r in gw.records)
        assert causes == ["answers_busy", "ok", "upstream_timeout"]


def test_the_answers_budget_is_at_least_one_answer(tmp_path):
    from passerelle.config import load_config
    from passerelle.errors import ConfigError

    path = tmp_path / "p.toml"
    path.write_text("[limits]\nmax_answer_bytes = 4096\nmax_answer_bytes_total = 8192\n")
    assert load_config(str(path), env={}).limits.max_answer_bytes_total == 8192
    path.write_text("[limits]\nmax_answer_bytes = 8192\nmax_answer_bytes_total = 4096\n")
    with pytest.raises(ConfigError, match=r"limits\.max_answer_bytes_total"):
        load_config(str(path), env={})
