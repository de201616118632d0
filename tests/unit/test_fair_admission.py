"""Fair admission: a tenant holds at most ``[scheduler] tenant_queue_share`` of a class's queue
while others wait; alone it may fill the queue, and a newcomer then takes the place of its newest
queued request (429 ``tenant_queue_full`` with Retry-After to the tenant over its share).

The scheduler with an injected clock, then the hostile case through the in-process gateway: one
anonymous client opening 60 streams on a 2-slot runtime, and a second user is still admitted.
"""

from __future__ import annotations

import asyncio

import pytest

from passerelle.config import ClassConfig, SchedulerConfig
from passerelle.errors import Cause, QueueFull, TenantQueueFull
from tests.inprocess import fake_runtime, gateway
from tests.unit.test_scheduler import Clock, FakeBackend, job, scheduler
from tests.waiting import until

Q10 = ClassConfig("standard", 1, max_queue=10, max_queue_wait_s=60.0)


def sched(share: float = 0.5):
    return scheduler((Q10,), clock=Clock(), tenant_queue_share=share)


async def test_a_lone_tenant_may_fill_the_queue_then_gets_queue_full():
    b = FakeBackend(capacity=1)
    s = sched()
    jobs = [job([b], Q10, tenant="hog", est_output_tokens=100) for _ in range(11)]  # one running, ten queued
    for j in jobs:
        s.submit(j)
    assert len(s.waiting) == 10
    with pytest.raises(QueueFull):
        s.submit(job([b], Q10, tenant="hog", est_output_tokens=100))


async def test_a_newcomer_takes_the_place_of_the_hogs_newest_request():
    b = FakeBackend(capacity=1)
    s = sched()
    hog = [job([b], Q10, tenant="hog", est_output_tokens=100) for _ in range(11)]
    for j in hog:
        s.submit(j)
    ada = job([b], Q10, tenant="ada", est_output_tokens=100)
    s.submit(ada)
    assert ada in s.waiting and len(s.waiting) == 10
    err = hog[-1].future.exception()
    assert isinstance(err, TenantQueueFull) and err.status == 429 and err.retry_after >= 1
    assert hog[-1] not in s.waiting and s.tenants["hog"].waiting == 9 and s.share_refusals == 1
    # while ada waits, the hog is held to its share (5 of 10): it has 9 queued
    with pytest.raises(TenantQueueFull):
        s.submit(job([b], Q10, tenant="hog", est_output_tokens=100))
    # and she is not behind the hog's nine: back from idle she starts level with it (no banked
    # credit), so she goes as soon as the hog has received more
    s.release(hog[0])
    s.release(hog[1])
    assert ada.backend is b


async def test_under_its_share_a_tenant_queues_and_at_it_is_refused_while_others_wait():
    b = FakeBackend(capacity=1)
    s = sched()
    s.submit(job([b], Q10, tenant="bob", est_output_tokens=100))  # runs
    s.submit(job([b], Q10, tenant="bob", est_output_tokens=100))  # waits: someone else waits now
    for _ in range(5):
        s.submit(job([b], Q10, tenant="hog", est_output_tokens=100))
    with pytest.raises(TenantQueueFull):
        s.submit(job([b], Q10, tenant="hog", est_output_tokens=100))
    s.submit(job([b], Q10, tenant="eve", est_output_tokens=100))  # others still get in


async def test_a_share_of_one_is_the_old_behaviour():
    b = FakeBackend(capacity=1)
    s = sched(share=1.0)
    for _ in range(11):
        s.submit(job([b], Q10, tenant="hog", est_output_tokens=100))
    with pytest.raises(QueueFull):
        s.submit(job([b], Q10, tenant="ada", est_output_tokens=100))


async def test_one_client_with_sixty_streams_on_two_slots_does_not_lock_out_the_next_user():
    standard = ClassConfig("standard", 1, max_queue=40, max_queue_wait_s=60.0)
    classes = (ClassConfig("interactive", 0), standard, ClassConfig("batch", 2, preemptible=True))
    async with fake_runtime(ttft_ms=5, itl_ms=10, slots=2) as fake, gateway(
            fake.backend_config(max_concurrency=2), classes=classes, scheduler=SchedulerConfig()) as gw:
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                "stream": True}
        hog = [asyncio.create_task(gw.post("/v1/chat/completions", body, timeout=60)) for _ in range(60)]
        await until(lambda: len(gw.app.scheduler.waiting) >= 40, 10, "40 of the hog's requests queued")
        second = await gw.post("/v1/chat/completions", {**body, "user": "second"}, timeout=30)
        assert second.status == 200 and b"[DONE]" in second.body
        answers = await asyncio.gather(*hog)
        causes = [r.cause for r in gw.records if r.tenant == "anonymous"]
        assert causes.count(Cause.TENANT_QUEUE_FULL) >= 1 and Cause.QUEUE_FULL in causes
        refused = next(a for a in answers if a.status == 429 and a.json()["error"]["code"] == "tenant_queue_full")
        assert int(refused.headers[b"retry-after"]) >= 1
        assert sum(a.status == 200 for a in answers) >= 40
        stats = (await gw.get("/admin/stats")).json()["fair_admission"]
        assert stats["tenant_queue_share"] == 0.5 and stats["refused_total"] >= 1
