"""``cached_tokens``: the prompt tokens a runtime took from its cache, read from each API's usage
shape as llama-server sends it (checked against the real one in
tests/integration/test_cache_canary_llama.py) onto the request's record and its access-log line."""

from __future__ import annotations

from passerelle.observe.accesslog import record_fields
from passerelle.proxy.grammars import cached_of
from tests.inprocess import fake_runtime, gateway


def test_each_apis_usage_shape():
    assert cached_of({"usage": {"prompt_tokens": 58, "prompt_tokens_details": {"cached_tokens": 53}}}) == 53
    assert cached_of({"usage": {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 35}}}) == 35
    assert cached_of({"type": "response.completed", "response": {"usage": {
        "input_tokens": 40, "input_tokens_details": {"cached_tokens": 7}}}}) == 7
    assert cached_of({"usage": {"cache_read_input_tokens": 35, "input_tokens": 5}}) == 35
    assert cached_of({"type": "message_start", "message": {"usage": {"cache_read_input_tokens": 3}}}) == 3
    assert cached_of({"timings": {"cache_n": 19, "prompt_n": 5}}) == 19
    assert cached_of({"usage": {"prompt_tokens": 3}}) is None and cached_of([1]) is None
    assert cached_of({"usage": {"prompt_tokens_details": {"cached_tokens": "9"}}}) is None


async def test_the_runtimes_figure_reaches_the_record_streamed_or_not():
    body = {"model": "fake-model", "max_tokens": 3,
            "messages": [{"role": "user", "content": "the same long prompt about harbours and lighthouses"}]}
    async with fake_runtime(prefix_cache=8) as fake, gateway(fake.backend_config()) as gw:
        for stream in (False, True, True):
            resp = await gw.post("/v1/chat/completions", {**body, "stream": stream,
                                                          "stream_options": {"include_usage": True}})
            assert resp.status == 200
        first, second, third = gw.records
        assert first.cached_tokens == 0 and second.cached_tokens and third.cached_tokens == second.cached_tokens
        assert record_fields(third)["cached_tokens"] == third.cached_tokens
