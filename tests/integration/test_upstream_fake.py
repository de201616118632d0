"""The gateway's upstream connections, end to end against ``passerelle fake-backend``: kept alive
between requests, and closed when a client leaves mid-stream (so the runtime stops generating)."""

from __future__ import annotations

import httpx

from tests.conftest import upstream_config, wait_until


def chat(*, stream: bool, max_tokens: int = 4) -> dict:
    return {"model": "fake-model", "stream": stream, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello"}]}


def fake_stats(url: str) -> dict:
    return httpx.get(url + "/fake/stats", timeout=5).json()


def test_requests_reuse_kept_alive_connections(gateway, fake_backend):
    fake = fake_backend(ttft_ms=1, itl_ms=1)
    gw = gateway(upstream_config(fake.url, model="fake-model", kind="openai", slots=8))
    before = fake_stats(fake.url)["connections"]
    for i in range(20):
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat(stream=i % 2 == 0), timeout=30)
        assert r.status_code == 200
        assert ("[DONE]" in r.text) if i % 2 == 0 else r.json()["choices"][0]["message"]["content"]
    stats = fake_stats(fake.url)
    assert stats["completed"] >= 20
    # one connection for all of them (a second at most, if a health probe held the first)
    assert stats["connections"] - before <= 2


def test_client_leaving_mid_stream_closes_the_upstream_connection(gateway, fake_backend):
    fake = fake_backend(ttft_ms=10, itl_ms=50, slots=1)
    gw = gateway(upstream_config(fake.url, model="fake-model", kind="llama-server", slots=1))
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=chat(stream=True, max_tokens=400),
                      timeout=30) as r:
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if '"content":' in line and '"content":""' not in line:
                break  # leave after the first token of a 20 s answer
    wait_until(lambda: fake_stats(fake.url)["disconnected"] == 1, 5, what="the runtime to see the client leave")
    assert not httpx.get(fake.url + "/slots", timeout=5).json()[0]["is_processing"]
    assert gw.log_for(request_id)["cause"] == "client_disconnect"
    # the freed slot serves the next request at once, through a fresh connection
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat(stream=True, max_tokens=2), timeout=30)
    assert r.status_code == 200 and "[DONE]" in r.text


def test_a_connection_the_runtime_drops_is_retried_unseen_by_the_client(gateway, fake_backend):
    # Like llama-server: after each streamed answer the fake closes the connection (100 ms later),
    # dropping whatever request came on it meanwhile. The gateway's next request takes exactly
    # that pooled connection, so every one of them must be resent on a fresh connection.
    fake = fake_backend(ttft_ms=1, itl_ms=1, close_after_stream_ms=100)
    gw = gateway(upstream_config(fake.url, model="fake-model", kind="openai", slots=4))
    for _ in range(5):
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat(stream=True), timeout=30)
        assert r.status_code == 200 and "[DONE]" in r.text
        assert gw.log_for(r.headers["x-request-id"])["cause"] == "ok"
    assert fake_stats(fake.url)["connections"] >= 5  # the dropped connections were replaced
