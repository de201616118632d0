"""The life of one other box, as the team's gateway sees it: an explicit state machine.

    UNKNOWN ──read whole──► UP ──a reading missed (timeout, 5xx, garbage)──► SUSPECT
       │                    ▲ │                                               │  │
       │                    │ └──refused, reset, unreachable──► DOWN ◄──missed again
       │                    │                                   │             │
       │                    └────────── read whole ─────────────┘◄────────────┘ (read whole: UP)
       └──a reading missed──► SUSPECT;  refused, reset, unreachable──► DOWN

* UP: its replicas are in the rotation.
* SUSPECT: one reading missed; the replicas stay (a busy box may answer late once), and the next
  reading goes at once rather than after the poll interval.
* DOWN: a second reading missed, or the box refused, reset or could not be reached at all (a
  connection error says more than a timeout): its replicas leave the rotation, their breakers
  open, their streams are cut (an error event, never a hang). The cause is named in the log and
  in ``/health``.

Example::

    s = BoxStatus("b1")
    s.seen_up(now=0.0)                                   # UNKNOWN -> UP
    s.missed("timeout after 1 s", hard=False, now=1.0)   # UP -> SUSPECT
    s.missed("timeout after 1 s", hard=False, now=2.0)   # SUSPECT -> DOWN
    s.state, s.cause                                     # (DOWN, "timeout after 1 s")
    s.seen_up(now=9.0)                                   # DOWN -> UP
"""

from __future__ import annotations

import enum
import time


class BoxState(enum.Enum):
    UNKNOWN = "unknown"
    UP = "up"
    SUSPECT = "suspect"
    DOWN = "down"


_ALLOWED: dict[BoxState, frozenset[BoxState]] = {
    BoxState.UNKNOWN: frozenset({BoxState.UP, BoxState.SUSPECT, BoxState.DOWN}),
    BoxState.UP: frozenset({BoxState.SUSPECT, BoxState.DOWN}),
    BoxState.SUSPECT: frozenset({BoxState.UP, BoxState.DOWN}),
    BoxState.DOWN: frozenset({BoxState.UP}),
}


class IllegalTransition(RuntimeError):
    pass


class BoxStatus:
    """One box's state, why it is in it, and since when (wall clock, for ``/health``)."""

    __slots__ = ("cause", "changes", "name", "since", "state")

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = BoxState.UNKNOWN
        self.cause = "not read yet"
        self.since = time.time()
        self.changes = 0  # transitions so far

    def to(self, state: BoxState, cause: str = "", *, now: float | None = None) -> bool:
        """Move to ``state``; False when already there; IllegalTransition when the machine does not
        allow it (a bug of the caller, never a box's doing)."""
        if state is self.state:
            self.cause = cause or self.cause
            return False
        if state not in _ALLOWED[self.state]:
            raise IllegalTransition(f"box {self.name}: {self.state.name} -> {state.name}")
        self.state, self.cause = state, cause
        self.since = time.time() if now is None else now
        self.changes += 1
        return True

    def seen_up(self, *, now: float | None = None) -> bool:
        """A whole reading arrived: UP (True when it was not)."""
        return self.to(BoxState.UP, "", now=now)

    def missed(self, cause: str, *, hard: bool, now: float | None = None) -> bool:
        """A reading failed with ``cause``; ``hard``: refused, reset or unreachable (DOWN at once).
        True when the state changed."""
        if self.state is BoxState.DOWN:
            self.cause = cause
            return False
        if hard or self.state is BoxState.SUSPECT:
            return self.to(BoxState.DOWN, cause, now=now)
        return self.to(BoxState.SUSPECT, cause, now=now)

    @property
    def serving(self) -> bool:
        """Its replicas are in the rotation (UP, or SUSPECT until a second miss)."""
        return self.state in (BoxState.UP, BoxState.SUSPECT)

    def describe(self) -> dict[str, object]:
        return {"state": self.state.value, "cause": self.cause or None, "since": round(self.since, 3)}
