"""Timeouts end to end, against the deterministic fake runtime (exact delays)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import upstream_config


def config(url: str, timeouts: str) -> str:
    return upstream_config(url, model="fake-model", kind="openai", slots=64) + "\n[timeouts]\n" + timeouts


def test_first_token_timeout_is_504_upstream_timeout(gateway, fake_backend):
    fake = fake_backend(ttft_ms=3000, itl_ms=10)
    gw = gateway(config(fake.url, "first_token_s = 0.5\n"))
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": "fake-model", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert r.status_code == 504
    err = r.json()["error"]
    assert err["code"] == "upstream_timeout" and "first token" in err["message"]
    assert gw.log_for(r.headers["x-request-id"])["cause"] == "upstream_timeout"


def test_between_tokens_timeout_ends_the_stream_with_an_error_event(gateway, fake_backend):
    fake = fake_backend(ttft_ms=20, itl_ms=1500)
    gw = gateway(config(fake.url, "between_tokens_s = 0.4\n"))
    client = gw.openai()
    got = 0
    with pytest.raises(openai.APIError) as info:
        for chunk in client.chat.completions.create(model="fake-model", max_tokens=8, stream=True,
                                                    messages=[{"role": "user", "content": "x"}]):
            if chunk.choices and chunk.choices[0].delta.content:
                got += 1
    assert got == 1 and "between tokens" in str(info.value.message)
    assert any(line["cause"] == "upstream_timeout" for line in gw.access_log())


def test_total_timeout(gateway, fake_backend):
    fake = fake_backend(ttft_ms=20, itl_ms=200)
    gw = gateway(config(fake.url, "total_s = 1.0\nbetween_tokens_s = 5\n"))
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": "fake-model", "max_tokens": 50, "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert r.status_code == 200  # headers went out with the first token
    assert '"code":"upstream_timeout"' in r.text and "total" in r.text
    assert "[DONE]" not in r.text


def test_upstream_500_is_passed_with_its_status(gateway, fake_backend):
    fake = fake_backend(ttft_ms=10, itl_ms=1, fail_rate=1.0)
    gw = gateway(config(fake.url, ""))
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": "fake-model", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 500 and "error" in r.json()
    assert gw.log_for(r.headers["x-request-id"])["cause"] == "upstream_error"


def test_mid_stream_abort_gives_error_event_never_a_clean_end(gateway, fake_backend):
    fake = fake_backend(ttft_ms=10, itl_ms=5, abort_rate=1.0)
    gw = gateway(config(fake.url, ""))
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": "fake-model", "max_tokens": 40, "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert '"error"' in r.text and "[DONE]" not in r.text
