"""Requests in flight per session: a coding agent's session (Claude Code, Codex), a front-end's chat.

A session is named by the client (proxy/intake.py ``session_of``: a header or a body field) and kept
hashed. One session may run at most ``[routing] max_session_in_flight`` requests at once; past it a
request gets 429 ``session_limit`` with ``Retry-After``, so a runaway agent loop fills neither the
queue nor the slots of everyone else. The count is per (tenant, session): a session id is the
client's own string, and one tenant naming another's session limits only itself.

Only sessions with a request in flight are kept, so memory is bounded by the requests in flight.

Example::

    gate = SessionGate(cfg.routing)          # gate.configure(cfg.routing) at a reload
    held = gate.enter("team-a", "3f9c…")     # raises SessionLimit
    try: ...
    finally: gate.leave(held)
"""

from __future__ import annotations

from passerelle.config import RoutingConfig
from passerelle.errors import SessionLimit


class SessionGate:
    def __init__(self, routing: RoutingConfig) -> None:
        self._running: dict[tuple[str, str], int] = {}
        self.refused = 0
        self.configure(routing)

    def configure(self, routing: RoutingConfig) -> None:
        """``max_session_in_flight``; a lower cap refuses new requests of a session already past it,
        and lets those in flight finish."""
        self.max_in_flight = routing.max_session_in_flight  # 0: no cap

    def enter(self, tenant: str, session: str) -> tuple[str, str] | None:
        """Count a request of ``session`` (hashed); what to give :meth:`leave`, None when not counted."""
        if not session or not self.max_in_flight:
            return None
        held = (tenant, session)
        n = self._running.get(held, 0)
        if n >= self.max_in_flight:
            self.refused += 1
            raise SessionLimit(f"This session already has {n} requests in flight, its limit; retry when one "
                               "has finished.", retry_after=1.0)
        self._running[held] = n + 1
        return held

    def leave(self, held: tuple[str, str] | None) -> None:
        if held is None:
            return
        n = self._running.get(held, 0) - 1
        if n > 0:
            self._running[held] = n
        else:
            self._running.pop(held, None)

    def in_flight(self, tenant: str, session: str) -> int:
        return self._running.get((tenant, session), 0)

    def __len__(self) -> int:
        return len(self._running)
