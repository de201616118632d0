"""A hostile runtime, in-process (tests/inprocess.py): every scripted misbehaviour of the fake
(passerelle/testing/faults.py) ends the request with its own cause and a clear message, within its
deadline, while a well-behaved request beside it is served, and every slot comes back.

The same faults against a real gateway process, with memory and file descriptors, are in
tests/integration/test_faults.py."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import orjson
import pytest

from passerelle.config import Config, LimitsConfig, TimeoutConfig
from passerelle.errors import Cause
from passerelle.runtimes.breaker import BreakerState, Outcome
from passerelle.scheduling.scheduler import Job
from passerelle.tenants.keys import KeyStore
from tests.inprocess import fake_runtime, gateway
from tests.waiting import until

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5}
QUICK = TimeoutConfig(connect_s=1, first_token_s=0.4, between_tokens_s=0.4, total_s=1.5, client_write_s=1)
SMALL = LimitsConfig(max_answer_bytes=256 * 1024, max_error_bytes=16 * 1024, max_event_bytes=64 * 1024)


def settled(gw) -> bool:
    s = gw.app.scheduler
    return not s.waiting and not any(s.running.values()) and all(b.in_flight == 0 for b in gw.app.registry.backends)


def error_of(resp) -> dict:
    """The error the client got: the JSON body, or the SSE error event that ended a stream."""
    if resp.headers.get(b"content-type", b"").startswith(b"text/event-stream"):
        last = resp.events()[-1]
        return orjson.loads(last)["error"]
    return resp.json()["error"]


async def with_bystander(gw, fake, hostile):
    """Run ``hostile`` with a well-behaved streaming request beside it, sent once the runtime has the
    hostile one; the hostile response (the bystander's is checked here)."""
    async def bystander():
        await until(lambda: fake.runtime.counters.requests >= 1)
        return await gw.post("/v1/chat/completions", {**CHAT, "stream": True})

    bad, good = await asyncio.gather(hostile, bystander())
    assert good.status == 200 and good.events()[-1] == b"[DONE]"
    return bad


@pytest.fixture
def kind():
    return "openai"


# the scripts that would go on forever if the gateway did not close the connection
HANGS = {"never-answer", "continue-forever", "head-then-silence", "drip", "huge-event"}

CASES = [
    # fault, stream, status, code, cause, words in the message
    ("never-answer", True, 504, "upstream_timeout", Cause.UPSTREAM_TIMEOUT, "first token timeout of 0.4 s; runtime"),
    ("never-answer", False, 504, "upstream_timeout", Cause.UPSTREAM_TIMEOUT, "total timeout of 1.5 s"),
    ("continue-forever", True, 504, "upstream_timeout", Cause.UPSTREAM_TIMEOUT, "first token"),
    ("continue-forever", False, 504, "upstream_timeout", Cause.UPSTREAM_TIMEOUT, "total"),
    ("head-then-silence", True, 504, "upstream_timeout", Cause.UPSTREAM_TIMEOUT, "first token"),
    ("head-then-silence", False, 504, "upstream_timeout", Cause.UPSTREAM_TIMEOUT, "total"),
    ("drip", True, 200, "upstream_timeout", Cause.UPSTREAM_TIMEOUT, "between tokens"),
    ("drip", False, 504, "upstream_timeout", Cause.UPSTREAM_TIMEOUT, "total"),
    ("reset-mid-chunk", True, 200, "upstream_error", Cause.UPSTREAM_ERROR, "broke the stream"),
    ("huge-event", True, 200, "upstream_too_large", Cause.UPSTREAM_ERROR, "[limits] max_event_bytes"),
    ("huge-body", False, 502, "upstream_too_large", Cause.UPSTREAM_ERROR, "[limits] max_answer_bytes"),
    ("huge-error", False, 502, "upstream_too_large", Cause.UPSTREAM_ERROR, "[limits] max_error_bytes"),
    ("redirect", False, 502, "upstream_error", Cause.UPSTREAM_ERROR, "HTTP 302 to 'http://example.invalid"),
    ("redirect", True, 502, "upstream_error", Cause.UPSTREAM_ERROR, "does not follow redirects"),
    ("html", False, 502, "upstream_error", Cause.UPSTREAM_ERROR, "'text/html', not JSON"),
    ("html", True, 502, "upstream_error", Cause.UPSTREAM_ERROR, "not an event stream"),
]


@pytest.mark.parametrize(("fault", "stream", "status", "code", "cause", "words"), CASES,
                         ids=[f"{c[0]}-{'stream' if c[1] else 'json'}" for c in CASES])
async def test_each_misbehaviour_ends_with_its_cause_and_frees_everything(fault, stream, status, code, cause, words):
    async with fake_runtime(fault_bytes=8 * 1024 * 1024, drip_ms=20) as fake, \
            gateway(fake.backend_config(max_concurrency=2), timeouts=QUICK, limits=SMALL) as gw:
        start = time.monotonic()
        resp = await with_bystander(gw, fake, gw.post("/v1/chat/completions",
                                                      {**CHAT, "stream": stream, "fake_fault": fault}))
        took = time.monotonic() - start
        assert resp.status == status
        err = error_of(resp)
        assert err["code"] == code and words in err["message"], err
        bad = next(r for r in gw.records if r.cause is not Cause.OK)
        assert bad.cause is cause and len(gw.records) == 2
        assert took < QUICK.total_s + 1.0  # no wait outlives the request's deadline
        assert settled(gw)
        if fault in HANGS:  # the gateway closed its connection: the fake's script ends too
            await until(lambda: fake.runtime.counters.disconnected >= 1)


async def test_events_after_done_are_not_relayed_and_an_idle_runtime_after_done_is_a_complete_answer():
    async with fake_runtime() as fake, gateway(fake.backend_config(), timeouts=QUICK) as gw:
        start = time.monotonic()
        resp = await gw.post("/v1/chat/completions", {**CHAT, "stream": True, "fake_fault": "after-done"})
        assert time.monotonic() - start < QUICK.between_tokens_s  # it did not wait for a timeout
        assert resp.status == 200 and resp.events()[-1] == b"[DONE]"
        assert b"after" not in resp.body and b"error" not in resp.body
        assert gw.records[0].cause is Cause.OK and settled(gw)


@pytest.mark.parametrize("kind", ["llama-server"])
async def test_answers_assembled_from_a_stream_are_capped_and_stop_at_done(kind):
    # llama-server gets a stream even for a non-streaming request, and the gateway assembles it
    async with fake_runtime(fault_bytes=8 * 1024 * 1024) as fake, \
            gateway(fake.backend_config(kind=kind), timeouts=QUICK, limits=SMALL) as gw:
        big = await gw.post("/v1/chat/completions", {**CHAT, "max_tokens": 20_000})
        assert big.status == 502 and "[limits] max_answer_bytes" in big.json()["error"]["message"]
        done = await gw.post("/v1/chat/completions", {**CHAT, "fake_fault": "after-done"})
        assert done.status == 200 and done.json()["choices"][0]["message"]["content"] == "ab"
        ok = await gw.post("/v1/chat/completions", CHAT)
        assert ok.status == 200 and ok.json()["usage"]["completion_tokens"] == 5
        assert [r.cause for r in gw.records] == [Cause.UPSTREAM_ERROR, Cause.OK, Cause.OK] and settled(gw)


async def test_a_client_that_stops_reading_is_cut_and_gives_its_slot_back():
    # The regression: the error event was written to a client that did not read, blocked on flow
    # control, and the finally that frees the slot and the key's concurrency never ran.
    async with fake_runtime(itl_ms=2) as fake, \
            gateway(fake.backend_config(max_concurrency=1), timeouts=QUICK) as gw:
        stuck = await gw.post("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 100_000},
                              stop_reading_after_chunks=3)
        assert stuck.aborted
        [rec] = gw.records
        assert rec.cause is Cause.CLIENT_TIMEOUT and settled(gw)
        ok = await gw.post("/v1/chat/completions", CHAT)  # the one slot is free again
        assert ok.status == 200
        # it said nothing about the runtime
        assert gw.app.registry.backends[0].breaker.failures == 0


async def test_a_client_that_stops_reading_a_large_answer_holds_a_piece_not_the_answer():
    async with fake_runtime() as fake, gateway(fake.backend_config(), timeouts=QUICK) as gw:
        resp = await gw.post("/v1/embeddings", {"model": "fake-model", "input": ["word"] * 4000},
                             stop_reading_after_chunks=1)
        assert resp.aborted and len(resp.body) <= 1 << 18
        assert gw.records[0].cause is Cause.CLIENT_TIMEOUT and settled(gw)


async def test_a_half_open_probe_ended_by_the_client_lets_the_next_request_probe():
    async with fake_runtime(itl_ms=20) as fake, gateway(fake.backend_config()) as gw:
        b = gw.app.registry.backends[0]
        for _ in range(3):
            b.breaker.record(Outcome.FAILURE, probe=False, now=gw.app.scheduler.clock())
        b.breaker.open_until = gw.app.scheduler.clock()  # the backoff has passed
        resp = await gw.post("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 500},
                             leave_after_chunks=1)
        assert gw.records[0].cause is Cause.CLIENT_DISCONNECT and resp.status == 200
        assert b.breaker.state is BreakerState.HALF_OPEN and not b.breaker.probe_out
        ok = await gw.post("/v1/chat/completions", CHAT)  # the next request is the probe, and closes it
        assert ok.status == 200 and b.breaker.state is BreakerState.CLOSED


async def test_a_4xx_from_the_runtime_says_nothing_about_its_health():
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        for _ in range(5):
            resp = await gw.post("/v1/chat/completions", {**CHAT, "max_tokens": -1})
            assert resp.status == 400 and gw.records[-1].cause is Cause.INVALID_REQUEST
        assert gw.app.registry.backends[0].breaker.state is BreakerState.CLOSED


async def test_admission_counts_every_sequence_a_request_generates(tmp_path):
    # The regression: n = 1000, max_tokens = 500 on a key with tpm = 1000 got 200 and 500,000 tokens.
    store = KeyStore(tmp_path / "keys.db")
    _, secret = store.create("team", tpm=1000)
    auth = {"authorization": f"Bearer {secret}"}
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "keys.db") as gw:
        for extra in ({"n": 1000, "max_tokens": 500}, {"best_of": 10, "max_tokens": 200},
                      {"n": 3, "max_completion_tokens": 400}):
            resp = await gw.post("/v1/chat/completions", {**CHAT, **extra}, headers=auth)
            assert resp.status == 429 and resp.json()["error"]["code"] == "rate_limit_exceeded", extra
        assert fake.runtime.counters.requests == 0
        bad = await gw.post("/v1/chat/completions", {**CHAT, "best_of": 0}, headers=auth)
        assert bad.status == 400 and "best_of" in bad.json()["error"]["message"]
        assert (await gw.post("/v1/chat/completions", {**CHAT, "n": 2}, headers=auth)).status == 200


@pytest.mark.internal_error_expected
async def test_a_fault_of_the_gateway_is_internal_error_not_the_runtimes(monkeypatch):
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        def broken(*_a, **_k):
            raise ZeroDivisionError("a bug")

        monkeypatch.setattr("passerelle.proxy.assemble.ChatAssembler.finish", broken)
        monkeypatch.setattr(gw.app.registry.backends[0], "stream_always", True)
        resp = await gw.post("/v1/chat/completions", CHAT)
        assert resp.status == 500 and resp.json()["error"]["code"] == "internal_error"
        assert gw.records[0].cause is Cause.INTERNAL_ERROR and settled(gw)
        assert gw.app.registry.backends[0].breaker.failures == 0


STREAMS = [  # path, body, how the API's error event is read
    ("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 200},
     lambda last: orjson.loads(last.split(b"data: ", 1)[1])["error"]["code"]),
    ("/v1/messages", {**CHAT, "stream": True, "max_tokens": 200},
     lambda last: orjson.loads(last.split(b"data: ", 1)[1])["error"]["type"]),
]


@pytest.mark.internal_error_expected
@pytest.mark.parametrize(("path", "body", "code_of"), STREAMS, ids=["chat", "messages"])
async def test_a_fault_of_the_gateway_mid_stream_ends_it_with_its_apis_error_event(monkeypatch, caplog, path, body,
                                                                                  code_of):
    # internal_error comes from one place: an exception that is not a GatewayError escaping the
    # request's life (proxy/gateway.py, Gateway.handle). A correct gateway raises none, so it is
    # produced here with a patched bug, in the relay once the stream has begun.
    from prometheus_client import generate_latest

    from passerelle.proxy.relay import StreamRelay

    real = StreamRelay._scan

    def broken(self, events, now):
        if self.before_first is None:  # the response head and a first token went out
            raise ZeroDivisionError("a bug")
        return real(self, events, now)

    async with fake_runtime(itl_ms=2) as fake, gateway(fake.backend_config(kind="llama-server")) as gw:
        monkeypatch.setattr(StreamRelay, "_scan", broken)
        resp = await gw.post(path, body)
        last = resp.body.rstrip().split(b"\n\n")[-1]
        assert resp.status == 200 and b"[DONE]" not in resp.body and b"message_stop" not in resp.body
        assert code_of(last) == ("internal_error" if path.endswith("completions") else "api_error")
        [rec] = gw.records
        assert rec.cause is Cause.INTERNAL_ERROR and rec.status == 500 and settled(gw)
        assert any(r.exc_info and r.exc_info[0] is ZeroDivisionError for r in caplog.records)  # the traceback
        assert gw.app.registry.backends[0].breaker.failures == 0  # never blamed on the runtime
        assert b'cause="internal_error"' in generate_latest(gw.app.metrics.registry)
        monkeypatch.undo()
        again = await gw.post(path, body)  # the gateway keeps serving
        assert again.status == 200 and gw.records[-1].cause is Cause.OK and settled(gw)


async def test_a_queue_wait_is_bounded_by_the_total_timeout():
    t = dataclasses.replace(QUICK, total_s=0.5, first_token_s=5, between_tokens_s=5)
    async with fake_runtime() as fake, gateway(fake.backend_config(max_concurrency=1), timeouts=t) as gw:
        s = gw.app.scheduler
        holder = Job(pool=gw.app.registry.backends, cls=s.classes["standard"], tenant="other", model="fake-model")
        s.submit(holder)  # the one slot is taken for longer than the request may live
        assert holder.backend is not None
        start = time.monotonic()
        queued = await gw.post("/v1/chat/completions", CHAT)
        assert queued.status == 429 and queued.json()["error"]["code"] == "queue_timeout"
        assert "total timeout" in queued.json()["error"]["message"] and time.monotonic() - start < 1.5
        s.release(holder)
        assert settled(gw) and fake.runtime.counters.requests == 0


async def test_a_reload_that_replaces_a_backend_never_leaves_its_model_unserved():
    # Found by the soak: the new backend looked down until the health poller's next pass, so for up
    # to 2 s every request for its model got 503 no_backend; and a second reload while the first
    # old backend still drained took that one for the current backend.
    async with fake_runtime(itl_ms=5) as fake, gateway(fake.backend_config(max_concurrency=8)) as gw:
        configs = [Config(backends=(fake.backend_config(max_concurrency=c),)) for c in (7, 6)]
        gw.app.loader = lambda: configs[0]
        stop = asyncio.Event()

        async def load():
            out = []
            while not stop.is_set():
                out.append((await gw.post("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 20})).status)
                await asyncio.sleep(0)  # (a refusal never waits: let the test go on)
            return out

        users = [asyncio.create_task(load()) for _ in range(4)]
        await until(lambda: len(gw.records) >= 8)
        assert (await gw.app.reload())["added"] == ["fake"]
        await until(lambda: len(gw.records) >= 16)  # (while the first replaced backend still drains)
        gw.app.loader = lambda: configs[1]
        assert (await gw.app.reload())["removed"] == ["fake"]
        done = len(gw.records)
        await until(lambda: len(gw.records) >= done + 8)
        stop.set()
        statuses = [s for u in users for s in await u]
        assert statuses and set(statuses) == {200}
        await until(lambda: len(gw.app.registry.backends) == 1)  # the old ones drained and left
        assert [b.capacity for b in gw.app.registry.backends] == [6] and settled(gw)


@pytest.mark.parametrize("case", ["ok", "runtime error", "first token timeout", "client leaves",
                                  "client stops reading"])
async def test_a_finished_request_leaves_no_reference_cycle(case):
    # Found by the soak: every request left its exchange, its watcher task and their frames in a
    # reference cycle (and a failed one its whole frame chain, buffers included) until the cyclic
    # collector ran, which the gateway runs rarely on purpose; RSS grew by megabytes a minute.
    import gc
    import types

    options = {"fail_rate": 1.0} if case == "runtime error" else {"ttft_ms": 2000} if case == "first token timeout" \
        else {"itl_ms": 2}
    body = {**CHAT, "stream": True, "max_tokens": 100_000 if case.startswith("client") else 5}
    kw = {"leave_after_chunks": 2} if case == "client leaves" else \
        {"stop_reading_after_chunks": 2} if case == "client stops reading" else {}
    async with fake_runtime(**options) as fake, gateway(fake.backend_config(), timeouts=QUICK) as gw:
        await gw.post("/v1/chat/completions", body, **kw)  # (first-use allocations happen here)
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage to look at
        try:
            for _ in range(3):
                await gw.post("/v1/chat/completions", body, **kw)
            await until(lambda: not fake.runtime.slots.busy)  # (the fake's side of a closed connection ends)
            gc.collect()
            # Ours: passerelle's objects, frames, exceptions. (The test's asyncio loop keeps each
            # closed socket transport in a cycle of its own; uvicorn's uvloop does not.)
            ours = [o for o in gc.garbage if type(o).__module__.startswith("passerelle")
                    or isinstance(o, types.FrameType | BaseException)]
            assert not ours, sorted({type(o).__qualname__ for o in ours})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert len(gw.records) == 4 and len({r.cause for r in gw.records}) == 1 and settled(gw)


async def test_a_wait_in_the_keys_own_queue_is_bounded_by_the_total_timeout(tmp_path):
    # The regression: a request waiting for one of its key's concurrent slots waited past total_s,
    # was sent with no time left, ended as the runtime's timeout and opened a healthy replica's breaker.
    store = KeyStore(tmp_path / "keys.db")
    key, secret = store.create("team", max_concurrency=1)
    t = dataclasses.replace(QUICK, total_s=0.5, first_token_s=5, between_tokens_s=5)
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "keys.db", timeouts=t) as gw:
        policy = gw.app.gateway.keys
        api_key = policy.ring.lookup(secret)
        holder = policy.limiter.admit(api_key, 0)  # the key's one slot, taken by another of its requests
        await policy.limiter.wait_turn(holder, api_key, gw.app.scheduler.classes["standard"])
        # ... and given back after the queued request's total time, well within the class's queue wait
        loop = asyncio.get_running_loop()
        loop.call_later(0.8, policy.limiter.finish, holder, 0.0)
        start = time.monotonic()
        queued = await gw.post("/v1/chat/completions", CHAT, headers={"authorization": f"Bearer {secret}"})
        assert queued.status == 429 and queued.json()["error"]["code"] == "queue_timeout", queued.body
        assert gw.records[-1].cause is Cause.QUEUE_TIMEOUT and time.monotonic() - start < 0.8
        assert fake.runtime.counters.requests == 0  # never sent
        b = gw.app.registry.backends[0]
        assert b.breaker.state is BreakerState.CLOSED and b.breaker.failures == 0
        assert policy.limiter.state(key.id)["queued"] == 0
        # the holder gives its slot back
        await until(lambda: not policy.limiter.state(key.id)["running"], 5, "the holder to give its slot back")
        assert settled(gw)
