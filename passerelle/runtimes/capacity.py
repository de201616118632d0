"""How many requests a backend is sent at once, and where that number came from.

The scheduler never sends a backend more than its capacity and keeps the rest in its own queue,
where classes and fair share decide the order. The number must be the runtime's, not a constant:
too low and passerelle throttles a runtime that could serve more, without a word; too high and
the runtime queues first-come-first-served, out of passerelle's sight. In order:

* **declared**: ``max_concurrency`` in the configuration, an explicit override;
* **reported**: what the runtime says about itself (llama-server's ``/props`` ``total_slots``,
  SGLang's ``max_running_requests``, vLLM's ``max_num_seqs`` where it shows its configuration).
  A runtime that then queues with fewer running (vLLM short of KV cache) is followed down by its
  waiting gauge, and the source reads ``learned``;
* **learned**: an adaptive limit (limiter.py) that starts high and comes down only when the
  runtime starts queueing.

Example::

    cap = Capacity(declared=0)
    cap.report(4, "/props total_slots")
    cap.value, cap.source, cap.describe()     # 4, "reported", "4 (reported: /props total_slots)"
"""

from __future__ import annotations

from passerelle.runtimes.limiter import AdaptiveLimit


class Capacity:
    def __init__(self, declared: int = 0) -> None:
        self.declared = declared  # 0: not given
        self.reported = 0
        self.reported_by = ""
        self.limiter = AdaptiveLimit()

    @property
    def value(self) -> int:
        return self.declared or self.limiter.value

    @property
    def source(self) -> str:
        """``declared``, ``reported`` or ``learned``."""
        if self.declared:
            return "declared"
        if self.reported and self.limiter.value >= self.reported:
            return "reported"
        return "learned"

    def report(self, slots: int | None, how: str) -> None:
        """The runtime said it runs ``slots`` requests at once (None or 0: it did not say)."""
        if not slots or slots <= 0 or slots == self.reported:
            return
        self.reported, self.reported_by = slots, how
        self.limiter.reset(initial=slots, maximum=slots)

    def describe(self) -> str:
        """The value and its origin in words, for the start-up line and ``runtime list``."""
        src = self.source
        if src == "declared":
            return f"{self.value} (declared: max_concurrency)"
        if src == "reported":
            return f"{self.value} (reported: {self.reported_by})"
        lim = self.limiter
        if lim.signal == "gauge":
            why = "from the runtime's waiting gauge"
        elif lim.signal == "ttft":
            why = "from time to first token"
        else:
            why = "not lowered yet; lowered when the runtime queues"
        below = f"; reported {self.reported}" if self.reported else ""
        return f"{self.value} (learned: {why}{below})"

    def as_dict(self) -> dict[str, object]:
        return {"capacity": self.value, "capacity_source": self.source, "capacity_detail": self.describe(),
                "capacity_reported": self.reported or None}
