"""The wait before something that died is started again: the tracing exporter's child
(observe/span_pipe.py) and the stores' writer threads (tenants/workers.py).

The first wait is short, each death in a row doubles it up to the longest, and one that had lived
``calm_s`` died on its own, not in a loop: the waits start afresh. A thing that cannot run is then
tried a few times a minute, never in a tight loop, and one that dies once a day is back at once.

Example::

    backoff = RestartBackoff(1.0, 30.0)
    backoff.next(lived_s=0.2)    # 1.0, then 2.0, 4.0 … 30.0
    backoff.next(lived_s=600.0)  # 1.0: it had run for ten minutes
"""

from __future__ import annotations

CALM_S = 60.0  # a thing that ran this long before it died starts the waits afresh


class RestartBackoff:
    def __init__(self, first_s: float, longest_s: float, calm_s: float = CALM_S) -> None:
        self.first_s, self.longest_s, self.calm_s = first_s, longest_s, calm_s
        self._next = first_s

    def next(self, lived_s: float) -> float:
        """The seconds to wait before the next start, for a death after ``lived_s`` seconds alive."""
        if lived_s >= self.calm_s:
            self._next = self.first_s
        wait, self._next = self._next, min(self._next * 2, self.longest_s)
        return wait
