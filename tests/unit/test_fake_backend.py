"""passerelle fake-backend: OpenAI shapes, SSE framing, deterministic timing, slots, injected faults."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import pytest

from passerelle.testing.fake_runtime import VOCAB, start_fake_backend, tokens_due
from tests.waiting import until, wait_until


def sse_events(text: str) -> list[str]:
    assert text.endswith("\n\n"), "every SSE event ends with a blank line"
    events = text.split("\n\n")[:-1]
    for e in events:
        assert e.startswith("data: "), e
    return [e[len("data: "):] for e in events]


def chat(max_tokens: int | None = 4, stream: bool = True, usage: bool = False, **extra) -> dict:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "one two three four five"}],
            "stream": stream, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


@pytest.fixture(scope="module")
def fast():
    with start_fake_backend(ttft_ms=0, itl_ms=0, tokens=5, model="fake-model") as fake:
        yield fake


def test_chat_stream_format_and_exact_token_count(fast):
    r = httpx.post(fast.url + "/v1/chat/completions", json=chat(max_tokens=7, usage=True))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content) == 7
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == "".join(VOCAB[:7])
    finish = chunks[-2]
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["delta"] == {}
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake-model" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


def test_usage_chunk_only_when_asked(fast):
    events = sse_events(httpx.post(fast.url + "/v1/chat/completions", json=chat(usage=False)).text)
    assert not any('"usage"' in e for e in events)
    assert events[-1] == "[DONE]"


def test_no_usage_flag_ignores_include_usage():
    with start_fake_backend(ttft_ms=0, itl_ms=0, usage=False) as fake:
        events = sse_events(httpx.post(fake.url + "/v1/chat/completions", json=chat(usage=True)).text)
    assert not any('"usage"' in e for e in events)


def test_default_token_count_without_max_tokens(fast):
    events = sse_events(httpx.post(fast.url + "/v1/chat/completions", json=chat(max_tokens=None)).text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) == 5  # --tokens 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_completions_stream_and_non_stream(fast):
    events = sse_events(httpx.post(fast.url + "/v1/completions",
                                   json={"prompt": "a b c", "max_tokens": 3, "stream": True}).text)
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == [*VOCAB[:3], ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)
    full = httpx.post(fast.url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 3}).json()
    assert full["choices"][0]["text"] == "".join(VOCAB[:3])
    assert full["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_chat_non_stream(fast):
    full = httpx.post(fast.url + "/v1/chat/completions", json=chat(max_tokens=2, stream=False)).json()
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": "".join(VOCAB[:2])}
    assert full["usage"]["completion_tokens"] == 2


def test_embeddings_are_deterministic_unit_vectors(fast):
    a = httpx.post(fast.url + "/v1/embeddings", json={"input": ["hello world", "other"]}).json()
    b = httpx.post(fast.url + "/v1/embeddings", json={"input": "hello world"}).json()
    va, vo, vb = a["data"][0]["embedding"], a["data"][1]["embedding"], b["data"][0]["embedding"]
    assert va == vb and va != vo
    assert len(va) == 64 and abs(sum(x * x for x in va) - 1.0) < 1e-9
    assert a["usage"]["prompt_tokens"] == 3


def test_side_endpoints(fast):
    assert httpx.get(fast.url + "/health").json() == {"status": "ok"}
    models = httpx.get(fast.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    metrics = httpx.get(fast.url + "/metrics").text
    assert "llamacpp:requests_processing 0" in metrics and "llamacpp:requests_deferred 0" in metrics
    assert "passerelle-fake-backend" in httpx.get(fast.url + "/props").json()["build_info"]


def test_errors_use_openai_shape(fast):
    r = httpx.post(fast.url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(fast.url + "/v1/chat/completions", json=chat(max_tokens=-1))
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert httpx.get(fast.url + "/nowhere").status_code == 404
    assert httpx.get(fast.url + "/v1/chat/completions").status_code == 405


def test_fail_rate_answers_500():
    with start_fake_backend(ttft_ms=0, itl_ms=0, fail_rate=1.0) as fake:
        r = httpx.post(fake.url + "/v1/chat/completions", json=chat())
        assert r.status_code == 500
        err = r.json()["error"]
        assert set(err) == {"message", "type", "code"} and err["type"] == "server_error"
        assert fake.stats()["failed"] == 1


def test_abort_rate_cuts_the_stream_without_done():
    with start_fake_backend(ttft_ms=0, itl_ms=1, abort_rate=1.0) as fake:
        received = b""
        with (pytest.raises(httpx.RemoteProtocolError),  # the chunked body never terminates properly
              httpx.stream("POST", fake.url + "/v1/chat/completions", json=chat(max_tokens=8)) as r):
            for part in r.iter_raw():
                received += part
        assert b"[DONE]" not in received
        assert received.count(b'"content":" ') == 4  # cut after half of the tokens
        assert fake.stats()["aborted"] == 1


def test_a_server_wide_fault_at_a_rate_and_a_request_paced_on_its_own():
    # --fault for a fraction of the requests (what bench/soak.py uses), seeded like the other draws
    with start_fake_backend(ttft_ms=0, itl_ms=1, fault="redirect", fault_rate=0.5, seed=3) as fake:
        statuses = [httpx.post(fake.url + "/v1/chat/completions", json=chat(stream=False)).status_code
                    for _ in range(20)]
        assert set(statuses) == {200, 302} and fake.stats()["faults"] == statuses.count(302)
    with start_fake_backend(ttft_ms=0, itl_ms=1000) as fake:
        start = time.monotonic()
        r = httpx.post(fake.url + "/v1/chat/completions", json=chat(max_tokens=50, fake_itl_ms=0), timeout=10)
        assert "[DONE]" in r.text and time.monotonic() - start < 5  # not 50 s at its 1 s pace
        r = httpx.post(fake.url + "/v1/chat/completions", json=chat(max_tokens=20_000, fake_itl_ms=0.05),
                       timeout=30)
        assert r.text.count('"delta":{"content":') == 20_000 and r.text.endswith("data: [DONE]\n\n")


def test_the_token_due_when_the_fake_wakes_is_always_written():
    # Found by the soak: at a fast pace, rounding said no token was due when the fake woke for one;
    # the empty chunk it wrote then ended the chunked body half-way (the gateway rightly called the
    # stream truncated: 5 of 877 answers at 20,000 tokens/s).
    start, itl = 1000.123456, 0.00005
    for k in range(1, 20_000):
        assert tokens_due(start + k * itl, start, itl, k, 100_000) > k


def test_schedule_does_not_drift():
    """100 chunks 5 ms apart stay on the grid start + TTFT + k × ITL: no accumulated delay.

    Sleeping 5 ms after each write would drift by the timer's overshoot per chunk (tens of ms over
    100 chunks); medians over the first and last 20 chunks ignore a one-off scheduling hiccup.
    """
    with start_fake_backend(ttft_ms=50, itl_ms=5) as fake:
        times = []
        t0 = time.perf_counter()
        with httpx.stream("POST", fake.url + "/v1/chat/completions", json=chat(max_tokens=100)) as r:
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    times.append(time.perf_counter() - t0)
    assert len(times) == 100
    assert times[0] >= 0.045
    offsets = [t - k * 0.005 for k, t in enumerate(times)]
    drift = statistics.median(offsets[-20:]) - statistics.median(offsets[:20])
    assert abs(drift) < 0.010, f"schedule drifted by {drift * 1000:.1f} ms over 100 chunks"


async def test_slots_queue_in_fifo_order_and_show_in_metrics():
    with start_fake_backend(ttft_ms=60, itl_ms=10, slots=1) as fake:
        async with httpx.AsyncClient(base_url=fake.url, timeout=10) as client:
            order: list[str] = []
            first: dict[str, float] = {}
            done: dict[str, float] = {}

            async def stream(name: str) -> None:
                async with client.stream("POST", "/v1/chat/completions", json=chat(max_tokens=4)) as r:
                    async for line in r.aiter_lines():
                        if name not in first and '"content":" ' in line:
                            first[name] = time.perf_counter()
                done[name] = time.perf_counter()
                order.append(name)

            async def metric(name: str) -> int:
                text = (await client.get("/metrics")).text
                return int(next(ln.split()[1] for ln in text.splitlines() if ln.startswith(name + " ")))

            a = asyncio.create_task(stream("a"))
            await until(lambda: _eq(metric("llamacpp:requests_processing"), 1), 10, "a processing")
            b = asyncio.create_task(stream("b"))
            await until(lambda: _eq(metric("llamacpp:requests_deferred"), 1), 10, "b deferred")
            c = asyncio.create_task(stream("c"))
            await until(lambda: _eq(metric("llamacpp:requests_deferred"), 2), 10, "b and c deferred")
            slots = (await client.get("/slots")).json()
            assert slots == [{"id": 0, "is_processing": True}]
            await asyncio.gather(a, b, c)
    assert order == ["a", "b", "c"]
    # b's first token only after a's whole answer (then b's own 60 ms); unlimited, it would come
    # 60 ms after b was sent, while a still had tokens to stream
    assert first["b"] > done["a"] and first["c"] > done["b"]


async def _eq(value_coro, expected: int) -> bool:
    return (await value_coro) == expected


def test_client_disconnect_frees_the_slot():
    with start_fake_backend(ttft_ms=20, itl_ms=50, slots=1) as fake:
        with httpx.stream("POST", fake.url + "/v1/chat/completions", json=chat(max_tokens=200)) as r:
            for line in r.iter_lines():
                if '"content":" ' in line:
                    break  # leave after the first token of a 10 s answer
        wait_until(lambda: not httpx.get(fake.url + "/slots").json()[0]["is_processing"], 3,
                   "the slot freed after the client left", interval=0.01)
        assert fake.stats()["disconnected"] == 1
        t0 = time.perf_counter()
        r = httpx.post(fake.url + "/v1/chat/completions", json=chat(max_tokens=1))
        assert r.status_code == 200 and time.perf_counter() - t0 < 1.0


def test_expect_100_continue_is_answered(fast):
    """curl sends large bodies only after "100 Continue"; without one it stalls for a second."""
    import socket

    body = json.dumps(chat(max_tokens=1, stream=False)).encode()
    host, port = fast.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(body))
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        answer = b""
        while b'"usage"' not in answer:
            answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200 OK")


def test_openai_only_hides_the_side_api_a_gateway_reads_capacity_from():
    with start_fake_backend(ttft_ms=0, itl_ms=0, slots=4, openai_only=True) as fake:
        for path in ("/props", "/slots", "/metrics"):
            assert httpx.get(fake.url + path).status_code == 404, path
        r = httpx.post(fake.url + "/v1/chat/completions", json=chat(stream=False))
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_bare_events_leave_out_what_llama_server_leaves_out():
    body = {"model": "fake-model", "input": "hi", "max_output_tokens": 2, "stream": True}
    with start_fake_backend(ttft_ms=0, itl_ms=0, bare_events=True) as fake:
        bare = httpx.post(fake.url + "/v1/responses", json=body).text
    with start_fake_backend(ttft_ms=0, itl_ms=0) as fake:
        whole = httpx.post(fake.url + "/v1/responses", json=body).text
    events = [json.loads(line[5:]) for line in bare.splitlines() if line.startswith("data:")]
    assert events and not any(k in e for e in events for k in ("sequence_number", "output_index", "content_index"))
    assert [e.get("item_id") for e in events if e["type"] == "response.output_text.delta"] == ["msg_fake"] * 2
    numbered = [json.loads(line[5:]) for line in whole.splitlines() if line.startswith("data:")]
    assert [e["sequence_number"] for e in numbered] == list(range(len(numbered))) == list(range(len(events)))
