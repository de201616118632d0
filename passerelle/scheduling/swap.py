"""Which model to load, and which to unload for it: the swap decision, as a pure function.

When requests wait for a model whose runtime is stopped and the memory budget does not hold it,
something loaded must go. The choice follows the scheduler's own order, so a swap is decided by
the same priority classes, aging and fair share as a slot:

* demands (stopped runtimes with requests waiting for them) are taken best key first, the key
  being the scheduler's ``(rank after aging, tenant's served tokens, arrival)`` of their most
  urgent request, so one burst for a model is one demand (collated) and is served by one swap;
* a loaded runtime may be unloaded for a demand when it is **idle** (nothing running, nothing
  queued, for ``IDLE_GRACE_S``), or when it has been resident ``min_resident_s`` **and** the
  demand is more urgent than anything queued for it. So a model with work is never swapped out
  before its minimum residency, and a busy model keeps its place against less urgent work;
* the minimum residency is never longer than the swap is worth: once the demand's oldest request
  has waited ``SWAP_COST_FACTOR`` times what the swap costs (the demand's load time plus the
  resident's, loaded again later), measured loads known, the resident may go before it. Waiting
  for a residency of 30 s to spare a load of 0.7 s costs the waiting requests more than it saves
  (the ski-rental rule: pay rent until it adds up to the price of buying);
* pinned runtimes (``persistent``, or started at boot) are never unloaded;
* idle runtimes go first (least recently used first), then those whose queued work ranks lowest.

A runtime being unloaded finishes its running requests first (the swapper drains it, bounded by
``drain_timeout_s``); :func:`decide` only says what to do, :mod:`~passerelle.scheduling.swapper`
does it.

The ``naive`` policy is the "evict on every miss" of simpler model swappers (llama-swap's
default), kept to measure against: the oldest waiting request's model is loaded, and anything
unpinned is unloaded for it, at once.

Example::

    plan = decide([Demand("coder", 9.0, (1, 0.0, 7), 3, 2.5)],
                  [Resident("chat", 10.0, 0, None, 0, 40.0, 12.0)],
                  free_gib=2.0, min_resident_s=30)
    plan.start, plan.evict, plan.reason      # ('coder', ('chat',), 'idle')
"""

from __future__ import annotations

from dataclasses import dataclass

Key = tuple[float, float, int]

SWAP_COST_FACTOR = 2.0  # a demand waits at most this many swap costs for a resident's residency
IDLE_GRACE_S = 1.0  # a model whose last request ended this recently is not idle yet: its client
# is probably about to send the next one (closed-loop clients resend within milliseconds)


@dataclass(frozen=True)
class Demand:
    """A stopped runtime that requests are waiting for."""

    runtime: str
    need_gib: float
    key: Key  # the scheduler's key of its most urgent waiting request
    waiting: int = 1
    oldest_s: float = 0.0  # how long its oldest request has waited
    load_s: float | None = None  # how long its runtime took to load last time (None: not known)


@dataclass(frozen=True)
class Resident:
    """A runtime that holds memory now."""

    runtime: str
    need_gib: float
    in_flight: int = 0
    queued_key: Key | None = None  # the most urgent request queued for it; None: nothing queued
    queued: int = 0
    resident_s: float = 0.0  # since it became ready
    idle_s: float = 0.0  # since its last request started or ended
    pinned: bool = False  # persistent, or started at boot: never unloaded
    ready: bool = True  # False while starting or already being unloaded: not a candidate
    load_s: float | None = None  # how long it took to load (None: not known)

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.queued == 0 and self.idle_s >= IDLE_GRACE_S


@dataclass(frozen=True)
class Plan:
    """What to do now: start ``start`` after unloading ``evict`` (maybe nothing), or nothing
    and decide again in ``wake_in_s`` seconds (None: on the next event)."""

    start: str | None = None
    evict: tuple[str, ...] = ()
    reason: str = ""  # fits, idle, outranked (fair); miss (naive)
    wake_in_s: float | None = None
    demand: Demand | None = None


def decide(demands: list[Demand], residents: list[Resident], *, free_gib: float, min_resident_s: float,
           policy: str = "fair") -> Plan:
    """The next step for ``demands`` given what is loaded; ``free_gib`` is the budget left."""
    if not demands:
        return Plan()
    if policy == "naive":
        return _naive(demands, residents, free_gib)
    wake: float | None = None
    for d in sorted(demands, key=lambda d: d.key):
        if d.need_gib <= free_gib + 1e-9:
            return Plan(start=d.runtime, reason="fits", demand=d)
        victims, reason, wait = _victims(d, residents, free_gib, min_resident_s)
        if victims:
            return Plan(start=d.runtime, evict=victims, reason=reason, demand=d)
        if wait is not None:
            wake = wait if wake is None else min(wake, wait)
    return Plan(wake_in_s=wake)


def _victims(d: Demand, residents: list[Resident], free_gib: float,
             min_resident_s: float) -> tuple[tuple[str, ...], str, float | None]:
    """Runtimes to unload so that ``d`` fits, and why; or none, and when that may change."""
    idle, outranked = [], []
    wait: float | None = None
    for r in residents:
        if r.pinned or not r.ready:
            continue
        if r.idle:
            idle.append(r)
            continue
        if r.in_flight == 0 and r.queued == 0:  # idle, but only just: its client may come back
            left = IDLE_GRACE_S - r.idle_s
        elif r.resident_s < min_resident_s and d.oldest_s < _worth_s(d, r):
            left = min(min_resident_s - r.resident_s, _worth_s(d, r) - d.oldest_s)
        elif r.queued_key is None or d.key < r.queued_key:
            outranked.append(r)
            continue
        else:
            continue  # its queue is more urgent than the demand: asked again when that changes
        wait = left if wait is None else min(wait, left)
    # idle first, least recently used first; then the least urgent queue, the longest resident
    idle.sort(key=lambda r: -r.idle_s)
    outranked.sort(key=lambda r: (r.queued_key is not None, _neg(r.queued_key), -r.resident_s))
    chosen: list[Resident] = []
    freed = free_gib
    for r in (*idle, *outranked):
        if freed + 1e-9 >= d.need_gib:
            break
        chosen.append(r)
        freed += r.need_gib
    if freed + 1e-9 < d.need_gib:
        return (), "", wait
    reason = "idle" if all(r in idle for r in chosen) else "outranked"
    return tuple(r.runtime for r in chosen), reason, None


def _worth_s(d: Demand, r: Resident) -> float:
    """How long ``d`` may wait for ``r``'s residency: ``SWAP_COST_FACTOR`` swap costs, or for ever
    (the residency decides) while a load time is not known."""
    if d.load_s is None or r.load_s is None:
        return float("inf")
    return SWAP_COST_FACTOR * (d.load_s + r.load_s)


def _neg(key: Key | None) -> tuple[float, ...]:
    """Sort the least urgent queue (the largest key) first."""
    return tuple(-x for x in key) if key is not None else ()


def _naive(demands: list[Demand], residents: list[Resident], free_gib: float) -> Plan:
    d = min(demands, key=lambda d: d.key[2])  # the oldest request, whatever its class
    if d.need_gib <= free_gib + 1e-9:
        return Plan(start=d.runtime, reason="fits", demand=d)
    chosen, freed = [], free_gib
    for r in sorted((r for r in residents if r.ready and not r.pinned), key=lambda r: -r.idle_s):
        if freed + 1e-9 >= d.need_gib:
            break
        chosen.append(r.runtime)
        freed += r.need_gib
    if freed + 1e-9 < d.need_gib:
        return Plan()
    return Plan(start=d.runtime, evict=tuple(chosen), reason="miss", demand=d)
