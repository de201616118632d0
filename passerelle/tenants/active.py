"""Active-passive: of the gateways pointed at one PostgreSQL with ``[store] active_passive``, the one
holding a session-level advisory lock serves; the others stand by.

The lock is taken with ``pg_try_advisory_lock`` on a connection of its own (TCP keepalives on, so a
dead peer is noticed by the server and by the client). A standby tries it every ``lock_poll_s``;
the active runs ``SELECT 1`` on that connection as often. When that fails, the active reconnects and
tries the lock again at each look: it stands by as soon as another gateway holds the lock, and keeps
serving while the database cannot be reached at all (no standby can take the lock then either), for
at most ``offline_s``, the time the keys last read are trusted.
When the active dies (``kill -9``, a box that stops), PostgreSQL ends its session and frees the
lock, and the next try of a standby gets it: takeover is about one ``lock_poll_s`` after the
database notices (at once for a process that dies; a box that vanishes is noticed by the keepalives).

A standby answers ``/health`` with 503 ``{"status": "standby"}`` (so keepalived or a load balancer
sends traffic to the active) and inference with 503 ``standby`` and a ``Retry-After``.

Example::

    lock = ActiveLock(url, on_change=lambda active: log.info("active=%s", active)); lock.start()
    lock.active      # False until this gateway holds the lock
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from passerelle.tenants.pgconn import connect, deadline, first_line, redacted
from passerelle.tenants.workers import Worker

log = logging.getLogger("passerelle.tenants.active")

LOCK_ID = 0x70617373_61637476  # the advisory lock's key ("passactv"); one pair of gateways per database


class ActiveLock:
    def __init__(self, url: str, *, poll_s: float = 0.5, timeout_s: float = 5.0, offline_s: float = 300.0,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.url, self.poll_s, self.timeout_s, self.on_change = url, poll_s, timeout_s, on_change
        self.offline_s = offline_s
        self.active = False
        self.unconfirmed_since: float | None = None  # active, but the database out of reach since then
        self.since = time.monotonic()  # when ``active`` last changed
        self.reason = "starting"  # why this gateway stands by (for /health and the log)
        self._conn: Any = None
        self._stop = threading.Event()
        self.worker = Worker("active-lock", self._run, self._stop)

    def _set(self, active: bool, reason: str = "") -> None:
        self.reason = reason
        if active != self.active:
            self.active, self.since = active, time.monotonic()
            if self.on_change is not None:
                self.on_change(active)

    def step(self) -> None:
        """One look: take the lock (standby) or check that it is still held (active)."""
        try:
            if self._conn is None:
                self._conn = connect(self.url, self.timeout_s)  # (TCP keepalives on: tenants/pgconn.py)
            confirming = self.active and self.unconfirmed_since is None
            with deadline(self._conn, self.timeout_s):
                if confirming:
                    self._conn.execute("SELECT 1")
                    return
                held = self._conn.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_ID,)).fetchone()[0]
            if held:
                if not self.active or self.unconfirmed_since is not None:
                    log.warning("active: this gateway holds the lock in %s and serves", redacted(self.url))
                self.unconfirmed_since = None
                self._set(True)
            else:
                if self.active:
                    log.error("active lock: another gateway holds it now; standing by")
                self.unconfirmed_since = None
                self._set(False, "another gateway holds the lock")
        except Exception as exc:
            self._drop()
            if self.active:
                now = time.monotonic()
                if self.unconfirmed_since is None:
                    self.unconfirmed_since = now
                    log.error("active lock: database unreachable (%s); serving on for at most %g s ([store] "
                              "offline_s) unless another gateway takes the lock", first_line(exc), self.offline_s)
                elif now - self.unconfirmed_since > self.offline_s:
                    log.error("active lock: database unreachable for %g s; standing by", self.offline_s)
                    self.unconfirmed_since = None
                    self._set(False, "database unreachable")
                return
            if self.reason != "database unreachable":
                log.error("active lock: database %s unreachable (%s); standing by", redacted(self.url),
                          first_line(exc))
            self._set(False, "database unreachable")

    def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):  # a broken connection: closing it says nothing more
                self._conn.close()
        self._conn = None

    def _run(self) -> None:
        while True:
            self.step()
            if self._stop.wait(self.poll_s):
                return

    def start(self) -> None:
        self.step()  # the first answer before serving: a standby never serves by mistake
        self.worker.start()

    def close(self) -> None:
        """Stop and give the lock up (closing the session frees it for the standby at once)."""
        self._stop.set()
        self.worker.join(self.timeout_s + self.poll_s + 1)
        self._drop()
        self._set(False, "stopped")

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"active": self.active, "for_s": round(time.monotonic() - self.since, 1)}
        if not self.active:
            out["reason"] = self.reason
        elif self.unconfirmed_since is not None:
            out["lock_unconfirmed_s"] = round(time.monotonic() - self.unconfirmed_since, 1)
        return out
