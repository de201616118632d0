"""An in-flight limit learned from a runtime that does not say how many requests it runs at once.

The limit starts high and is lowered only when the runtime itself starts queueing; it is raised
again, one request at a time, while passerelle keeps it full and the queueing has stopped
(additive increase). Two signals, the first one a runtime offers wins:

* its **waiting gauge** (vLLM's ``num_requests_waiting``, llama.cpp's ``requests_deferred``,
  SGLang's ``num_queue_reqs``), polled: while it is above zero the runtime runs ``in flight -
  waiting`` of our requests, and that is the limit;
* **time to first token** against the number in flight, for runtimes with no gauge (any
  OpenAI-compatible server, Ollama). A request that had to wait for a free sequence in the
  runtime shows a first token well past the runtime's unloaded time for a prompt of its size.
  Samples are judged in windows; a window where at least a tenth are that slow lowers the limit
  to the most that were in flight while requests still started at once (the knee), or by a
  quarter when none did. The unloaded time is the least seen per prompt-size bucket (half
  octaves: prefill time is affine in the prompt's length), allowed to drift up 1 % a window
  while nothing queues, so that a runtime that became slower for good is not taken for a
  queueing one.

This is the additive-increase / multiplicative-decrease family of TCP and of Netflix's
concurrency-limits, with the runtime's own queue as the congestion signal. A runtime at
capacity that queues a few requests costs those requests a little latency; a limit below
capacity costs throughput all the time, so the limit errs high: it settles at capacity plus the
few requests whose wait stays under the tolerance.

Example::

    limit = AdaptiveLimit()             # 256 until the runtime shows otherwise
    limit.observe_ttft(0.05, in_flight=40, prompt_tokens=30)
    limit.observe_gauge(waiting=3, in_flight=51, peak=51)   # -> limit.value == 48
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_INITIAL = 256  # vLLM's default max_num_seqs: most runtimes run no more at once
DEFAULT_MAXIMUM = 1024


@dataclass
class _Window:
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (ttft, in flight, bucket)


class AdaptiveLimit:
    """The learned limit: ``value`` requests in flight at most."""

    def __init__(self, *, initial: int = DEFAULT_INITIAL, minimum: int = 1, maximum: int = DEFAULT_MAXIMUM,
                 tolerance: float = 1.5, slack_s: float = 0.01, window: int = 32) -> None:
        self.minimum = minimum
        self.maximum = max(minimum, maximum)
        self.limit = float(min(max(initial, minimum), self.maximum))
        self.tolerance = tolerance  # a first token later than tolerance x unloaded + slack waited
        self.slack_s = slack_s
        self.window = window  # samples per judgement
        self.signal = ""  # what last moved the limit: "gauge" or "ttft"; "" while untouched
        self.has_gauge = False
        self.decreases = 0
        self._base: dict[int, float] = {}  # prompt-size bucket -> least time to first token seen
        self._current = _Window()
        self._knee = 0  # most in flight with every request starting at once, last window

    @property
    def value(self) -> int:
        return max(self.minimum, min(self.maximum, int(self.limit)))

    def reset(self, *, initial: int, maximum: int | None = None) -> None:
        """Start again from ``initial`` (a runtime that reported a new size)."""
        if maximum is not None:
            self.maximum = max(self.minimum, maximum)
        self.limit = float(min(max(initial, self.minimum), self.maximum))
        self.signal, self._knee, self._current = "", 0, _Window()

    # -- the runtime's own queue ---------------------------------------------------------------
    def observe_gauge(self, waiting: int, in_flight: int, peak: int) -> None:
        """One poll of the runtime's waiting gauge, with passerelle's requests in flight on it now
        and the most there were since the last poll."""
        self.has_gauge = True
        if waiting > 0 and in_flight > waiting:
            running = in_flight - waiting  # what the runtime runs of ours; the rest it queues
            if running < self.limit:
                self.limit = float(max(self.minimum, running))
                self.signal = "gauge"
                self.decreases += 1
        elif waiting == 0 and peak >= self.value:
            self._raise("gauge", max(1.0, 0.1 * self.limit))  # each poll is seconds apart

    # -- time to first token ---------------------------------------------------------------------
    def observe_ttft(self, ttft_s: float, in_flight: int, prompt_tokens: int) -> None:
        """One request's time from dispatch to first token, sent with ``in_flight`` requests on
        the runtime (itself included). Ignored once the runtime has shown a waiting gauge."""
        if self.has_gauge or ttft_s < 0:
            return
        bucket = int(2 * math.log2(max(prompt_tokens, 1)))  # half-octaves: prefill time is affine
        self._current.samples.append((ttft_s, in_flight, bucket))
        if len(self._current.samples) >= self.window:
            self._judge(self._current.samples)
            self._current = _Window()

    def _judge(self, samples: list[tuple[float, int, int]]) -> None:
        least: dict[int, float] = {}
        for t, _, b in samples:
            least[b] = min(t, least.get(b, t))
        base = {b: min(t, self._base.get(b, t)) for b, t in least.items()}
        slow = [k for t, k, b in samples if t > self.tolerance * base[b] + self.slack_s]
        knee = max((k for t, k, b in samples if t <= self.tolerance * base[b] + self.slack_s), default=0)
        peak = max(k for _, k, _ in samples)
        queueing = len(slow) >= 2 and len(slow) >= 0.1 * len(samples)
        # Requests sent with more in flight than the limit allows now were sent before it was
        # lowered: their wait is already answered.
        if queueing and sum(1 for k in slow if k <= self.value) >= 2:
            # Back to the most that were in flight while requests still started at once (this
            # window's or the last one's), at least one less than now, never below half of it
            # in one step (a burst of long prompts must not collapse the limit).
            known = max(knee, self._knee)
            target = min(known, self.limit - 1) if known else self.limit * 0.75
            self.limit = max(float(self.minimum), target, self.limit * 0.5)
            self.signal = "ttft"
            self.decreases += 1
        elif not queueing and peak >= self.value - 1:
            self._raise("ttft", 1.0)  # kept full and nothing waited: try one more
        # The unloaded time may drift up (a runtime that became slower for good), but not
        # while it queues, or a queue kept long enough would pass for the unloaded time.
        for b, t in base.items():
            self._base[b] = t if queueing or b not in self._base else min(self._base[b] * 1.01, least[b])
        self._knee = knee

    def _raise(self, signal: str, step: float) -> None:
        if self.limit < self.maximum:
            self.limit = min(float(self.maximum), self.limit + step)
            self.signal = self.signal or signal
