import asyncio
import random
import time

import orjson
import pytest

from passerelle.config import TimeoutConfig
from passerelle.errors import ClientTimeout, UpstreamError, UpstreamTimeout, UpstreamTooLarge
from passerelle.observe.record import RequestRecord, State
from passerelle.proxy.deadline import Deadline
from passerelle.proxy.relay import StreamRelay
from passerelle.proxy.sse_scan import SSEScanner
from passerelle.upstream.client import ServerDisconnected

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n'
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n'
FINAL = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + CHUNK % b"a" + CHUNK % b"b" + CHUNK % b"c" + FINAL + USAGE + DONE


class FakeResponse:
    def __init__(self, parts, *, delays=None, fail_with=None, then_idle=False):
        self.parts = list(parts)
        self.delays = list(delays or [])
        self.fail_with = fail_with
        self.then_idle = then_idle  # after the parts: nothing more, and no end either
        self.reads = 0

    async def readany(self):
        self.reads += 1
        if self.delays:
            await asyncio.sleep(self.delays.pop(0))
        if self.parts:
            return self.parts.pop(0)
        if self.then_idle:
            await asyncio.Event().wait()
        if self.fail_with is not None:
            raise self.fail_with
        return b""


class Client:
    def __init__(self):
        self.messages = []

    async def __call__(self, msg):
        self.messages.append(msg)

    @property
    def body(self):
        return b"".join(m.get("body", b"") for m in self.messages)


def record():
    rec = RequestRecord(id="r", endpoint="chat", stream=True, backend="b")
    rec.to(State.DISPATCHED)
    return rec


def deadline(rec, timeouts):
    d = Deadline(timeouts, rec.t_arrival)
    d.start_attempt()
    return d


async def relay(parts, strip_usage=False, timeouts=None, client=None, max_event=1 << 20, **kw):
    timeouts = timeouts or TimeoutConfig()
    rec, client = record(), client or Client()
    r = StreamRelay(rec, client, timeouts, strip_usage=strip_usage, max_event=max_event)
    await r.run(FakeResponse(parts, **kw), deadline(rec, timeouts))
    return rec, client


def test_scanner_handles_every_split_position():
    for cut in range(1, len(STREAM)):
        s = SSEScanner()
        events = s.feed(STREAM[:cut]) + s.feed(STREAM[cut:])
        assert b"".join(events) == STREAM
        assert len(events) == 7
        assert s.pending == b""


def test_scanner_crlf_comments_and_mixed_terminators():
    s = SSEScanner()
    data = b": keep-alive\r\n\r\ndata: {\"a\":1}\r\n\r\ndata: x\n\n"
    assert s.feed(data) == [b": keep-alive\r\n\r\n", b'data: {"a":1}\r\n\r\n', b"data: x\n\n"]
    assert s.feed(b"data: partial") == [] and s.pending == b"data: partial"


def test_scanner_matches_a_plain_split_on_random_input():
    def reference(buf):  # the earliest terminator of either kind, searched afresh each time
        events, start = [], 0
        while True:
            ends = [i + len(t) for t in (b"\n\n", b"\r\n\r\n") if (i := buf.find(t, start)) >= 0]
            if not ends:
                return events, buf[start:]
            events.append(buf[start:min(ends)])
            start = min(ends)

    rng = random.Random(3)
    for _ in range(3000):
        data = bytes(rng.choice(b"a\r\n") for _ in range(rng.randint(0, 40)))
        cuts = sorted(rng.sample(range(len(data) + 1), min(3, len(data) + 1)))
        s, got, prev = SSEScanner(), [], 0
        for cut in [*cuts, len(data)]:
            got += s.feed(data[prev:cut])
            prev = cut
        assert (got, s.pending) == reference(data)


async def test_bytes_pass_through_untouched_and_tokens_counted():
    rec, client = await relay([STREAM[:50], STREAM[50:200], STREAM[200:]])
    assert client.body == STREAM
    assert rec.content_chunks == 3 and len(rec.gaps) == 2
    assert (rec.prompt_tokens, rec.completion_tokens, rec.usage_from_server) == (7, 3, True)
    assert rec.state is State.STREAMING and rec.t_first > 0


async def test_usage_chunk_removed_when_client_did_not_ask():
    rec, client = await relay([STREAM], strip_usage=True)
    assert client.body == STREAM.replace(USAGE, b"")
    assert rec.completion_tokens == 3


async def test_usage_inside_a_content_chunk_is_never_dropped():
    # llama-server's /v1/completions puts usage on the last chunk, which still has choices.
    last = b'data: {"choices":[{"text":"z","index":0}],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    rec, client = await relay([last + DONE], strip_usage=True)
    assert client.body == last + DONE and rec.completion_tokens == 1


async def test_empty_and_null_content_are_not_tokens():
    parts = [ROLE, b'data: {"choices":[{"delta":{"content":""}}]}\n\n', CHUNK % b"\\\"q", DONE]
    rec, _ = await relay(parts)
    assert rec.content_chunks == 1


async def test_tool_calls_and_reasoning_count_as_content():
    tool = b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}\n\n'
    think = b'data: {"choices":[{"delta":{"reasoning_content":"hm"}}]}\n\n'
    rec, _ = await relay([think, tool, DONE])
    assert rec.content_chunks == 2


async def test_stream_without_done_is_an_error():
    with pytest.raises(UpstreamError, match="closed the stream"):
        await relay([ROLE + CHUNK % b"a"])


async def test_broken_connection_is_an_error():
    with pytest.raises(UpstreamError, match="broke the stream"):
        await relay([ROLE], fail_with=ServerDisconnected("cut", got_bytes=True))


async def test_error_event_from_runtime_is_relayed_then_reported():
    err = b'data: {"error":{"message":"oom","type":"server_error","code":500}}\n\n'
    with pytest.raises(UpstreamError):
        client = Client()
        await relay([CHUNK % b"a", err], client=client)
    assert err in client.body


async def test_last_event_without_blank_line_is_delivered():
    _, client = await relay([CHUNK % b"a" + b"data: [DONE]"])
    assert client.body.endswith(b"data: [DONE]\n\n")


async def test_first_token_timeout():
    t = TimeoutConfig(first_token_s=0.05, between_tokens_s=10, total_s=10)
    with pytest.raises(UpstreamTimeout) as info:
        await relay([ROLE, CHUNK % b"a", DONE], timeouts=t, delays=[0, 0.3])
    assert info.value.phase == "first token"


async def test_between_tokens_timeout():
    t = TimeoutConfig(first_token_s=10, between_tokens_s=0.05, total_s=10)
    with pytest.raises(UpstreamTimeout) as info:
        await relay([CHUNK % b"a", CHUNK % b"b", DONE], timeouts=t, delays=[0, 0.3])
    assert info.value.phase == "between tokens"


async def test_total_timeout():
    t = TimeoutConfig(first_token_s=10, between_tokens_s=0.2, total_s=0.25)
    with pytest.raises(UpstreamTimeout) as info:
        await relay([CHUNK % b"a"] * 20 + [DONE], timeouts=t, delays=[0.05] * 21)
    assert info.value.phase == "total"


def test_error_event_body_is_openai_shaped():
    ev = UpstreamTimeout("between tokens", 1).sse_event()
    assert orjson.loads(ev.removeprefix(b"data: "))["error"]["code"] == "upstream_timeout"


def test_scanner_is_linear_in_the_bytes_of_one_huge_event():
    # The regression: the pending tail was re-concatenated and rescanned on every read, so one
    # event of N bytes cost O(N^2) (8/16/32 MB: 0.2/0.9/3.5 s of CPU on the event loop). Count the
    # bytes searched instead of timing: each read's bytes are searched once (plus 3 at the cut).
    s = SSEScanner(max_event=64 << 20)
    searched = 0
    real_find = bytearray.find

    class Counting(bytearray):
        def find(self, sub, start=0, *args):
            nonlocal searched
            searched += len(self) - start
            return real_find(self, sub, start, *args)

    s._tail = Counting()
    piece = b"x" * 65536
    for _ in range(256):  # 16 MiB in 64 KiB reads
        assert s.feed(piece) == []
    assert searched <= 2 * 2 * 256 * (len(piece) + 3)  # two terminators searched, each once per byte
    assert s.feed(b"\n\n") == [b"x" * (256 * 65536) + b"\n\n"]


def test_scanner_refuses_an_event_larger_than_its_cap_without_holding_more():
    s = SSEScanner(max_event=1000)
    s.feed(b"data: " + b"y" * 900)
    with pytest.raises(UpstreamTooLarge, match=r"1000 bytes \(\[limits\] max_event_bytes\)"):
        s.feed(b"y" * 200)
    assert s.pending == b""  # what was held is let go
    with pytest.raises(UpstreamTooLarge):  # a complete event past the cap, in one read, too
        SSEScanner(max_event=100).feed(b"data: " + b"z" * 200 + b"\n\n")


async def test_a_huge_line_with_no_end_is_refused_at_the_cap():
    with pytest.raises(UpstreamTooLarge):
        await relay([ROLE, CHUNK % b"a"] + [b"data: " + b"q" * 4096] * 10_000, max_event=64 * 1024)


async def test_nothing_after_done_is_relayed_and_reading_stops_there():
    extra = CHUNK % b"late" + b'data: {"error":{"message":"x"}}\n\n'
    resp = FakeResponse([ROLE + CHUNK % b"a" + DONE + extra, extra])
    rec, client = record(), Client()
    r = StreamRelay(rec, client, TimeoutConfig(), strip_usage=False)
    await r.run(resp, deadline(rec, TimeoutConfig()))
    assert client.body == ROLE + CHUNK % b"a" + DONE and rec.content_chunks == 1
    assert resp.reads == 1 and not r.upstream_error


async def test_a_runtime_that_idles_after_done_has_answered_in_full():
    # The regression: [DONE] then silence turned a complete answer into a between-tokens error.
    t = TimeoutConfig(first_token_s=5, between_tokens_s=0.1, total_s=5)
    rec, client = await relay([ROLE + CHUNK % b"a" + CHUNK % b"b", DONE], timeouts=t, then_idle=True)
    assert client.body.endswith(DONE) and rec.content_chunks == 2


async def test_only_content_moves_the_between_tokens_deadline():
    # A runtime that drips comments after its first token is not producing tokens.
    t = TimeoutConfig(first_token_s=5, between_tokens_s=0.2, total_s=5)
    start = time.perf_counter()
    with pytest.raises(UpstreamTimeout) as info:
        await relay([CHUNK % b"a"] + [b": ping\n\n"] * 100 + [DONE], timeouts=t, delays=[0] + [0.05] * 100)
    assert info.value.phase == "between tokens" and time.perf_counter() - start < 2


async def test_a_client_that_takes_nothing_past_the_deadline_is_a_client_timeout_not_the_runtimes():
    class Stuck(Client):
        async def __call__(self, msg):
            await super().__call__(msg)
            if len(self.messages) >= 2:
                await asyncio.Event().wait()  # flow control: the client reads nothing

    t = TimeoutConfig(first_token_s=5, between_tokens_s=0.1, total_s=5)
    with pytest.raises(ClientTimeout):
        await relay([CHUNK % b"a", CHUNK % b"b", CHUNK % b"c", DONE], timeouts=t, client=Stuck())


async def test_the_quick_content_find_counts_exactly_what_the_content_pattern_does():
    from passerelle.chunks import CHAT

    forms = [b'"content":"a"', b'"content":""', b'"content":null', b'"content": "a"', b'"content":"\\"q"',
             b'"role":"assistant","content":""', b'"reasoning_content":"r"', b'"content":"",'
             b'"tool_calls":[{"id":"c"}]', b'"text":"t"', b'"content" : ""', b'"content":"\\n"']
    events = [b'data: {"choices":[{"index":0,"delta":{%s}}]}\n\n' % f for f in forms]
    events += [b'data: {"content":"', b'data: {"x":"content":""}']  # (cut short: the find's edge)
    rng = random.Random(7)
    stream = [rng.choice(events[:-2]) for _ in range(200)]
    rec, _ = await relay([b"".join(stream) + DONE])
    assert rec.content_chunks == sum(1 for ev in stream if CHAT.search(ev))
    for ev in events:  # one at a time, as the relay's scan sees them
        r = StreamRelay(record(), Client(), TimeoutConfig(), strip_usage=False)
        r._scan([ev], 1.0)
        assert r.rec.content_chunks == (1 if CHAT.search(ev) else 0), ev
