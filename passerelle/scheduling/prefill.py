"""What a request's prompt costs to compute: its uncached tokens over the runtime's measured rate.

A cache miss is paid in prefill: the prompt tokens the runtime does not hold in a slot's KV (or
cannot restore) are computed before the first token, at the runtime's prompt-processing rate. On a
small box that is seconds for a cold opening prompt, while a session's next turn, whose prefix is
cached, computes only the tool result it adds. The scheduler uses this cost (scheduler.py):

* **admission**: among a tenant's waiting requests of the same (effective) class, the one with the
  smaller expected prefill goes first; one that has waited ``[scheduler] prefill_defer_s`` is no
  longer passed over by a later one (FIFO again), so an expensive request is passed over for that
  long at most, and never starves. Which tenant goes next (fair share) and which
  class (priorities, aging) are decided before the cost and are unchanged;
* **placement**: a turn waits for its busier home replica (where its prefix is cached) while the
  places ahead of it there drain sooner than its cached part would be computed elsewhere; among
  the replicas a request may start on now, equally loaded, the one where its prompt is cached (or
  whose rate is higher) costs less.

**Rate** (tokens/s), per runtime, from the runtime's own timings: llama-server's cumulative
``llamacpp:prompt_tokens_total`` and ``llamacpp:prompt_seconds_total`` (its ``/metrics``, scraped
with its load every poll; the sums of every request's ``timings.prompt_n`` and ``prompt_ms``: only
tokens computed, not those taken from its cache). When a request ends there, the latest scrape's
totals are compared with those of the last measurement: at least :data:`MIN_TOKENS` more prompt
tokens make one more measurement of a moving average. Before a runtime reported any,
:data:`PRIOR_TOKENS_PER_S`.

**Cached tokens**, what passerelle knows without asking the runtime: a conversation or session
(its affinity key) whose last turn ran on a replica still holding its KV (a slot that served it
last, a held slot, or saved KV to restore) has that turn's prompt cached there; only what the new
prompt adds is computed. A request with no such knowledge counts its whole prompt. Prompts are
counted with the gateway's cheap estimate from the body (``Job.est_prompt_tokens``), old and new
alike, so the difference is in one unit.

Memory is bounded: one rate per runtime (at most :data:`MAX_RUNTIMES`), one prompt size per
conversation (at most ``max_keys``, the least recently seen forgotten first).

Example::

    book = PrefillBook(max_keys=10000)
    book.observe(backend.name, backend.stats)   # a request ended there: a new measurement?
    book.turn_ended(job.affinity, job.est_prompt_tokens)
    tokens = book.uncached(job.affinity, job.est_prompt_tokens, cached_here=True)
    seconds = tokens / book.rate(backend.name)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from passerelle.observe.prefill_metrics import PrefillSnapshot
from passerelle.runtimes.base import BackendStats

PRIOR_TOKENS_PER_S = 200.0  # before a runtime reported any timings: a small model on a few CPU cores
WEIGHT = 0.3  # of a new measurement in the moving average: follows a change within a few scrapes
MIN_TOKENS = 16  # prompt work between two scrapes below this is too little to time (one short turn)
MAX_RUNTIMES = 1024  # rates remembered (runtimes a reload removed are forgotten, least recent first)


@dataclass
class _Rate:
    tokens: float  # the runtime's cumulative counts at the last measurement
    seconds: float
    per_s: float = 0.0  # 0: nothing measured yet
    measurements: int = 0


class PrefillBook:
    """Per runtime its prefill rate; per conversation the prompt its last turn left cached."""

    def __init__(self, max_keys: int = 10000) -> None:
        self._rates: OrderedDict[str, _Rate] = OrderedDict()
        self._prompts: OrderedDict[str, int] = OrderedDict()  # affinity key -> its last prompt (estimate)
        self.max_keys = max_keys
        self.deferred = 0  # requests that started before an earlier one of their tenant and class, cheaper
        self.aged = 0  # requests that were passed over until they waited prefill_defer_s

    def configure(self, max_keys: int) -> None:
        self.max_keys = max(1, max_keys)
        while len(self._prompts) > self.max_keys:
            self._prompts.popitem(last=False)

    # -- rates -----------------------------------------------------------------------------
    def observe(self, name: str, stats: BackendStats) -> None:
        """Take a measurement from runtime ``name``'s scraped totals, if they moved enough."""
        tokens, seconds = stats.prompt_tokens_total, stats.prompt_seconds_total
        if tokens is None or seconds is None:
            return
        r = self._rates.get(name)
        if r is None or tokens < r.tokens or seconds < r.seconds:  # first seen, or the runtime restarted
            self._rates[name] = _Rate(tokens, seconds, r.per_s if r is not None else 0.0,
                                      r.measurements if r is not None else 0)
            self._rates.move_to_end(name)
            while len(self._rates) > MAX_RUNTIMES:
                self._rates.popitem(last=False)
            return
        self._rates.move_to_end(name)
        dt, dn = seconds - r.seconds, tokens - r.tokens
        if dn < MIN_TOKENS or dt <= 0:
            return
        rate = dn / dt
        r.per_s = rate if r.measurements == 0 else (1 - WEIGHT) * r.per_s + WEIGHT * rate
        r.measurements += 1
        r.tokens, r.seconds = tokens, seconds

    def rate(self, name: str) -> float:
        """Runtime ``name``'s prefill rate, tokens/s (the prior until it reported one)."""
        r = self._rates.get(name)
        return r.per_s if r is not None and r.measurements else PRIOR_TOKENS_PER_S

    def rates(self) -> dict[str, float]:
        """The measured rates (runtimes that reported timings), for the metrics."""
        return {n: r.per_s for n, r in self._rates.items() if r.measurements}

    def snapshot(self) -> PrefillSnapshot:
        """The rates and counts, for the metrics (observe/prefill_metrics.py)."""
        return PrefillSnapshot(rates=self.rates(), deferred=self.deferred, aged=self.aged)

    # -- cached prompts --------------------------------------------------------------------
    def turn_ended(self, key: str, prompt_tokens: int) -> None:
        """A turn of conversation ``key`` ended: its prompt (estimate) is in its KV now."""
        if not key:
            return
        self._prompts[key] = prompt_tokens
        self._prompts.move_to_end(key)
        while len(self._prompts) > self.max_keys:
            self._prompts.popitem(last=False)

    def uncached(self, key: str, prompt_tokens: int, *, cached_here: bool) -> int:
        """Tokens of a ``prompt_tokens`` prompt of conversation ``key`` to compute on a replica
        that holds its KV (``cached_here``) or not: what it adds to its last turn, or all of it."""
        last = self._prompts.get(key) if cached_here and key else None
        if last is None or last > prompt_tokens:  # (a prompt shorter than the last: not an extension)
            return prompt_tokens
        return prompt_tokens - last
