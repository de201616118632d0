"""Passive health of one replica: a circuit breaker fed by the outcome of every request sent to it.

    CLOSED ──N failures in a row──► OPEN ──backoff passed──► HALF_OPEN ──probe succeeds──► CLOSED
       ▲                             ▲                          │
       └──── any success ────────────┼──── probe fails ─────────┘ (OPEN again, longer backoff)
                                     └──── probe ends with no verdict: HALF_OPEN, the next request probes

* CLOSED: requests flow; consecutive failures are counted.
* OPEN: no request is routed here until the backoff (5 s, doubling per further failure, at most
  60 s) has passed.
* HALF_OPEN: exactly one request (the probe) may go; its outcome decides. A probe that ends with
  no verdict on the runtime (the client left or stopped reading, the request was invalid, the
  gateway failed) frees the probe for the next request rather than leaving the replica waiting
  for an answer that will never come.

Every attempt on a replica reports exactly one :class:`Outcome`, once, from one ``finally`` in
the gateway; the scheduler marks the probe when it dispatches one (:meth:`CircuitBreaker.dispatched`).

Example::

    b = CircuitBreaker()
    for _ in range(3):
        b.record(Outcome.FAILURE, probe=False, now=0.0)
    b.state, b.allows(1.0), b.allows(5.0)         # (OPEN, False, True): half-open at 5 s
    probe = b.dispatched(5.0)                      # True: this request is the probe
    b.record(Outcome.SUCCESS, probe=probe, now=5.1)
    b.state                                        # CLOSED
"""

from __future__ import annotations

import enum


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Outcome(enum.Enum):
    SUCCESS = "success"  # the runtime answered in full
    FAILURE = "failure"  # the runtime's fault: unreachable, 5xx, broken or stalled stream, timeout, garbage
    NEUTRAL = "neutral"  # says nothing about the runtime: the client left, a 4xx, a fault of the gateway


_ALLOWED = {
    BreakerState.CLOSED: {BreakerState.OPEN},
    BreakerState.OPEN: {BreakerState.HALF_OPEN, BreakerState.CLOSED},  # CLOSED: an older request succeeded
    BreakerState.HALF_OPEN: {BreakerState.CLOSED, BreakerState.OPEN},
}


class CircuitBreaker:
    """One replica's breaker; ``failure_threshold`` consecutive failures open it."""

    __slots__ = ("failure_threshold", "failures", "max_backoff_s", "min_backoff_s", "open_until", "probe_out",
                 "state")

    def __init__(self, *, failure_threshold: int = 3, min_backoff_s: float = 5.0, max_backoff_s: float = 60.0) -> None:
        self.failure_threshold = failure_threshold
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.state = BreakerState.CLOSED
        self.failures = 0  # consecutive, the runtime's fault
        self.open_until = 0.0  # OPEN: when the next probe may go
        self.probe_out = False  # HALF_OPEN: the probe is running

    def _to(self, state: BreakerState) -> None:
        if state is self.state:
            return
        if state not in _ALLOWED[self.state]:
            raise RuntimeError(f"circuit breaker: illegal transition {self.state.name} -> {state.name}")
        self.state = state

    def allows(self, now: float) -> bool:
        """May a new request be routed here now? (An OPEN breaker whose backoff has passed turns
        HALF_OPEN here.)"""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            if now < self.open_until:
                return False
            self._to(BreakerState.HALF_OPEN)
        return not self.probe_out

    @property
    def retry_at(self) -> float | None:
        """When an OPEN breaker lets a probe through (None when it is not OPEN)."""
        return self.open_until if self.state is BreakerState.OPEN else None

    def dispatched(self, now: float) -> bool:
        """A request was routed here; True when it is the probe of a HALF_OPEN breaker."""
        if self.state is BreakerState.OPEN and now >= self.open_until:
            self._to(BreakerState.HALF_OPEN)
        if self.state is BreakerState.HALF_OPEN and not self.probe_out:
            self.probe_out = True
            return True
        return False

    def record(self, outcome: Outcome, *, probe: bool, now: float) -> None:
        """The outcome of one attempt on this replica (``probe``: what :meth:`dispatched` said)."""
        if probe:
            self.probe_out = False
        if outcome is Outcome.SUCCESS:
            self.failures = 0
            self.open_until = 0.0
            self._to(BreakerState.CLOSED)
        elif outcome is Outcome.FAILURE:
            self.failures += 1
            if self.state is BreakerState.HALF_OPEN and not probe:
                return  # a request from before the breaker opened: the probe decides
            if self.state is not BreakerState.CLOSED or self.failures >= self.failure_threshold:
                extra = max(0, self.failures - self.failure_threshold)
                self.open_until = now + min(self.max_backoff_s, self.min_backoff_s * 2 ** min(extra, 16))
                self._to(BreakerState.OPEN)

    def trip(self, now: float, hold_s: float | None = None) -> None:
        """Open now, without waiting for failures: the replica is known to be gone (its box is down,
        runtimes/boxes.py; a split whose member died, rpc.py). The first probe may go after
        ``hold_s`` (default: the shortest backoff), unless :meth:`reset` closes it before."""
        self.failures = max(self.failures, self.failure_threshold)
        self.open_until = now + (self.min_backoff_s if hold_s is None else hold_s)
        self.probe_out = False
        self._to(BreakerState.OPEN)

    def reset(self) -> None:
        """Closed again: the replica was rebuilt whole, or its box is back (what opened it is known
        to be gone)."""
        self.failures = 0
        self.open_until = 0.0
        self.probe_out = False
        self._to(BreakerState.CLOSED)

    def describe(self) -> dict[str, object]:
        return {"state": self.state.value, "failures": self.failures}
