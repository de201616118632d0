"""One request's deadlines, on the event loop's clock: every wait on a runtime is bounded by one.

    arrival ─────────────────────────── total_s ──────────────────────────────────────► total_at
      │ queue (class's max wait, at most what total leaves)
      └► dispatch (each attempt) ── first_token_s ──► first_at    (connect, the response head, the
                                                                   first content chunk of a stream)
                                 first content ── between_tokens_s ──► next content ... (relay.py)

* A stream, or an answer the gateway assembles from one (llama-server), must show its response
  head and its first content chunk before ``first_at``: a runtime that accepts the request and
  never answers, or sends ``100 Continue`` forever, ends as ``upstream_timeout`` (first token).
* A non-streamed answer from a runtime that sends its head with the finished answer (vLLM, any
  OpenAI-compatible server) is bounded by ``total_at`` alone, head and body.
* Nothing outlives ``total_at``.

Example::

    deadline = Deadline(TimeoutConfig(first_token_s=3, total_s=6), rec.t_arrival)
    deadline.start_attempt()
    async with asyncio.timeout_at(deadline.head_at(streamed=True)):
        resp = await backend.post(...)
"""

from __future__ import annotations

import asyncio
import time

from passerelle.config import TimeoutConfig
from passerelle.errors import UpstreamTimeout


class Deadline:
    """``total_at`` from the arrival; ``first_at`` from the start of the current attempt."""

    __slots__ = ("first_at", "loop", "timeouts", "total_at")

    def __init__(self, timeouts: TimeoutConfig, t_arrival: float) -> None:
        """``t_arrival``: ``time.perf_counter()`` when the request arrived (the record's clock)."""
        self.timeouts = timeouts
        self.loop = asyncio.get_running_loop()
        self.total_at = self.loop.time() + (t_arrival + timeouts.total_s - time.perf_counter())
        self.first_at = self.total_at

    def start_attempt(self) -> None:
        """A request is about to be sent to a replica: its first-token clock starts now."""
        self.first_at = min(self.total_at, self.loop.time() + self.timeouts.first_token_s)

    def head_at(self, *, streamed: bool) -> float:
        """By when the response head must have arrived (see the module's notes)."""
        return self.first_at if streamed else self.total_at

    @property
    def left_s(self) -> float:
        """Seconds until ``total_at`` (negative once it passed)."""
        return self.total_at - self.loop.time()

    def expired(self, at: float, *, detail: str = "") -> UpstreamTimeout:
        """The error for a wait bounded by ``at`` that ran out: total when ``at`` is the total
        deadline, else first token."""
        t = self.timeouts
        if at >= self.total_at - 0.001:
            return UpstreamTimeout("total", t.total_s, detail=detail)
        return UpstreamTimeout("first token", t.first_token_s, detail=detail)
