"""The stores' writer threads, supervised: one whose loop raises is logged, counted and restarted.

Each store has a thread (or, for SQLite's usage writer, an asyncio task) that carries what the
request path left behind to the database: the usage copier, the quota adjustments, the key
poller, the active-passive lock. A bug or an unforeseen error in one of them used to end it for
good, silently: usage piled up on disk and ``/health`` still said all was well. A
:class:`Worker` runs the loop again after a backoff (0.5 s doubling to 30 s, back to 0.5 s after
a minute without failing), and :meth:`Worker.describe` says how often it had to, for ``/health``
and ``passerelle_store_worker_restarts_total``.

Example::

    worker = Worker("usage", loop, stop_event); worker.start()
    worker.describe()   # {"alive": True, "restarts": 0}
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from passerelle.backoff import CALM_S, RestartBackoff

log = logging.getLogger("passerelle.tenants.workers")

BACKOFF_S = (0.5, 30.0)  # first and longest wait before a failed loop runs again


class Worker:
    """``loop()`` in a daemon thread, run again whenever it raises, until ``stop`` is set."""

    def __init__(self, name: str, loop: Callable[[], None], stop: threading.Event) -> None:
        self.name, self.loop, self.stop = name, loop, stop
        self.restarts = 0
        self.last_error = ""
        self.failed_at: float | None = None  # time.monotonic() of the last failure
        self._thread: threading.Thread | None = None
        self._backoff = RestartBackoff(*BACKOFF_S)  # (afresh after a loop that ran CALM_S)

    def failed(self, exc: BaseException, started: float) -> float:
        """Count a failure of the loop; the seconds to wait before running it again."""
        self.restarts += 1
        self.failed_at = time.monotonic()
        self.last_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        wait = self._backoff.next(time.monotonic() - started)
        log.error("store worker %s failed (%s); restarted in %g s (%d restarts so far)", self.name,
                  self.last_error, wait, self.restarts, exc_info=exc)
        return wait

    def _supervise(self) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self.loop()
                return  # (it returns once stopped)
            except Exception as exc:
                if self.stop.wait(self.failed(exc, started)):
                    return

    def start(self) -> None:
        self._thread = threading.Thread(target=self._supervise, name=f"passerelle-{self.name}", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failing(self) -> bool:
        """It failed within the last :data:`CALM_S` (what it carries may not be getting through)."""
        return self.failed_at is not None and time.monotonic() - self.failed_at < CALM_S

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"alive": self.alive, "restarts": self.restarts}
        if self.last_error:
            out["last_error"] = self.last_error
        return out


class TaskWorker(Worker):
    """The same for an asyncio task: ``aloop()`` awaited again whenever it raises, until cancelled."""

    def __init__(self, name: str, aloop: Callable[[], Awaitable[None]]) -> None:
        super().__init__(name, lambda: None, threading.Event())
        self.aloop = aloop
        self.task: asyncio.Task[None] | None = None

    async def _asupervise(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.aloop()
                return
            except Exception as exc:
                await asyncio.sleep(self.failed(exc, started))

    def start(self) -> None:
        self.task = asyncio.create_task(self._asupervise(), name=f"passerelle-{self.name}")

    @property
    def alive(self) -> bool:
        return self.task is not None and not self.task.done()
