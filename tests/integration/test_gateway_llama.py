"""The gateway in front of a real llama-server (Gemma 3 270M), driven by real clients."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading

import httpx
import openai
import pytest

from tests.conftest import MODEL_ID, free_port, slots_busy, tokens_decoded, upstream_config, wait_until

pytestmark = pytest.mark.llama

MSG = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


@pytest.fixture
def gw(gateway, llama_server):
    return gateway(upstream_config(llama_server.url))


def sdk(gw) -> openai.OpenAI:
    return gw.openai()


def test_openai_sdk_chat_non_streaming(gw):
    resp = sdk(gw).chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=8)
    assert resp.choices[0].message.content
    assert resp.usage.completion_tokens == 8 and resp.usage.prompt_tokens > 0


def test_openai_sdk_chat_streaming_without_usage_request(gw):
    stream = sdk(gw).chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=8, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    # the gateway asked llama-server for usage, and removed the usage-only chunk again
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_sdk_streaming_with_usage_keeps_it(gw):
    chunks = list(sdk(gw).chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=5, stream=True,
                                                  stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


async def test_openai_async_sdk_parallel_streams(gw):
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> str:
        stream = await client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=6, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.gather(*(one(i) for i in range(6)))
    assert all(texts)
    await client.close()
    log = gw.access_log()
    assert sum(1 for r in log if r["cause"] == "ok" and r["stream"]) >= 6
    assert all(r["completion_tokens"] == 6 for r in log if r["stream"])


def test_completions_stream_and_not(gw):
    c = sdk(gw)
    resp = c.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=5)
    assert resp.choices[0].text and resp.usage.completion_tokens == 5
    text = "".join(ch.choices[0].text for ch in
                   c.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=5, stream=True)
                   if ch.choices)
    assert text


def test_models_lists_the_served_model(gw):
    assert [m.id for m in sdk(gw).models.list()] == [MODEL_ID]


def test_sampling_fields_reach_the_runtime_unchanged(gw):
    # n_probs/logprobs and a seed change what llama-server returns: proof they were passed through.
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_ID, "messages": MSG, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
        "temperature": 0, "seed": 7})
    assert r.status_code == 200
    assert r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]


def test_every_response_has_a_request_id(gw):
    for r in (httpx.get(gw.url + "/health"), httpx.get(gw.url + "/v1/models"), httpx.get(gw.url + "/nope"),
              httpx.post(gw.url + "/v1/chat/completions", content=b"{")):
        assert r.headers["x-request-id"].startswith("req_")


@pytest.mark.parametrize(("body", "status", "param_text"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b"", 400, "empty"),
    (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "'model'"),
    (b'{"model": "gemma-3-270m"}', 400, "'messages'"),
    (b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}', 400, "'model' must be"),
    (b'{"model": "gemma-3-270m", "messages": "hello"}', 400, "'messages' must be"),
    (b'{"model": "gemma-3-270m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}', 400,
     "'max_tokens'"),
    (b'{"model": "gemma-3-270m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 400,
     "'stream'"),
    (b'{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}', 404, "gemma-3-270m"),
])
def test_bad_input_gets_openai_error_and_gateway_keeps_serving(gw, body, status, param_text):
    r = httpx.post(gw.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert param_text in err["message"] and err["type"] == "invalid_request_error"
    line = gw.log_for(r.headers["x-request-id"])
    assert line["cause"] == "invalid_request" and line["status"] == status
    ok = sdk(gw).chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_body_cap_on_content_length_and_on_bytes_read(gateway, llama_server):
    gw = gateway(upstream_config(llama_server.url) + "\n[server]\nmax_body_bytes = 1024\n")
    big = b'{"model": "gemma-3-270m", "messages": [{"role": "user", "content": "' + b"x" * 4000 + b'"}]}'
    r = httpx.post(gw.url + "/v1/chat/completions", content=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the cap applies to what is read
        for i in range(0, len(big), 500):
            yield big[i:i + 500]

    r = httpx.post(gw.url + "/v1/chat/completions", content=chunked())
    assert r.status_code == 413
    assert gw.log_for(r.headers["x-request-id"])["cause"] == "invalid_request"
    small = httpx.post(gw.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL_ID, "messages": MSG, "max_tokens": 2})
    assert small.status_code == 200


def test_streaming_disconnect_frees_the_slot_within_a_second(gw, llama_server):
    body = {"model": MODEL_ID, "messages": MSG, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        while '"content":"' not in next(lines):
            pass
        request_id = r.headers["x-request-id"]
        assert slots_busy(llama_server.url) == 1
    wait_until(lambda: slots_busy(llama_server.url) == 0, 1.0, what="llama-server slot freed")
    assert gw.log_for(request_id)["cause"] == "client_disconnect"


def test_non_streaming_disconnect_frees_the_slot(gw, llama_server):
    host, port = gw.url.removeprefix("http://").split(":")
    payload = (b'{"model": "gemma-3-270m", "max_tokens": 2000, "ignore_eos": true, '
               b'"messages": [{"role": "user", "content": "Write a long essay."}]}')
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    # llama-server notices a closed connection only once it generates: wait until it does
    wait_until(lambda: tokens_decoded(llama_server.url) >= 2, 30, what="generation started")
    sock.close()
    wait_until(lambda: slots_busy(llama_server.url) == 0, 1.0, what="slot freed after disconnect")
    wait_until(lambda: any(r["cause"] == "client_disconnect" and not r["stream"] for r in gw.access_log()), 5,
               what="client_disconnect in the access log")


def test_many_sequential_requests_never_fail_on_reused_connections(gw):
    c = sdk(gw)
    for i in range(30):
        r = c.completions.create(model=MODEL_ID, prompt=f"Number {i}:", max_tokens=1)
        assert r.choices
    assert all(line["cause"] == "ok" for line in gw.access_log())


def test_prompts_and_completions_are_not_logged(gw):
    secret = "zebra-quokka-marmalade-4242"
    resp = sdk(gw).chat.completions.create(model=MODEL_ID, max_tokens=4,
                                           messages=[{"role": "user", "content": secret}])
    line = gw.log_for(resp._request_id) if getattr(resp, "_request_id", None) else gw.access_log()[-1]
    assert line["cause"] == "ok" and line["ttft_ms"] > 0 and line["completion_tokens"] == 4
    assert secret not in gw.log_text()
    assert resp.choices[0].message.content not in ("", None) and resp.choices[0].message.content not in gw.log_text()


def test_upstream_option_detects_the_kind_and_models(gateway, llama_server):
    gw = gateway("", args=("--upstream", llama_server.url + "/v1"))
    assert [m.id for m in sdk(gw).models.list()] == [MODEL_ID]
    assert "(llama-server)" in gw.log_text()
    assert sdk(gw).completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2).choices


def test_unreachable_backend_is_503_no_backend(gateway):
    dead = free_port()  # nobody listens there
    gw = gateway(upstream_config(f"http://127.0.0.1:{dead}"), wait_ready=False)
    assert httpx.get(gw.url + "/ready").status_code == 503
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL_ID, "messages": MSG})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend"
    assert "retry-after" in r.headers
    assert gw.log_for(r.headers["x-request-id"])["cause"] == "no_backend"


LAUNCHED = """
[[backends]]
name = "own"
kind = "llama-server"
launch = ["{binary}", "-m", "{model}", "--port", "{{port}}", "-np", "2", "-c", "4096", "--metrics", "--slots",
          "--no-webui"]
models = ["gemma-3-270m"]
max_concurrency = 2
"""


@pytest.fixture
def launched(gateway, llama_paths):
    binary, model = llama_paths
    return gateway(LAUNCHED.format(binary=binary, model=model))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): read its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_runtime_killed_mid_stream_gives_error_event_then_restarts(launched):
    [runtime] = launched.children()
    stream = sdk(launched).chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=2000, stream=True,
                                                   extra_body={"ignore_eos": True})
    got = 0
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got += 1
                if got == 3:
                    os.kill(runtime, signal.SIGKILL)
    assert got >= 3
    assert "stream" in str(info.value.message) or "runtime" in str(info.value.message)
    wait_until(lambda: any(r["cause"] == "upstream_error" for r in launched.access_log()), 5,
               what="upstream_error in the access log")
    # the supervisor restarts the runtime and the gateway serves again
    wait_until(lambda: launched.children() and launched.children() != [runtime], 30, what="restart")
    wait_until(lambda: httpx.get(launched.url + "/ready").status_code == 200, 60, what="ready again")
    assert sdk(launched).completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2).choices


def test_sigterm_lets_streams_finish_then_stops_the_runtime(launched):
    [runtime] = launched.children()
    result: dict = {}

    def consume() -> None:
        stream = sdk(launched).chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=48, stream=True,
                                                       extra_body={"ignore_eos": True})
        result["tokens"] = 0
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                result["tokens"] += 1
                if result["tokens"] == 2:
                    launched.proc.send_signal(signal.SIGTERM)
            if chunk.choices and chunk.choices[0].finish_reason:
                result["finish"] = chunk.choices[0].finish_reason

    t = threading.Thread(target=consume)
    t.start()
    t.join(120)
    assert result.get("finish") == "length" and result["tokens"] >= 40
    assert launched.proc.wait(60) == 0
    wait_until(lambda: not pid_alive(runtime), 15, what="runtime stopped with the gateway")
    with pytest.raises(httpx.ConnectError):
        httpx.get(launched.url + "/health")


def test_sigkill_of_the_gateway_leaves_no_orphan(launched):
    [runtime] = launched.children()
    launched.proc.kill()
    launched.proc.wait(10)
    wait_until(lambda: not pid_alive(runtime), 10, what="runtime killed with its parent")


@pytest.mark.timeout(600)  # three runtimes to start and a 4,500-token prompt to compute, on shared cores
def test_embedded_default_serves_the_whole_api(gateway):
    from passerelle.runtimes.embedded import DEFAULT_MODEL_ID as DEFAULT

    gw = gateway("")
    c = sdk(gw)
    # an instruction-tuned model: it answers, and stops by itself (SmolLM2-135M-Instruct)
    answer = c.chat.completions.create(model=DEFAULT, max_tokens=64, temperature=0,
                                       messages=[{"role": "user", "content": "Write a haiku about lighthouses."}])
    assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.content.strip()
    emb = c.embeddings.create(model=DEFAULT, input=["a lighthouse", "a ship"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 100
    assert c.responses.create(model=DEFAULT, input="Hi", max_output_tokens=3).usage.output_tokens > 0
    assert gw.anthropic().messages.create(model=DEFAULT, max_tokens=3, messages=MSG).usage.output_tokens > 0
    assert httpx.post(gw.url + "/tokenize", json={"content": "a lighthouse"}).json()["tokens"]
    # SmolLM2 has no fill-in-the-middle tokens: /infill is neither served nor advertised
    infill = httpx.post(gw.url + "/infill", timeout=60, json={"model": DEFAULT, "input_prefix": "def f(",
                                                              "input_suffix": "):", "n_predict": 2})
    assert infill.status_code == 400 and "not served on /infill" in infill.json()["error"]["message"]
    ranked = httpx.post(gw.url + "/v1/rerank", timeout=60, json={"model": "tiny-reranker", "query": "light",
                                                                 "documents": ["a lighthouse", "a ship"]})
    assert ranked.status_code == 200 and len(ranked.json()["results"]) == 2
    model = next(m for m in httpx.get(gw.url + "/v1/models").json()["data"] if m["id"] == DEFAULT)
    assert "/infill" not in model["routes"] and "/v1/audio/transcriptions" not in model["routes"]
    assert "/v1/embeddings" in model["routes"] and model["context_length"] == 8192
    # its template drops tools: it says so, and a request that needs them is refused, never answered
    # with plain text as if the tools had been seen (it was a 200 even with tool_choice "required")
    assert "tools" not in model["capabilities"] and model["meta"]["capabilities"]["function_calling"] is False
    tools = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": DEFAULT, "max_tokens": 8, "tool_choice": "required", "messages": MSG,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})
    assert tools.status_code == 400 and "cannot use tools" in tools.json()["error"]["message"], tools.text
    # a coding agent's first request (Claude Code's: about 4,200 tokens with its tools) fits a slot
    big = c.chat.completions.create(model=DEFAULT, max_tokens=1, messages=[
        {"role": "user", "content": "Summarise: " + "the lighthouse keeper lit the lamp at dusk. " * 500}])
    assert big.usage.prompt_tokens > 4200
    assert len(gw.children()) == 3  # chat, embeddings, rerank
    banner = gw.log_text()
    assert "is a small base model" not in banner and "infill" not in banner.split("backend local ")[1].split("\n")[0]
