"""Preemption through the whole gateway, in-process (tests/inprocess.py), in front of the fake
runtime standing in for a one-slot llama-server: a batch stream cut for an interactive request
reaches its client as one well-formed stream with its true usage, and the record says so. (The
fake does not continue text the way a model does; the real llama-server test does:
tests/integration/test_preemption_llama.py.)"""

from __future__ import annotations

import asyncio

import orjson

from passerelle.config import AuthConfig, SchedulerConfig
from passerelle.errors import Cause
from passerelle.runtimes.breaker import CircuitBreaker, Outcome
from tests.inprocess import fake_runtime, gateway
from tests.waiting import until

BATCH = {"model": "fake-model", "messages": [{"role": "user", "content": "Tell a long story"}], "max_tokens": 40}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
AUTH = AuthConfig(anonymous_max_priority="interactive")


def settled(gw) -> bool:
    s = gw.app.scheduler
    return not s.waiting and not any(s.running.values()) and all(b.in_flight == 0 for b in gw.app.registry.backends)


def one_slot(fake):
    return fake.backend_config(kind="llama-server", max_concurrency=0)  # its /props says 1 slot


async def run_flood(gw, batch_body: dict, *, leave: bool = False):
    """A batch request, then an interactive one once the batch stream has relayed a few tokens
    (the interactive request cuts it at once: the fake's continuation restarts its word list, so a
    cut after one word would look to the splice like llama-server repeating the partial message)."""
    batch = asyncio.create_task(gw.post("/v1/chat/completions", batch_body, headers={"X-Priority": "batch"},
                                        leave_after_chunks=12 if leave else None))
    await until(lambda: bool((p := gw.app.scheduler.preemptor) and p.suspendable
                             and all(s.tokens >= 3 for s in p.suspendable.values())) or batch.done())
    chat = await gw.post("/v1/chat/completions", CHAT, headers={"X-Priority": "interactive"})
    return await batch, chat


async def test_a_batch_stream_cut_for_an_interactive_request_is_one_stream_with_true_usage():
    async with fake_runtime(itl_ms=10, slots=1) as fake, gateway(one_slot(fake), auth=AUTH) as gw:
        body = {**BATCH, "stream": True, "stream_options": {"include_usage": True}}
        batch, chat = await run_flood(gw, body)
        assert chat.status == 200 and batch.status == 200
        events = [orjson.loads(e) for e in batch.events() if e != b"[DONE]"]
        assert batch.events()[-1] == b"[DONE]"
        assert len({e["id"] for e in events}) == 1  # one stream, whatever the attempts
        assert sum(1 for e in events if e["choices"] and "role" in e["choices"][0]["delta"]) == 1
        words = [e["choices"][0]["delta"]["content"] for e in events
                 if e["choices"] and e["choices"][0]["delta"].get("content")]
        assert len(words) == 40  # every token once, none repeated, none lost
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == 40 and usage["prompt_tokens"] == 4  # the original prompt's words
        recs = {r.priority: r for r in gw.records}
        rec = recs["batch"]
        assert rec.cause is Cause.OK and rec.suspensions == 1 and rec.suspended_s > 0
        # cut once, after the tokens its client had by then (3 at least: it was cut once streaming)
        assert rec.suspended_at is not None and len(rec.suspended_at) == 1 and 3 <= rec.suspended_at[0] < 40
        assert (rec.prompt_tokens, rec.completion_tokens) == (4, 40)
        # the interactive request did not wait for the batch stream to end
        assert recs["interactive"].queue_wait < 1.0 and recs["interactive"].t_end < rec.t_end
        # the continuation asked for the rest: the messages plus what was sent, continued
        assert fake.runtime.counters.requests == 3
        # one count of suspensions, in /admin/stats and in /metrics alike
        stats = (await gw.get("/admin/stats")).json()["preemption"]
        assert (stats["suspended"], stats["resumed"], stats["resumed_streams"]) == (1, 1, 1)
        assert b"passerelle_suspensions_total 1.0" in (await gw.get("/metrics")).body
        assert settled(gw)


async def test_a_cut_attempt_says_nothing_of_its_runtime_to_the_breaker(monkeypatch):
    """The scheduler cut it: neither a success (which would close an open breaker and forgive
    failures) nor a failure."""
    async with fake_runtime(itl_ms=10, slots=1) as fake, gateway(one_slot(fake), auth=AUTH) as gw:
        outcomes: list[Outcome] = []
        record = CircuitBreaker.record
        monkeypatch.setattr(CircuitBreaker, "record",
                            lambda self, outcome, **kw: (outcomes.append(outcome), record(self, outcome, **kw))[1])
        batch, chat = await run_flood(gw, {**BATCH, "stream": True})
        assert batch.status == chat.status == 200 and gw.app.scheduler.preemptor.suspensions == 1
        # the batch stream's cut attempt, the interactive request, the batch stream's continuation
        assert sorted(o.value for o in outcomes) == ["neutral", "success", "success"]


async def test_a_non_streaming_batch_request_is_cut_and_assembled_whole():
    async with fake_runtime(itl_ms=10, slots=1) as fake, gateway(one_slot(fake), auth=AUTH) as gw:
        batch, chat = await run_flood(gw, BATCH)
        assert chat.status == 200 and batch.status == 200
        answer = batch.json()
        assert len(answer["choices"][0]["message"]["content"].split()) == 40
        assert answer["usage"]["completion_tokens"] == 40
        assert [r.suspensions for r in gw.records if r.priority == "batch"] == [1]
        assert settled(gw)
        (rec,) = [r for r in gw.records if r.priority == "batch"]
        (cut,) = rec.earlier or ()  # (what a trace is made of: the cut attempt, then the one resumed)
        assert cut.cut and not cut.error and cut.backend == rec.backend
        assert rec.t_dispatch == cut.t_sent < cut.t_ended < rec.t_sent < rec.t_end


async def test_a_request_with_tools_is_never_suspended():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    async with fake_runtime(itl_ms=5, slots=1) as fake, gateway(one_slot(fake), auth=AUTH) as gw:
        batch = asyncio.create_task(gw.post("/v1/chat/completions", {**BATCH, "stream": True, "tools": tools},
                                            headers={"X-Priority": "batch"}))
        await until(lambda: fake.runtime.counters.requests == 1 and fake.runtime.slots.busy)
        chat = await gw.post("/v1/chat/completions", CHAT, headers={"X-Priority": "interactive"})
        await batch
        recs = {r.priority: r for r in gw.records}
        assert recs["batch"].suspensions == 0 and gw.app.scheduler.preemptor.suspensions == 0
        assert recs["interactive"].t_dispatch > recs["batch"].t_end - 0.05  # it waited for the slot
        assert chat.status == 200 and settled(gw)


async def test_preemption_off_leaves_the_batch_stream_alone():
    async with fake_runtime(itl_ms=5, slots=1) as fake, \
            gateway(one_slot(fake), auth=AUTH, scheduler=SchedulerConfig(preemption=False)) as gw:
        batch, chat = await run_flood(gw, {**BATCH, "stream": True})
        assert [r.suspensions for r in gw.records] == [0, 0] and batch.status == chat.status == 200


async def test_a_client_that_leaves_while_suspended_is_let_go():
    async with fake_runtime(itl_ms=10, slots=1) as fake, gateway(one_slot(fake), auth=AUTH) as gw:
        body = {**BATCH, "stream": True}
        hang_up = asyncio.Event()
        batch = asyncio.create_task(gw.post("/v1/chat/completions", body, headers={"X-Priority": "batch"},
                                            disconnect=hang_up))
        await until(lambda: gw.app.scheduler.preemptor.suspendable)
        chat = asyncio.create_task(gw.post("/v1/chat/completions", {**CHAT, "max_tokens": 30},
                                           headers={"X-Priority": "interactive"}))
        await until(lambda: gw.app.scheduler.preemptor.suspensions == 1)
        hang_up.set()  # the batch client goes away while its stream waits to resume
        await batch
        await chat
        await until(lambda: settled(gw))
        assert (gw.app.scheduler.preemptor.suspensions, gw.app.scheduler.preemptor.resumes) == (1, 0)
        assert {r.priority: r.cause for r in gw.records}["batch"] is Cause.CLIENT_DISCONNECT


async def test_a_stream_is_cut_only_once_its_first_token_went_out():
    """llama-server notices a closed connection only when it writes to it: a request cut while its
    prompt is processed would keep its slot to the end. So nothing is cut before its first token."""
    async with fake_runtime(ttft_ms=300, itl_ms=10, slots=1) as fake, gateway(one_slot(fake), auth=AUTH) as gw:
        batch = asyncio.create_task(gw.post("/v1/chat/completions", {**BATCH, "stream": True},
                                            headers={"X-Priority": "batch"}))
        await until(lambda: fake.runtime.counters.requests == 1)
        assert not gw.app.scheduler.preemptor.suspendable
        chat = await gw.post("/v1/chat/completions", CHAT, headers={"X-Priority": "interactive"})
        await batch
        recs = {r.priority: r for r in gw.records}
        assert chat.status == 200 and recs["batch"].suspensions == 1
        first_token = recs["batch"].t_first
        assert recs["interactive"].t_dispatch >= first_token  # it waited for the first token, then cut


async def test_an_interactive_request_cuts_a_long_stream_at_once_and_waits_for_one_about_to_end():
    """preempt_after_ms (here 2 s) is the most a better request waits, and only for a stream
    expected to end by itself within it (its tokens left at its pace): a stream with 4 s to go is
    cut the moment the request queues; one with a fraction of a second left ends uncut."""
    sched = SchedulerConfig(preempt_after_ms=2000)
    async with fake_runtime(itl_ms=10, slots=1) as fake, gateway(one_slot(fake), auth=AUTH, scheduler=sched) as gw:
        batch, chat = await run_flood(gw, {**BATCH, "stream": True, "max_tokens": 400})  # 4 s of tokens
        assert batch.status == chat.status == 200
        recs = {r.priority: r for r in gw.records}
        assert recs["batch"].suspensions == 1
        assert recs["interactive"].queue_wait < 1.0  # not the 2 s preempt_after_ms
        gw.records.clear()
        batch, chat = await run_flood(gw, {**BATCH, "stream": True, "max_tokens": 40})  # 0.4 s of tokens
        recs = {r.priority: r for r in gw.records}
        assert recs["batch"].suspensions == 0 and gw.app.scheduler.preemptor.suspensions == 1  # (the first's)
        assert recs["interactive"].t_dispatch >= recs["batch"].t_end - 0.05  # it took the slot the stream left
        assert recs["interactive"].queue_wait < 2.0
        assert settled(gw)
