"""When a request may be sent again to another replica, and how many retries the gateway allows.

A retry is worth it only before the client received a byte, for a runtime that could not take the
request (unreachable, a connect timeout, a connection cut before any answer, 503 or 429), while
the request's deadline leaves room and another replica of its pool is left. Retries share one
:class:`RetryBudget` so that a failing pool never multiplies the traffic: every request deposits
a fraction of a retry, every retry withdraws a whole one (Finagle's and Envoy's retry budgets work
this way).

Example::

    budget = RetryBudget(ratio=0.2, cap=10.0)
    budget.deposit()                 # a request arrived: +0.2, at most 10 in store
    if budget.withdraw(): ...        # True while at least one retry is in store
"""

from __future__ import annotations


class RetryBudget:
    """Retries allowed now: ``ratio`` per request, up to ``cap`` (also the starting balance)."""

    __slots__ = ("balance", "cap", "ratio", "refused")

    def __init__(self, *, ratio: float = 0.2, cap: float = 10.0) -> None:
        if ratio < 0 or cap < 1:
            raise ValueError("a retry budget needs ratio >= 0 and cap >= 1")
        self.ratio = ratio
        self.cap = cap
        self.balance = cap
        self.refused = 0  # retries refused for want of budget (for /admin/stats)

    def deposit(self) -> None:
        """A request arrived (called once per request, before any attempt)."""
        self.balance = min(self.cap, self.balance + self.ratio)

    def withdraw(self) -> bool:
        """Take one retry from the budget; False (and counted) when there is none."""
        if self.balance < 1.0:
            self.refused += 1
            return False
        self.balance -= 1.0
        return True


MAX_RETRIES = 2  # per request, whatever the budget


def may_retry(*, retryable: bool, started: bool, retries: int, others_left: bool, time_left_s: float,
              budget: RetryBudget) -> bool:
    """Whether an attempt that failed with an error of this kind may be tried on another replica.

    The budget is consulted last, so a retry that is not possible anyway takes nothing from it."""
    if started or not retryable or retries >= MAX_RETRIES or time_left_s < 0.5 or not others_left:
        return False
    return budget.withdraw()
