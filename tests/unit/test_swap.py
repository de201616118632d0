"""The swap decision (scheduling/swap.py) with an injected clock: no processes, no sleeps."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from passerelle.scheduling.swap import IDLE_GRACE_S, Demand, Resident, decide


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


@dataclass
class Model:
    """A runtime as the decision sees it, with times on the injected clock."""

    name: str
    gib: float
    ready_at: float = 0.0
    last_used: float = 0.0
    in_flight: int = 0
    queued: tuple = ()  # keys of requests queued for it
    pinned: bool = False

    def resident(self, clock: Clock) -> Resident:
        return Resident(self.name, self.gib, self.in_flight, min(self.queued, default=None), len(self.queued),
                        resident_s=clock() - self.ready_at, idle_s=clock() - self.last_used, pinned=self.pinned)


def plan_at(clock: Clock, demands, models, budget: float, *, min_resident_s: float = 30.0, policy: str = "fair"):
    free = budget - sum(m.gib for m in models)
    return decide(demands, [m.resident(clock) for m in models], free_gib=free, min_resident_s=min_resident_s,
                  policy=policy)


def standard(seq: int, counter: float = 0.0) -> tuple[float, float, int]:
    return (1.0, counter, seq)


def test_a_demand_that_fits_starts_without_unloading():
    clock = Clock()
    chat = Model("chat", 4.0, ready_at=clock() - 100, last_used=clock())
    plan = plan_at(clock, [Demand("coder", 4.0, standard(1))], [chat], budget=10.0)
    assert (plan.start, plan.evict, plan.reason) == ("coder", (), "fits")


def test_an_idle_model_is_unloaded_at_once_even_within_its_residency():
    clock = Clock()
    chat = Model("chat", 8.0, ready_at=clock() - 5, last_used=clock() - 2 * IDLE_GRACE_S)
    plan = plan_at(clock, [Demand("coder", 6.0, standard(1))], [chat], budget=10.0)
    assert (plan.start, plan.evict, plan.reason) == ("coder", ("chat",), "idle")


def test_a_model_that_just_finished_a_request_is_kept_for_the_idle_grace_then_unloaded():
    clock = Clock()
    chat = Model("chat", 8.0, ready_at=clock() - 5, last_used=clock() - 0.2)
    plan = plan_at(clock, [Demand("coder", 6.0, standard(1))], [chat], budget=10.0)
    assert plan.start is None and plan.wake_in_s == pytest.approx(IDLE_GRACE_S - 0.2)
    clock.advance(plan.wake_in_s)
    assert plan_at(clock, [Demand("coder", 6.0, standard(1))], [chat], budget=10.0).evict == ("chat",)


def test_a_busy_model_keeps_its_minimum_residency_then_yields_to_a_more_urgent_demand():
    clock = Clock()
    chat = Model("chat", 8.0, ready_at=clock() - 10, last_used=clock(), in_flight=2, queued=(standard(5),))
    demand = Demand("coder", 6.0, standard(3))  # arrived before chat's queued request
    plan = plan_at(clock, [demand], [chat], budget=10.0)
    assert plan.start is None and plan.wake_in_s == pytest.approx(20.0)  # residency left
    clock.advance(20.0)
    plan = plan_at(clock, [demand], [chat], budget=10.0)
    assert (plan.start, plan.evict, plan.reason) == ("coder", ("chat",), "outranked")


def test_a_model_whose_queue_is_more_urgent_than_the_demand_stays_loaded_past_its_residency():
    clock = Clock()
    interactive = (0.0, 0.0, 9)
    chat = Model("chat", 8.0, ready_at=clock() - 300, last_used=clock(), in_flight=1, queued=(interactive,))
    plan = plan_at(clock, [Demand("coder", 6.0, standard(2))], [chat], budget=10.0)
    assert plan.start is None and plan.wake_in_s is None  # decided again when its queue changes
    # the demand ages (its rank drops by one per aging period) and then outranks chat's queue
    aged = (-1.0, 0.0, 2)
    assert plan_at(clock, [Demand("coder", 6.0, aged)], [chat], budget=10.0).evict == ("chat",)


def test_a_less_served_tenant_outranks_a_busier_one_of_the_same_class():
    clock = Clock()
    chat = Model("chat", 8.0, ready_at=clock() - 60, last_used=clock(), in_flight=1,
                 queued=(standard(7, counter=5000.0),))
    plan = plan_at(clock, [Demand("coder", 6.0, standard(9, counter=100.0))], [chat], budget=10.0)
    assert plan.evict == ("chat",)
    plan = plan_at(clock, [Demand("coder", 6.0, standard(9, counter=9000.0))], [chat], budget=10.0)
    assert plan.start is None


def test_pinned_models_are_never_unloaded():
    clock = Clock()
    embed = Model("embed", 8.0, ready_at=clock() - 999, last_used=clock() - 999, pinned=True)
    plan = plan_at(clock, [Demand("coder", 6.0, standard(1))], [embed], budget=10.0)
    assert plan.start is None and plan.wake_in_s is None


def test_idle_models_go_first_least_recently_used_first_and_only_as_many_as_needed():
    clock = Clock()
    a = Model("a", 3.0, ready_at=clock() - 99, last_used=clock() - 50)
    b = Model("b", 3.0, ready_at=clock() - 99, last_used=clock() - 80)
    busy = Model("busy", 3.0, ready_at=clock() - 99, last_used=clock(), in_flight=1)
    plan = plan_at(clock, [Demand("x", 4.0, standard(1))], [a, b, busy], budget=10.0)  # 1 free: one must go
    assert plan.evict == ("b",) and plan.reason == "idle"
    plan = plan_at(clock, [Demand("x", 7.0, standard(1))], [a, b, busy], budget=10.0)
    assert plan.evict == ("b", "a")
    plan = plan_at(clock, [Demand("x", 9.5, standard(1))], [a, b, busy], budget=10.0)
    assert plan.evict == ("b", "a", "busy") and plan.reason == "outranked"


def test_the_most_urgent_demand_is_decided_first_and_a_blocked_one_lets_a_fitting_one_start():
    clock = Clock()
    chat = Model("chat", 6.0, ready_at=clock() - 5, last_used=clock(), in_flight=1, queued=(standard(1),))
    big = Demand("big", 8.0, standard(2))  # blocked: chat is busy and within its residency
    small = Demand("small", 3.0, standard(3))
    plan = plan_at(clock, [small, big], [chat], budget=10.0)
    assert (plan.start, plan.evict) == ("small", ())
    urgent = Demand("urgent", 3.0, (0.0, 0.0, 4))
    assert plan_at(clock, [small, urgent], [chat], budget=10.0).start == "urgent"


def test_a_burst_is_one_demand_and_one_swap_timeline():
    """Two models, room for one; bursts alternate. The fair policy swaps once per burst change,
    and a model with queued work keeps its residency; the naive one swaps on every miss."""
    clock = Clock()
    a = Model("a", 6.0, ready_at=clock() - 100, last_used=clock(), in_flight=1, queued=(standard(10),))
    # a burst of 5 requests for b arrives while a serves its own: one demand, collated
    burst = Demand("b", 6.0, standard(11), waiting=5)
    assert plan_at(clock, [burst], [a], budget=10.0).evict == ()  # a's queue is older: a keeps going
    a.queued = ()
    plan = plan_at(clock, [burst], [a], budget=10.0)
    assert plan.evict == ("a",) and plan.demand is not None and plan.demand.waiting == 5
    # b loaded; a new request for a arrives while b still has 4 queued: b keeps its residency
    b = Model("b", 6.0, ready_at=clock(), last_used=clock(), in_flight=1,
              queued=tuple(standard(12 + i) for i in range(4)))
    clock.advance(5)
    back = Demand("a", 6.0, standard(20))
    assert plan_at(clock, [back], [b], budget=10.0).start is None
    # the naive policy unloads b at once, whatever it still has to do
    naive = plan_at(clock, [back], [b], budget=10.0, policy="naive")
    assert (naive.start, naive.evict, naive.reason) == ("a", ("b",), "miss")


def test_naive_policy_serves_the_oldest_request_first_whatever_its_class():
    clock = Clock()
    a = Model("a", 6.0, ready_at=clock(), last_used=clock(), in_flight=1)
    old_batch = Demand("b", 6.0, (2.0, 0.0, 1))
    new_interactive = Demand("c", 6.0, (0.0, 0.0, 2))
    assert plan_at(clock, [new_interactive, old_batch], [a], budget=10.0, policy="naive").start == "b"
    assert plan_at(clock, [new_interactive, old_batch], [a], budget=10.0).start is None  # a within residency


def test_a_model_being_loaded_or_unloaded_is_not_a_candidate():
    r = Resident("a", 8.0, resident_s=999, idle_s=999, ready=False)
    assert decide([Demand("b", 6.0, standard(1))], [r], free_gib=2.0, min_resident_s=0).start is None


def test_no_demand_no_plan():
    assert decide([], [], free_gib=0.0, min_resident_s=0).start is None


def test_a_residency_lasts_no_longer_than_the_swap_is_worth_once_loads_are_measured():
    """Loads of 0.7 s and 0.5 s: a busy model within its 30 s residency keeps its place until the
    demand's oldest request has waited SWAP_COST_FACTOR x 1.2 s, then goes; the decision asks to be
    woken when that time comes, not at the residency's end."""
    from dataclasses import replace

    from passerelle.scheduling.swap import SWAP_COST_FACTOR

    clock = Clock()
    chat = Model("chat", 8.0, ready_at=clock() - 5, last_used=clock(), in_flight=1, queued=(standard(5),))
    worth = SWAP_COST_FACTOR * (0.7 + 0.5)

    def plan(waited: float, *, measured: bool = True):
        d = Demand("coder", 6.0, standard(1), oldest_s=waited, load_s=0.7 if measured else None)
        residents = [replace(chat.resident(clock), load_s=0.5 if measured else None)]
        return decide([d], residents, free_gib=10.0 - 8.0, min_resident_s=30.0)

    early = plan(worth - 1.0)
    assert early.start is None and early.wake_in_s == pytest.approx(1.0)
    due = plan(worth + 0.01)
    assert (due.start, due.evict, due.reason) == ("coder", ("chat",), "outranked")
    # never loaded before: no cost known, the residency decides
    unknown = plan(worth + 10.0, measured=False)
    assert unknown.start is None and unknown.wake_in_s == pytest.approx(25.0)
    # a more urgent queue on the resident still keeps it, however long the demand waited
    urgent = replace(chat.resident(clock), load_s=0.5, queued_key=(0.0, 0.0, 0))
    kept = decide([Demand("coder", 6.0, standard(1), oldest_s=60.0, load_s=0.7)], [urgent], free_gib=2.0,
                  min_resident_s=30.0)
    assert kept.start is None
