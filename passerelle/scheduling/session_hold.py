"""How long a session's slot is held for its next turn: learned from that session's own gaps.

A coding agent's session alternates turns and tool calls: the model answers, the agent runs a
tool (seconds to minutes), and the next turn sends the whole conversation again plus the tool's
result. While the tool runs, the slot that holds the conversation's KV is idle; given to another
session it would be overwritten and the next turn's prompt computed again (minutes for a long
context on a small box). So the slot is *held* for the session after each turn, for a time learned
from the gaps (turn end to next request) the session itself showed: the ``hold_percentile`` of its
last gaps, with some slack, at most ``hold_max_s``; ``hold_default_s`` until two gaps are known.
A session that does not come back in time loses its hold (its KV may still be saved, session_kv.py).

The hold is weak: a request of another session that finds only held slots free has the session's
KV saved while it waits, and takes the slot once saved, or once it has waited its class's
``session_wait_s`` (scheduler.py), so holding never starves anyone for longer than their class allows.

Only sessions (a request naming one, tenant-scoped) are remembered, at most ``max_sessions``, the
least recently seen forgotten first.

Example::

    gaps = SessionGaps(cfg.sessions)
    gaps.arrived(key, now)            # a turn came: the gap since the last one ended is learned
    ttl = gaps.left(key, now)         # the turn ended: hold its slot this long
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

from passerelle.config import SessionsConfig

KEPT_GAPS = 16  # a session's last gaps the percentile is taken over
SLACK = 1.25  # a hold a little longer than the gap it is learned from: the next gap varies


class SessionGaps:
    def __init__(self, cfg: SessionsConfig) -> None:
        self._ended: OrderedDict[str, float] = OrderedDict()  # session -> when its last turn ended
        self._gaps: OrderedDict[str, deque[float]] = OrderedDict()  # session -> its last gaps
        self.configure(cfg)

    def configure(self, cfg: SessionsConfig) -> None:
        self.percentile = cfg.hold_percentile
        self.max_s = cfg.hold_max_s
        self.default_s = cfg.hold_default_s
        self.max_sessions = cfg.max_sessions
        for book in (self._ended, self._gaps):
            while len(book) > self.max_sessions:
                book.popitem(last=False)

    def arrived(self, key: str, now: float) -> None:
        """A request of session ``key`` came at ``now``: learn the gap since its last turn ended."""
        ended = self._ended.pop(key, None)
        if ended is None:
            return
        gaps = self._gaps.get(key)
        if gaps is None:
            gaps = self._gaps[key] = deque(maxlen=KEPT_GAPS)
            if len(self._gaps) > self.max_sessions:
                self._gaps.popitem(last=False)
        else:
            self._gaps.move_to_end(key)
        gaps.append(max(0.0, now - ended))

    def left(self, key: str, now: float) -> float:
        """A turn of session ``key`` ended at ``now``: how long to hold its slot (0: not at all)."""
        self._ended[key] = now
        self._ended.move_to_end(key)
        if len(self._ended) > self.max_sessions:
            self._ended.popitem(last=False)
        return self.ttl(key)

    def ttl(self, key: str) -> float:
        """The hold learned for ``key``: a high percentile of its gaps, with slack, capped."""
        gaps = self._gaps.get(key)
        if gaps is None or len(gaps) < 2:
            return min(self.default_s, self.max_s)
        ordered = sorted(gaps)
        rank = max(0, math.ceil(self.percentile / 100 * len(ordered)) - 1)
        return min(self.max_s, ordered[rank] * SLACK)

    def median(self, key: str) -> float | None:
        """The median of ``key``'s last gaps (None: none known)."""
        gaps = self._gaps.get(key)
        return sorted(gaps)[len(gaps) // 2] if gaps else None

    def gaps(self, key: str) -> list[float]:
        return list(self._gaps.get(key, ()))
