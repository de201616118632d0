"""Backends against small real HTTP servers on loopback: scraping, garbage, detection."""

from __future__ import annotations

import pytest
from aiohttp import web
from prometheus_client import generate_latest

from passerelle.config import BackendConfig, TimeoutConfig
from passerelle.observe.metrics import Metrics
from passerelle.runtimes.kinds import DetectionFailed, detect_upstream, make_backend
from passerelle.runtimes.registry import Registry


async def serve(routes: dict[str, tuple[int, str]], headers: dict[str, str] | None = None):
    app = web.Application()
    for path, (status, text) in routes.items():
        async def handler(_req, status=status, text=text):
            return web.Response(status=status, text=text, headers=headers)
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def backend(kind: str, url: str):
    return make_backend(BackendConfig(name="b", kind=kind, url=url, models=("m",)), TimeoutConfig())


LLAMA_METRICS = "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 1\n" \
                "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 3\n" \
                "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 4096\n" \
                "# TYPE llamacpp:prompt_seconds_total counter\nllamacpp:prompt_seconds_total 20.48\n"
VLLM_METRICS = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 2\n'
                '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 5\n'
                '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n')


async def test_llama_server_slots_and_metrics_are_read():
    runner, url = await serve({"/health": (200, "{}"), "/metrics": (200, LLAMA_METRICS),
                               "/slots": (200, '[{"id":0,"is_processing":true},{"id":1,"is_processing":false}]')})
    b = backend("llama-server", url)
    await b.start()
    try:
        s = await b.scrape()
        assert (s.up, s.slots_busy, s.slots_total, s.queue_depth, s.error) == (True, 1, 2, 3, "")
        # its own prompt timings, which the scheduler learns its prefill rate from (prefill.py)
        assert (s.prompt_tokens_total, s.prompt_seconds_total) == (4096, 20.48)
    finally:
        await b.close()
        await runner.cleanup()


async def test_vllm_metrics_are_read():
    runner, url = await serve({"/health": (200, ""), "/metrics": (200, VLLM_METRICS)})
    b = backend("vllm", url)
    await b.start()
    try:
        s = await b.scrape()
        assert (s.slots_busy, s.queue_depth, s.kv_cache_usage_ratio) == (2, 5, 0.25)
    finally:
        await b.close()
        await runner.cleanup()


async def test_garbage_sets_up_to_zero_and_never_breaks_metrics():
    runner, url = await serve({"/health": (200, "{}"), "/slots": (200, "not json at all"),
                               "/metrics": (200, "this is {{ not prometheus")})
    m = Metrics()
    b = backend("llama-server", url)
    registry = Registry([b], m)
    await registry.start()
    try:
        assert b.stats.error
        text = generate_latest(m.registry).decode()
        assert 'passerelle_backend_up{backend="b"} 0.0' in text
        assert "passerelle_backend_slots_busy{" not in text
    finally:
        await registry.stop()
        await runner.cleanup()


async def test_a_backend_that_goes_down_loses_its_load_figures():
    runner, url = await serve({"/health": (200, "{}"), "/metrics": (200, LLAMA_METRICS),
                               "/slots": (200, '[{"id":0,"is_processing":true}]')})
    m = Metrics()
    b = backend("llama-server", url)
    registry = Registry([b], m)
    await registry.start()
    try:
        assert 'passerelle_backend_slots_busy{backend="b"} 1.0' in generate_latest(m.registry).decode()
        await runner.cleanup()
        await registry.poll_once()
        text = generate_latest(m.registry).decode()
        assert 'passerelle_backend_up{backend="b"} 0.0' in text
        assert 'passerelle_backend_slots_busy{backend="b"}' not in text
    finally:
        await registry.stop()


@pytest.mark.parametrize(("routes", "kind"), [
    ({"/props": (200, '{"build_info": "b1"}'), "/slots": (200, "[{}, {}]")}, "llama-server"),
    ({"/api/version": (200, '{"version": "0.5"}')}, "ollama"),
    ({"/metrics": (200, VLLM_METRICS)}, "vllm"),
    ({}, "openai"),
])
async def test_detect_upstream_kind(routes, kind):
    runner, url = await serve({"/v1/models": (200, '{"data": [{"id": "m1"}, {"id": "m2"}]}'), **routes})
    try:
        got_kind, models = await detect_upstream(url + "/v1")
        assert (got_kind, models) == (kind, ["m1", "m2"])
    finally:
        await runner.cleanup()


async def test_detection_never_follows_a_redirect():
    # The regression: start-up detection followed redirects to another host, and that host's answer
    # became the served model list.
    elsewhere, other = await serve({"/v1/models": (200, '{"data": [{"id": "not-yours"}]}')})
    runner, url = await serve({"/v1/models": (302, "")}, headers={"Location": other + "/v1/models"})
    try:
        with pytest.raises(DetectionFailed, match="HTTP 302: a redirect"):
            await detect_upstream(url)
    finally:
        await runner.cleanup()
        await elsewhere.cleanup()


async def test_detection_of_a_server_that_does_not_answer_ends_in_time():
    import asyncio
    import time

    done = asyncio.Event()

    async def silent(_r, w):
        await done.wait()
        w.close()
        await w.wait_closed()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    start = time.monotonic()
    try:
        with pytest.raises(DetectionFailed, match=r"no answer within 0\.3 s"):
            await detect_upstream(f"http://127.0.0.1:{port}", timeout=0.3)
        assert time.monotonic() - start < 3
    finally:
        done.set()
        server.close()
        await server.wait_closed()


async def test_unreachable_backend_post_is_a_retryable_upstream_error():
    from passerelle.errors import UpstreamError

    runner, url = await serve({})
    await runner.cleanup()
    b = backend("openai", url)
    await b.start()
    try:
        with pytest.raises(UpstreamError) as info:
            await b.post("/v1/chat/completions", b"{}")
        assert info.value.retryable
    finally:
        await b.close()
