"""Streams of the Responses and Anthropic Messages APIs through the gateway, against a real
llama-server: a departed client frees its slot, a runtime that dies mid-stream ends the stream
with the API's own error event, and priority orders these routes as it orders chat."""

from __future__ import annotations

import os
import signal
import socket

import anthropic
import httpx
import openai
import orjson
import pytest

from tests.conftest import MODEL_ID, slots_busy, tokens_decoded, upstream_config, wait_until
from tests.integration.test_gateway_llama import launched  # noqa: F401 - fixture
from tests.integration.test_scheduling_llama import ONE_SLOT, in_background, running, waiting

pytestmark = pytest.mark.llama

ASK = [{"role": "user", "content": "Write a long story about a lighthouse."}]
LONG = {"messages": {"model": MODEL_ID, "max_tokens": 2000, "messages": ASK, "ignore_eos": True},
        "responses": {"model": MODEL_ID, "max_output_tokens": 2000, "input": ASK[0]["content"], "ignore_eos": True}}
CONTENT = {"messages": "content_block_delta", "responses": "response.output_text.delta"}


@pytest.fixture
def gw(gateway, llama_server):
    return gateway(upstream_config(llama_server.url))


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_streaming_disconnect_frees_the_slot_within_a_second(gw, llama_server, api):
    body = {**LONG[api], "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", gw.url + f"/v1/{api}", json=body) as r:
        lines = r.iter_lines()
        while f"event: {CONTENT[api]}" not in next(lines):
            pass
        request_id = r.headers["x-request-id"]
        assert slots_busy(llama_server.url) == 1
    wait_until(lambda: slots_busy(llama_server.url) == 0, 1.0, what="llama-server slot freed")
    assert gw.log_for(request_id)["cause"] == "client_disconnect"


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_non_streaming_disconnect_frees_the_slot(gw, llama_server, api):
    host, port = gw.url.removeprefix("http://").split(":")
    payload = orjson.dumps(LONG[api])
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/{api} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                 + b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    wait_until(lambda: tokens_decoded(llama_server.url) >= 2, 30, what="generation started")
    sock.close()
    wait_until(lambda: slots_busy(llama_server.url) == 0, 1.0, what="slot freed after disconnect")
    wait_until(lambda: any(x["cause"] == "client_disconnect" and x["endpoint"] == api for x in gw.access_log()), 5,
               what="client_disconnect in the access log")


def kill_after_tokens(pid: int, events, is_content, seen: list[int], n: int = 3) -> None:
    """Read ``events``, kill the runtime after ``n`` content events (counted in ``seen[0]``)."""
    for ev in events:
        if is_content(ev):
            seen[0] += 1
            if seen[0] == n:
                os.kill(pid, signal.SIGKILL)


def test_runtime_killed_mid_stream_ends_with_each_apis_error_event(launched):  # noqa: F811
    [runtime] = launched.children()
    # Anthropic Messages: the SDK raises on Anthropic's `event: error`
    seen = [0]
    with pytest.raises(anthropic.APIStatusError) as info, launched.anthropic().messages.stream(
            model=MODEL_ID, max_tokens=2000, messages=ASK, extra_body={"ignore_eos": True}) as stream:
        kill_after_tokens(runtime, stream, lambda e: e.type == "content_block_delta", seen)
    assert seen[0] >= 3
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "api_error"
    wait_until(lambda: launched.children() and launched.children() != [runtime], 30, what="restart")
    wait_until(lambda: httpx.get(launched.url + "/ready").status_code == 200, 60, what="ready again")

    # Responses, read raw: the last event is Responses' `error` event, never a clean-looking end
    [runtime] = launched.children()
    killed = runtime
    body = {**LONG["responses"], "stream": True}
    with httpx.stream("POST", launched.url + "/v1/responses", json=body, timeout=60) as r:
        events = r.iter_text()
        raw = ""
        for part in events:
            raw += part
            if raw.count("event: response.output_text.delta") >= 3 and runtime:
                os.kill(runtime, signal.SIGKILL)
                runtime = 0
    last = raw.strip().split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    err = orjson.loads(last.split("data: ", 1)[1])
    assert err["type"] == "error" and err["code"] == "upstream_error" and err["message"]
    assert "response.completed" not in raw
    causes = wait_until(lambda: (c := [(x["endpoint"], x["cause"]) for x in launched.access_log()]) and len(c) >= 2
                        and c, 5, what="two access log lines")
    assert causes[:2] == [("messages", "upstream_error"), ("responses", "upstream_error")]

    # and the openai SDK raises on it
    wait_until(lambda: launched.children() and launched.children() != [killed], 30, what="restart")
    wait_until(lambda: httpx.get(launched.url + "/ready").status_code == 200, 60, what="ready again")
    [runtime] = launched.children()
    seen = [0]
    with pytest.raises(openai.APIError) as info:
        kill_after_tokens(runtime, launched.openai().responses.create(
            model=MODEL_ID, input=ASK[0]["content"], max_output_tokens=2000, stream=True,
            extra_body={"ignore_eos": True}),
                          lambda e: e.type == "response.output_text.delta", seen)
    assert seen[0] >= 3 and info.value.body["code"] == "upstream_error"


def post(url: str, path: str, body: dict, priority: str) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"X-Priority": priority}, timeout=120)


def test_interactive_messages_overtake_queued_batch_responses(gateway, llama_server):
    gw = gateway(upstream_config(llama_server.url, slots=1) + ONE_SLOT)

    def responses(n: int, tokens: int) -> dict:
        return {"model": MODEL_ID, "input": f"batch {n}", "max_output_tokens": tokens, "ignore_eos": True}

    first = in_background(post, gw.url, "/v1/responses", responses(0, 300), "batch")
    wait_until(lambda: running(gw) == 1, 30, what="first batch request running")
    batch = [in_background(post, gw.url, "/v1/responses", responses(i, 8), "batch") for i in (1, 2, 3)]
    wait_until(lambda: waiting(gw, "batch") == 3, 10, what="three batch requests queued")
    inter = in_background(post, gw.url, "/v1/messages", {"model": MODEL_ID, "max_tokens": 4, "messages": ASK},
                          "interactive")
    wait_until(lambda: waiting(gw, "interactive") == 1, 10, what="interactive request queued")
    for t, _ in [first, *batch, inter]:
        t.join(120)
    assert all(out["resp"].status_code == 200 for _, out in [first, *batch, inter])
    order = [(x["endpoint"], x["priority"]) for x in gw.access_log()]
    # one slot: requests finish in the order they were dispatched
    assert order[:2] == [("responses", "batch"), ("messages", "interactive")], order
    assert [x["endpoint"] for x in gw.access_log()][2:] == ["responses"] * 3
