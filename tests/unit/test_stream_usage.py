"""A stream its client cuts is charged what it was sent, on every API: the completion tokens in the
usage store, the access log, the metrics, the key's tokens per minute and the scheduler's fair
share are the content events relayed to the client (chunks.py), or the runtime's own count when it
came; the prompt is the runtime's count when it came, else the gateway's estimate. Disconnecting
must not make a stream cheaper than reading it."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client import generate_latest

from passerelle.chunks import PATTERNS, count_events
from passerelle.errors import Cause
from passerelle.observe.accesslog import record_fields
from passerelle.tenants.keys import KeyStore
from tests.inprocess import fake_runtime, gateway
from tests.waiting import until

ASK = [{"role": "user", "content": "Tell me about the old mills by the river"}]
STREAMS = {  # API: (path, a long streamed request)
    "chat": ("/v1/chat/completions", {"model": "fake-model", "messages": ASK, "max_tokens": 400, "stream": True}),
    "completions": ("/v1/completions", {"model": "fake-model", "prompt": "Once upon a time", "max_tokens": 400,
                                        "stream": True}),
    "responses": ("/v1/responses", {"model": "fake-model", "input": ASK[0]["content"], "max_output_tokens": 400,
                                    "stream": True}),
    "messages": ("/v1/messages", {"model": "fake-model", "messages": ASK, "max_tokens": 400, "stream": True}),
}


def generated(gw) -> float:
    """passerelle_generation_tokens_total, all series."""
    text = generate_latest(gw.app.gateway.metrics.registry).decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("passerelle_generation_tokens_total{"))


async def settled(gw) -> None:
    await until(lambda: not gw.app.gateway.open and not any(b.in_flight for b in gw.app.registry.backends), 5,
                "every exchange and backend idle")


@pytest.mark.parametrize("api", list(STREAMS))
@pytest.mark.parametrize("bare", [False, True], ids=["complete-events", "bare-events"])
async def test_a_stream_the_client_cuts_is_charged_what_it_was_sent(tmp_path, api, bare):
    path, body = STREAMS[api]
    store = KeyStore(tmp_path / "k.db")
    key, secret = store.create("cutter", tpm=1_000_000)
    store.close()
    async with fake_runtime(itl_ms=5, bare_events=bare) as fake, \
            gateway(fake.backend_config(kind="llama-server"), db=tmp_path / "k.db") as gw:
        charged: list[tuple[int | None, int | None]] = []
        release = gw.app.scheduler.release

        def spy(job, *, prompt_tokens=None, completion_tokens=None):
            charged.append((prompt_tokens, completion_tokens))
            release(job, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)

        gw.app.scheduler.release = spy
        resp = await gw.post(path, body, headers={"authorization": f"Bearer {secret}"}, leave_after_chunks=8)
        await settled(gw)
        sent = count_events(PATTERNS[api], resp.body)
        assert resp.status == 200 and 3 <= sent < 400
        [rec] = gw.records
        assert rec.cause is Cause.CLIENT_DISCONNECT
        # what the client was sent, in every account of the request
        assert rec.completion_tokens == sent and record_fields(rec)["completion_tokens"] == sent
        assert generated(gw) == sent
        if api == "messages":  # the runtime's count of the prompt came (message_start); elsewhere the estimate
            assert rec.prompt_tokens == fake.runtime.counters.prompt_tokens
        else:
            assert rec.prompt_tokens and rec.prompt_tokens > 0
        assert charged == [(rec.prompt_tokens, sent)]
        await gw.app.stores.usage.flush()
        row = gw.app.stores.usage.conn.execute("SELECT cause, prompt_tokens, completion_tokens FROM usage").fetchall()
        assert row == [("client_disconnect", rec.prompt_tokens, sent)]
        # tokens per minute: the reservation (prompt + max_tokens) replaced by what was sent
        assert gw.app.gateway.keys.limiter._usage[key.id].token_sum == rec.prompt_tokens + sent


async def test_a_complete_stream_is_still_charged_the_runtimes_count(tmp_path):
    path, body = STREAMS["messages"]
    async with fake_runtime(itl_ms=0) as fake, gateway(fake.backend_config(kind="llama-server")) as gw:
        resp = await gw.post(path, {**body, "max_tokens": 12})
        assert resp.status == 200 and count_events(PATTERNS["messages"], resp.body) == 12
        [rec] = gw.records
        assert rec.cause is Cause.OK and rec.usage_from_server and rec.completion_tokens == 12
        assert rec.prompt_tokens == fake.runtime.counters.prompt_tokens


async def test_a_client_gone_before_its_stream_began_is_charged_nothing_it_was_not_sent(tmp_path):
    path, body = STREAMS["messages"]
    async with fake_runtime(ttft_ms=2000) as fake, gateway(fake.backend_config(kind="llama-server")) as gw:
        task = asyncio.create_task(gw.post(path, body))
        await until(lambda: fake.runtime.counters.in_flight, 5, "the request at the runtime")
        [ex] = gw.app.gateway.open
        ex.end_now()  # as the watcher does on the client's hang-up
        await task
        [rec] = gw.records
        assert rec.cause is Cause.CLIENT_DISCONNECT and rec.completion_tokens == 0


def test_the_access_log_and_the_usage_row_read_one_figure():
    # (record_fields reads completion_tokens the way billed_tokens does: one figure everywhere)
    from passerelle.observe.record import RequestRecord
    from passerelle.tenants.usage import billed_tokens

    rec = dataclasses.replace(RequestRecord(id="r", endpoint="chat"), content_chunks=7, prompt_tokens=3)
    assert record_fields(rec)["completion_tokens"] == billed_tokens(rec)[1] == 7
