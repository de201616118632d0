"""Responses and Anthropic Messages streams through the gateway against ``passerelle
fake-backend``, whose schedule is exact: the relay passes every event, times the first token and
the gaps in each grammar, and counts the usage the stream reports."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import upstream_config

BODIES = {
    "responses": {"model": "fake-model", "stream": True, "max_output_tokens": 6, "input": "hello"},
    "messages": {"model": "fake-model", "stream": True, "max_tokens": 6,
                 "messages": [{"role": "user", "content": "hello there"}]},
}


def events(text: str) -> list[str]:
    return [e.split("\n", 1)[0] for e in text.strip().split("\n\n")]


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_event_streams_are_relayed_and_timed(gateway, fake_backend, api):
    fake = fake_backend(ttft_ms=300, itl_ms=40)
    gw = gateway(upstream_config(fake.url, model="fake-model", kind="openai", slots=4,
                                 extra='endpoints = ["chat", "responses", "messages"]'))
    direct = httpx.post(fake.url + f"/v1/{api}", json=BODIES[api], timeout=30)
    through = httpx.post(gw.url + f"/v1/{api}", json=BODIES[api], timeout=30)
    assert through.status_code == 200 and through.headers["content-type"].startswith("text/event-stream")
    assert events(through.text) == events(direct.text)  # every event, in order, nothing added
    line = gw.log_for(through.headers["x-request-id"])
    assert line["cause"] == "ok" and line["endpoint"] == api
    assert 300 <= line["ttft_ms"] < 1500  # the fake's first token, as the relay saw it
    assert line["completion_tokens"] == 6 and line["prompt_tokens"] >= 1
    # five gaps of 40 ms between six tokens: about 200 ms from the first token to the last
    assert 150 <= line["duration_ms"] - line["ttft_ms"] < 1500


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_non_streaming_answers_pass_through_with_usage(gateway, fake_backend, api):
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(upstream_config(fake.url, model="fake-model", kind="openai", slots=4,
                                 extra='endpoints = ["responses", "messages"]'))
    r = httpx.post(gw.url + f"/v1/{api}", json={**BODIES[api], "stream": False}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 6
    line = gw.log_for(r.headers["x-request-id"])
    assert (line["completion_tokens"], line["stream"]) == (6, False)
