"""A key's requests beyond its max_concurrency wait in the key's own queue (bounded by the class's
queue wait and length) instead of being refused; the per-minute limits still refuse at once.
In process, with asyncio; the same through a real gateway and the fake runtime is in
tests/integration/test_keys_fake.py."""

from __future__ import annotations

import asyncio

import pytest

from passerelle.config import ClassConfig
from passerelle.errors import QueueFull, QueueTimeout, RateLimited
from passerelle.tenants.keys import ApiKey
from passerelle.tenants.limits import KeyLimiter
from tests.waiting import until

STANDARD = ClassConfig("standard", 1, max_queue=512, max_queue_wait_s=120.0)


async def test_twenty_requests_on_a_key_of_four_all_complete_four_at_a_time():
    key = ApiKey("k", "team", max_concurrency=4)
    limiter = KeyLimiter()
    now = peak = done = 0
    release = asyncio.Event()

    async def request() -> None:
        nonlocal now, peak, done
        grant = limiter.admit(key, 10)
        await limiter.wait_turn(grant, key, STANDARD)
        try:
            now += 1
            peak = max(peak, now)
            await release.wait()
            await asyncio.sleep(0)  # the next ones get their turn while these end
        finally:
            now -= 1
            done += 1
            limiter.finish(grant, 10)

    tasks = [asyncio.create_task(request()) for _ in range(20)]
    await until(lambda: now == 4 and limiter.state("k") == {"running": 4, "queued": 16},
                what="four running, sixteen queued")
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert (done, peak) == (20, 4) and limiter.state("k") == {"running": 0, "queued": 0}


async def test_waiting_is_bounded_by_the_class_queue_wait_and_length():
    key = ApiKey("k", "team", max_concurrency=1)
    limiter = KeyLimiter()
    quick = ClassConfig("quick", 0, max_queue=1, max_queue_wait_s=0.05)
    first = limiter.admit(key, 1)
    await limiter.wait_turn(first, key, quick)
    second = limiter.admit(key, 1)
    waiting = asyncio.create_task(limiter.wait_turn(second, key, quick))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):  # one already waits, the class allows one
        await limiter.wait_turn(limiter.admit(key, 1), key, quick)
    with pytest.raises(QueueTimeout) as info:
        await waiting
    assert info.value.status == 429 and "0.05 s" in info.value.message
    assert limiter.state("k") == {"running": 1, "queued": 0}
    limiter.finish(first, 1)
    assert limiter.state("k") == {"running": 0, "queued": 0}


async def test_a_client_that_leaves_while_waiting_leaves_the_queue_and_no_slot_is_lost():
    key = ApiKey("k", "team", max_concurrency=1)
    limiter = KeyLimiter()
    first = limiter.admit(key, 1)
    await limiter.wait_turn(first, key, STANDARD)
    left = asyncio.create_task(limiter.wait_turn(limiter.admit(key, 1), key, STANDARD))
    third = limiter.admit(key, 1)
    stays = asyncio.create_task(limiter.wait_turn(third, key, STANDARD))
    await asyncio.sleep(0)
    left.cancel()
    await asyncio.sleep(0)
    assert limiter.state("k") == {"running": 1, "queued": 1}
    limiter.finish(first, 1)
    await asyncio.wait_for(stays, 1)
    assert third.holding and limiter.state("k") == {"running": 1, "queued": 0}


async def test_the_more_urgent_class_of_a_key_goes_first():
    key = ApiKey("k", "team", max_concurrency=1)
    limiter = KeyLimiter()
    first = limiter.admit(key, 1)
    await limiter.wait_turn(first, key, STANDARD)
    order: list[str] = []

    async def wait(name: str, cls: ClassConfig) -> None:
        grant = limiter.admit(key, 1)
        await limiter.wait_turn(grant, key, cls)
        order.append(name)
        limiter.finish(grant, 1)

    batch = asyncio.create_task(wait("batch", ClassConfig("batch", 2)))
    await asyncio.sleep(0)
    interactive = asyncio.create_task(wait("interactive", ClassConfig("interactive", 0)))
    await asyncio.sleep(0)
    limiter.finish(first, 1)
    await asyncio.gather(batch, interactive)
    assert order == ["interactive", "batch"]


async def test_raising_the_limit_lets_waiters_in_as_slots_free():
    key = ApiKey("k", "team", max_concurrency=1)
    limiter = KeyLimiter()
    first = limiter.admit(key, 1)
    await limiter.wait_turn(first, key, STANDARD)
    waiters = [limiter.admit(key, 1) for _ in range(3)]
    tasks = [asyncio.create_task(limiter.wait_turn(g, key, STANDARD)) for g in waiters]
    await asyncio.sleep(0)
    wider = ApiKey("k", "team", max_concurrency=3)  # `passerelle keys update k --max-concurrency 3`
    late = limiter.admit(wider, 1)
    late_task = asyncio.create_task(limiter.wait_turn(late, wider, STANDARD))  # joins the queue, behind them
    await asyncio.sleep(0)
    limiter.finish(first, 1)
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert limiter.state("k") == {"running": 3, "queued": 1}
    for g in waiters:
        limiter.finish(g, 1)
    await asyncio.wait_for(late_task, 1)


def test_rpm_and_tpm_still_refuse_at_once_with_retry_after():
    now = [100.0]
    limiter = KeyLimiter(clock=lambda: now[0])
    key = ApiKey("k", "team", rpm=2, tpm=1000)
    limiter.admit(key, 100)
    limiter.admit(key, 100)
    with pytest.raises(RateLimited) as info:
        limiter.admit(key, 100)
    assert info.value.retry_after == pytest.approx(60)
    now[0] += 61
    with pytest.raises(RateLimited) as info:
        limiter.admit(key, 5000)
    assert "Lower max_tokens" in info.value.message
