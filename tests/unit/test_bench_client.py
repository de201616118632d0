"""The SSE byte scanner: what counts as a content chunk, usage, errors, framing across reads."""

from __future__ import annotations

import pytest

from passerelle.bench.client import RequestResult, StreamScanner


def ev(payload: str, sep: str = "\n\n") -> bytes:
    return f"data: {payload}{sep}".encode()


def chunk(content: str | None, field: str = "content") -> str:
    value = "null" if content is None else f'"{content}"'
    return '{"choices":[{"index":0,"delta":{"' + field + '":' + value + '},"finish_reason":null}]}'


ROLE = '{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}'
ROLE_NULL = '{"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}'
FINISH = '{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}'
USAGE = '{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}'


def test_role_and_empty_chunks_are_not_tokens():
    s = StreamScanner()
    s.feed(ev(ROLE) + ev(ROLE_NULL), 1.0)
    assert s.chunks == 0 and s.first is None
    s.feed(ev(chunk(" hi")), 1.5)
    assert s.chunks == 1 and s.first == 1.5


def test_first_chunk_time_and_gaps():
    s = StreamScanner()
    s.feed(ev(ROLE), 0.9)
    s.feed(ev(chunk("a")), 1.0)
    s.feed(ev(chunk("b")) + ev(chunk("c")), 1.25)  # two events in one read share its arrival time
    s.feed(ev(chunk("d")), 1.5)
    assert s.first == 1.0 and s.chunks == 4
    assert s.itl == [0.25, 0.0, 0.25]


def test_usage_finish_and_done():
    s = StreamScanner()
    s.feed(ev(chunk("x")) + ev(FINISH) + ev(USAGE) + b"data: [DONE]\n\n", 2.0)
    assert s.usage_tokens == 3 and s.prompt_tokens == 12
    assert s.finished and s.done and s.error is None


def test_what_the_runtime_took_from_its_cache_is_read():
    # OpenAI's field (llama-server and vLLM send it too)
    s = StreamScanner()
    s.feed(ev('{"choices":[],"usage":{"prompt_tokens":41,"completion_tokens":3,'
              '"prompt_tokens_details":{"cached_tokens":36}}}'), 1.0)
    assert s.cached_tokens == 36 and s.prompt_tokens == 41
    # llama-server's timings, on the usage chunk (as it sends them) or alone on the last chunk
    s = StreamScanner()
    s.feed(ev(chunk("x")) + ev('{"choices":[{"index":0,"delta":{},"finish_reason":"length"}],'
                               '"timings":{"cache_n":36,"prompt_n":5,"prompt_ms":59.9}}'), 1.0)
    assert s.cache_n == 36 and s.prompt_n == 5 and s.cached_tokens is None
    s = StreamScanner()
    s.feed(ev('{"choices":[{"delta":{"content":"z"}}],"timings":{"cache_n":2,"prompt_n":40}}'), 1.0)
    assert s.chunks == 1 and s.cache_n == 2 and s.prompt_n == 40


def test_usage_on_the_last_content_chunk_is_read():
    s = StreamScanner()
    s.feed(ev('{"choices":[{"delta":{"content":"z"}}],"usage":{"completion_tokens":9,"prompt_tokens":1}}'), 1.0)
    assert s.chunks == 1 and s.usage_tokens == 9


def test_events_split_across_reads_and_crlf_framing():
    data = ev(chunk("a"), "\r\n\r\n") + ev(chunk("b"), "\r\n\r\n") + b"data: [DONE]\r\n\r\n"
    s = StreamScanner()
    for i in range(0, len(data), 7):  # arbitrary cut points, even inside the separator
        s.feed(data[i:i + 7], float(i))
    assert s.chunks == 2 and s.done


@pytest.mark.parametrize("field", ["text", "reasoning_content"])
def test_other_generated_text_fields_count(field):
    s = StreamScanner()
    s.feed(ev(chunk("t", field)), 1.0)
    assert s.chunks == 1


def test_quoted_json_inside_generated_text_is_one_chunk():
    # the model "writes" JSON: its quotes are escaped, so no second match and nothing decoded
    s = StreamScanner()
    s.feed(ev(chunk('{\\"content\\":\\"x\\"}')), 1.0)
    assert s.chunks == 1 and s.error is None


def test_spaces_after_colons_are_accepted():
    s = StreamScanner()
    s.feed(b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n', 1.0)
    s.feed(b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n', 1.1)
    assert s.chunks == 1 and s.usage_tokens == 1


def test_comments_and_event_lines():
    s = StreamScanner()
    s.feed(b": keep-alive\n\n" + b"event: message\ndata: " + chunk("a").encode() + b"\n\n", 1.0)
    assert s.chunks == 1


def test_error_event_is_reported():
    s = StreamScanner()
    s.feed(ev(chunk("a")) + ev('{"error":{"message":"boom","type":"server_error"}}'), 1.0)
    assert s.error == "stream_error"


def test_invalid_json_outside_content_is_reported():
    s = StreamScanner()
    s.feed(ev("{oops"), 1.0)
    assert s.error == "invalid_json"


def test_tpot_definition():
    r = RequestResult(ok=True, ttft=0.1, e2e=0.4, output_tokens=16)
    assert r.tpot == pytest.approx(0.3 / 15)
    assert RequestResult(ok=True, ttft=0.1, e2e=0.1, output_tokens=1).tpot is None
    assert RequestResult(ok=False, ttft=0.1, e2e=0.4, output_tokens=16).tpot is None


async def test_a_non_streamed_answer_is_an_error_not_a_silent_zero():
    from aiohttp import web

    from passerelle.bench.client import HttpClient, send

    async def plain(request):
        return web.json_response({"choices": [{"message": {"content": "hi"}}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", plain)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with HttpClient(4) as client:
            r = await send(client, f"http://127.0.0.1:{port}/v1/chat/completions", {"max_tokens": 2}, {})
    finally:
        await runner.cleanup()
    assert not r.ok and r.error == "not_streamed" and '"content"' in r.detail
