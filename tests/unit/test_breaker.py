"""The circuit breaker (runtimes/breaker.py) and the retry budget (proxy/retry.py), with an injected
clock: every transition, and the ones that must never happen."""

from __future__ import annotations

import pytest

from passerelle.proxy.retry import MAX_RETRIES, RetryBudget, may_retry
from passerelle.runtimes.breaker import _ALLOWED, BreakerState, CircuitBreaker, Outcome

S = BreakerState


def opened(now: float = 0.0) -> CircuitBreaker:
    b = CircuitBreaker()
    for _ in range(3):
        b.record(Outcome.FAILURE, probe=False, now=now)
    return b


def test_closed_until_three_failures_in_a_row_and_a_success_resets_the_count():
    b = CircuitBreaker()
    b.record(Outcome.FAILURE, probe=False, now=0)
    b.record(Outcome.FAILURE, probe=False, now=0)
    b.record(Outcome.SUCCESS, probe=False, now=0)
    b.record(Outcome.FAILURE, probe=False, now=0)
    assert b.state is S.CLOSED and b.failures == 1 and b.allows(0)
    b.record(Outcome.NEUTRAL, probe=False, now=0)  # says nothing about the runtime
    assert b.failures == 1


def test_open_then_half_open_with_exactly_one_probe_then_closed_on_success():
    b = opened()
    assert b.state is S.OPEN and not b.allows(4.9) and b.retry_at == 5.0
    assert b.allows(5.0) and b.state is S.HALF_OPEN
    assert b.dispatched(5.0) is True
    assert not b.allows(5.1) and b.dispatched(5.1) is False  # one probe at a time
    b.record(Outcome.SUCCESS, probe=True, now=6)
    assert b.state is S.CLOSED and b.failures == 0 and b.allows(6)


def test_a_failed_probe_opens_it_again_for_longer():
    b = opened()
    assert b.dispatched(5.0)
    b.record(Outcome.FAILURE, probe=True, now=5.0)
    assert b.state is S.OPEN and b.open_until == 5.0 + 10.0
    assert b.dispatched(15.0)
    b.record(Outcome.FAILURE, probe=True, now=15.0)
    assert b.open_until == 15.0 + 20.0
    for _ in range(10):
        b.record(Outcome.FAILURE, probe=False, now=100.0)
    assert b.open_until == 160.0  # at most 60 s


@pytest.mark.parametrize("how", ["client disconnect", "timeout of the client", "4xx", "disallowed retry"])
def test_a_probe_without_a_verdict_lets_the_next_request_probe(how):
    # The regression: the replica stayed `probing` forever and was never routed to again.
    b = opened()
    assert b.dispatched(5.0)
    b.record(Outcome.NEUTRAL, probe=True, now=5.5)
    assert b.state is S.HALF_OPEN and b.allows(5.6) and b.dispatched(5.6)


def test_requests_sent_before_it_opened_do_not_decide_for_the_probe():
    b = opened()
    assert b.dispatched(5.0)
    b.record(Outcome.FAILURE, probe=False, now=5.2)  # an older request, failing late
    assert b.state is S.HALF_OPEN and b.probe_out
    b.record(Outcome.SUCCESS, probe=False, now=5.3)  # an older one succeeding: the runtime answers
    assert b.state is S.CLOSED


def test_transitions_are_validated():
    assert _ALLOWED[S.CLOSED] == {S.OPEN}
    b = CircuitBreaker()
    with pytest.raises(RuntimeError, match="illegal transition CLOSED -> HALF_OPEN"):
        b._to(S.HALF_OPEN)


def test_retry_budget_refills_per_request_and_is_capped():
    budget = RetryBudget(ratio=0.5, cap=2.0)
    assert budget.withdraw() and budget.withdraw() and not budget.withdraw()
    assert budget.refused == 1
    budget.deposit()
    assert not budget.withdraw()
    budget.deposit()
    assert budget.withdraw()
    for _ in range(100):
        budget.deposit()
    assert budget.balance == 2.0
    with pytest.raises(ValueError):
        RetryBudget(cap=0.5)


def test_may_retry_only_before_the_first_byte_and_takes_from_the_budget_last():
    budget = RetryBudget(cap=1.0)
    ok = dict(retryable=True, started=False, retries=0, others_left=True, time_left_s=10.0, budget=budget)
    for change in ({"retryable": False}, {"started": True}, {"retries": MAX_RETRIES}, {"others_left": False},
                   {"time_left_s": 0.1}):
        assert not may_retry(**{**ok, **change})
    assert budget.balance == 1.0  # none of those took anything
    assert may_retry(**ok) and not may_retry(**ok)


def test_trip_opens_at_once_and_reset_closes_whole():
    b = CircuitBreaker()
    b.trip(10.0, b.max_backoff_s)  # a split's member died: no failures to wait for
    assert b.state is BreakerState.OPEN and not b.allows(11.0) and b.retry_at == 10.0 + b.max_backoff_s
    assert b.allows(10.0 + b.max_backoff_s)  # (half-open after the longest backoff, if nothing resets it)
    assert b.dispatched(10.0 + b.max_backoff_s)  # the probe is out...
    b.trip(80.0, b.max_backoff_s)  # ...and it is known broken again: open, the probe slot freed
    assert b.state is BreakerState.OPEN and not b.probe_out
    b.reset()  # rebuilt whole
    assert b.state is BreakerState.CLOSED and b.failures == 0 and b.allows(81.0)
