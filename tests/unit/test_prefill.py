"""The prefill cost (scheduling/prefill.py): the rate learned from a runtime's own timings, what
is known cached, and the scheduler's use of it: a cheap later turn before a cold opening prompt of
the same tenant and class, the aging bound, fair share and classes untouched, placement."""

from __future__ import annotations

import pytest

from passerelle.runtimes.base import BackendStats
from passerelle.scheduling.prefill import MAX_RUNTIMES, PRIOR_TOKENS_PER_S, PrefillBook
from tests.unit.test_scheduler import Clock, FakeBackend, job, make


def timings(tokens: float, seconds: float) -> BackendStats:
    return BackendStats(up=True, prompt_tokens_total=tokens, prompt_seconds_total=seconds)


def test_the_rate_is_learned_from_the_runtimes_own_timings():
    book = PrefillBook()
    assert book.rate("llama") == PRIOR_TOKENS_PER_S  # nothing measured yet: the prior
    book.observe("llama", BackendStats(up=True))  # a runtime that reports no timings: nothing
    book.observe("llama", timings(5000, 40))  # the first totals seen: a baseline, not a rate
    assert book.rate("llama") == PRIOR_TOKENS_PER_S and book.rates() == {}
    book.observe("llama", timings(6000, 42))  # 1000 tokens in 2 s
    assert book.rate("llama") == 500
    book.observe("llama", timings(6010, 42.5))  # too little work to time: ignored
    assert book.rate("llama") == 500
    book.observe("llama", timings(6100, 43))  # 100 tokens in 1 s since the last measurement
    assert book.rate("llama") == pytest.approx(0.7 * 500 + 0.3 * 100)
    book.observe("llama", timings(300, 1))  # it restarted: counts from there, the rate kept
    assert book.rate("llama") == pytest.approx(380)
    book.observe("llama", timings(1300, 3))
    assert book.rate("llama") == pytest.approx(0.7 * 380 + 0.3 * 500)
    assert book.rate("other") == PRIOR_TOKENS_PER_S  # per runtime


def test_memory_is_bounded():
    book = PrefillBook(max_keys=2)
    for i in range(MAX_RUNTIMES + 5):
        book.observe(f"r{i}", timings(0, 0))
    assert len(book._rates) == MAX_RUNTIMES
    for key in ("a", "b", "c"):
        book.turn_ended(key, 100)
    assert book.uncached("a", 150, cached_here=True) == 150  # the least recent, forgotten
    assert book.uncached("c", 150, cached_here=True) == 50
    book.configure(1)
    assert book.uncached("b", 150, cached_here=True) == 150


def test_only_what_a_cached_prompt_adds_is_computed():
    book = PrefillBook()
    book.turn_ended("conv", 1000)
    assert book.uncached("conv", 1100, cached_here=True) == 100
    assert book.uncached("conv", 1100, cached_here=False) == 1100  # another replica: all of it
    assert book.uncached("conv", 800, cached_here=True) == 800  # shorter: not an extension of it
    assert book.uncached("new", 500, cached_here=True) == 500  # nothing known
    assert book.uncached("", 500, cached_here=True) == 500


def served(s, b, conv: str, tokens: int, tenant: str = "t") -> None:
    """A turn of conversation ``conv`` ran on ``b`` and ended: its prompt is cached there."""
    j = job([b], tenant=tenant, affinity=conv, est_prompt_tokens=tokens, est_output_tokens=0)
    s.submit(j)
    assert j.backend is b
    s.release(j)


async def test_a_cheap_later_turn_starts_before_a_cold_opening_prompt_of_its_class():
    for defer_s, first in ((10.0, "warm"), (0.0, "cold")):  # (0: first come, first served)
        clock = Clock()
        s = make(clock, prefill_defer_s=defer_s)
        b = FakeBackend(capacity=1)
        served(s, b, "conv-a", 1000)
        blocker = job([b], est_prompt_tokens=10)
        s.submit(blocker)
        cold = job([b], affinity="conv-b", est_prompt_tokens=1200)  # an opening prompt: nothing cached
        s.submit(cold)
        clock.now += 1
        warm = job([b], affinity="conv-a", est_prompt_tokens=1100)  # conv-a's next turn: 100 tokens new
        s.submit(warm)
        if defer_s:
            assert (cold.prefill_s, warm.prefill_s) == (1200 / PRIOR_TOKENS_PER_S, 100 / PRIOR_TOKENS_PER_S)
        s.release(blocker)
        assert {"warm": warm, "cold": cold}[first].backend is b
        assert (warm.backend is None) != (cold.backend is None)
        assert s.prefill.deferred == (1 if defer_s else 0)


async def test_an_expensive_request_is_passed_over_for_prefill_defer_s_at_most():
    for waited, first in ((9.9, "warm"), (10.0, "cold")):
        clock = Clock()
        s = make(clock, prefill_defer_s=10.0)
        b = FakeBackend(capacity=1)
        served(s, b, "conv-a", 1000)
        blocker = job([b], est_prompt_tokens=10)
        s.submit(blocker)
        cold = job([b], affinity="conv-b", est_prompt_tokens=1200)
        s.submit(cold)
        clock.now += 1
        warm = job([b], affinity="conv-a", est_prompt_tokens=1100)
        s.submit(warm)
        clock.now += waited - 1  # the cold one has waited `waited` seconds
        s.release(blocker)
        assert {"warm": warm, "cold": cold}[first].backend is b
        assert s.prefill.aged == (1 if first == "cold" else 0)


async def test_fair_share_and_classes_decide_before_the_cost():
    clock = Clock()
    s = make(clock, prefill_defer_s=10.0)
    b = FakeBackend(capacity=1)
    blocker = job([b], tenant="heavy", affinity="conv-a", est_prompt_tokens=1000, est_output_tokens=0)
    s.submit(blocker)
    cold = job([b], tenant="light", affinity="conv-b", est_prompt_tokens=1200)  # expensive
    s.submit(cold)
    warm = job([b], tenant="heavy", affinity="conv-a", est_prompt_tokens=1100)  # cheaper
    s.submit(warm)
    assert warm.prefill_s < cold.prefill_s
    s.release(blocker, prompt_tokens=2000, completion_tokens=0)  # heavy was served more than estimated
    assert cold.backend is b and warm.backend is None  # the less-served tenant first, whatever it costs
    s.release(cold)
    assert warm.backend is b
    s.release(warm)
    # a better class first, whatever it costs
    served(s, b, "conv-c", 1000)
    blocker = job([b], est_prompt_tokens=10)
    s.submit(blocker)
    cheap = job([b], cls="standard", affinity="conv-c", est_prompt_tokens=1010)
    dear = job([b], cls="interactive", affinity="conv-d", est_prompt_tokens=3000)
    s.submit(cheap)
    s.submit(dear)
    s.release(blocker)
    assert dear.backend is b and cheap.backend is None


async def test_a_request_goes_where_its_prompt_costs_least_among_equally_loaded_replicas():
    clock = Clock()
    s = make(clock, prefill_defer_s=10.0)
    slow, fast = FakeBackend(name="slow", capacity=2), FakeBackend(name="fast", capacity=2)
    for name, seconds in (("slow", 10.0), ("fast", 1.0)):  # 1000 tokens in 10 s, in 1 s
        s.prefill.observe(name, timings(0, 0))
        s.prefill.observe(name, timings(1000, seconds))
    j = job([slow, fast], est_prompt_tokens=500)
    s.submit(j)
    assert j.backend is fast
    busy = job([slow, fast], est_prompt_tokens=0)  # no prompt to weigh: the least loaded
    s.submit(busy)
    assert busy.backend is slow


async def test_a_turn_waits_for_its_busier_home_while_its_queue_drains_sooner_than_the_miss_costs():
    for cached, stays in ((2000, True), (100, False)):
        clock = Clock()
        s = make(clock, affinity_slack=0.5)
        home, other = FakeBackend(name="home", capacity=2), FakeBackend(name="other", capacity=2)
        served(s, home, "conv", cached)  # dispatched at t=0, on home
        fillers = [job([home], tenant="x", est_prompt_tokens=10) for _ in range(3)]
        for f in fillers:  # two run at t=0, one waits: home (2 + 1) / 2 = 1.5 busier than other
            s.submit(f)
        clock.now += 10  # home dispatched 3 in the last 10 s: a place in its queue drains in 3.3 s
        turn = job([home, other], affinity="conv", est_prompt_tokens=2100)
        s.submit(turn)
        # elsewhere its whole prompt, 2100 tokens (10.5 s at the prior rate); at home what it adds:
        # with 2000 cached, 100 (0.5 s): 10 s saved, more than the 1 place of home's queue
        # beyond the slack takes (1.0 <= 10 s x 0.3/s / 2 slots); with 100 cached, 0.5 s: it spills
        assert turn.backend is (None if stays else other)
