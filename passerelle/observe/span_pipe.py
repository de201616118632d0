"""The gateway's end of the trace exporter: finished spans into a pipe, and the child that reads it
(observe/otlp_export.py) kept alive.

:class:`SpanPipe` never blocks the event loop: a request's spans join a list, written every
``FLUSH_S`` (or every ``FLUSH_SPANS`` spans) as one marshal frame to a non-blocking pipe; what the
pipe cannot take waits in a buffer drained when it can. Both are capped
(``OTEL_BSP_MAX_QUEUE_SIZE`` spans waiting, ``MAX_BUFFER_BYTES`` written), spans beyond are
dropped and counted (``dropped``), never waited for.

The child is supervised. A thread per child waits for it (so a dead child is reaped at once: no
zombie), and tells the loop; the pipe then drops what the child had not read, and starts a new
child after a backoff (1 s, 2 s, 4 s … 30 s; back to 1 s after a child that lived a minute),
counted in ``restarts``. Spans finished meanwhile wait in the list (within its cap) for the new
child. Without a running loop (before the first request, in a test) the death is noticed and the
child restarted at the next flush once its backoff is over.

    alive ──exit, or a write fails──► down ──backoff (a timer on the loop, or the next flush)──► alive
      └────────────────────── shutdown (no restart: what is left is dropped) ──────────────────┘

Example::

    pipe = SpanPipe(cfg.tracing)        # starts the child
    pipe.submit(spans)                  # on the event loop, from the tracer's listener
    pipe.shutdown()                     # from any thread: the rest written, the child waited for
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import marshal
import os
import select
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from passerelle.backoff import RestartBackoff
from passerelle.observe.otlp_export import SHUTDOWN_S, env_int

if TYPE_CHECKING:
    from passerelle.config import TracingConfig

log = logging.getLogger("passerelle.tracing")

FLUSH_S = 0.1  # how long finished spans wait in the gateway before they are written to the pipe
FLUSH_SPANS = 256  # or this many, whichever comes first
MAX_BUFFER_BYTES = 8 * 1024 * 1024  # written but not yet taken by the child
PIPE_BYTES = 1024 * 1024  # the pipe's own buffer, asked of Linux (F_SETPIPE_SZ)
RESTART_MIN_S, RESTART_MAX_S = 1.0, 30.0  # the backoff before a dead child is started again


class SpanPipe:
    """The gateway's end: spans in, the child out. ``submit`` is called on the event loop (or,
    with no loop running, it writes at once); ``shutdown`` from any thread."""

    def __init__(self, cfg: TracingConfig) -> None:
        import importlib.util

        if importlib.util.find_spec("opentelemetry.proto") is None:  # the child's need, said at start
            raise ImportError("opentelemetry-proto is missing", name="opentelemetry-proto")
        from passerelle import __version__

        self.max_spans = env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.dropped = 0  # spans never sent: the buffers were full, or the child was gone
        self.restarts = 0  # children started again after one died
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.environ.get("PYTHONPATH")
        conf = {"endpoint": cfg.endpoint, "service_name": cfg.service_name, "version": __version__}
        self._argv = [sys.executable, "-m", "passerelle.observe.otlp_export", json.dumps(conf)]
        self._env = {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
        self._pending: list[Any] = []
        self._out = bytearray()
        self._frames: collections.deque[list[int]] = collections.deque()  # [bytes not yet written, spans] a frame
        self._lock = threading.Lock()  # _out, the pipe and the child, between the loop and other threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._restart: asyncio.TimerHandle | None = None  # the backoff's timer, on the loop
        self._watching = False  # the loop waits for the pipe to take _out
        self._closed = False
        self._stopping = False  # shutdown has begun: no more restarts, no more watching the pipe
        self._down = False  # the child is gone; a new one is due at _restart_at
        self._restart_at = 0.0
        self._backoff = RestartBackoff(RESTART_MIN_S, RESTART_MAX_S)  # (afresh after a child that lived a minute)
        self._spawn()

    # -- the child ---------------------------------------------------------------------------
    def _spawn(self) -> None:
        """A new child on a new pipe, and its reaper (raises OSError when it cannot be started)."""
        proc = subprocess.Popen(self._argv, stdin=subprocess.PIPE, env=self._env)
        assert proc.stdin is not None
        self.proc, self.fd = proc, proc.stdin.fileno()
        self._started_at = time.monotonic()
        with contextlib.suppress(OSError, AttributeError):
            import fcntl

            fcntl.fcntl(self.fd, 1031, PIPE_BYTES)  # F_SETPIPE_SZ: fewer trips through the writer
        os.set_blocking(self.fd, False)
        threading.Thread(target=self._reap, args=(proc,), name="passerelle-trace-reaper", daemon=True).start()

    def _reap(self, proc: subprocess.Popen[bytes]) -> None:  # its own thread: waits for the child
        proc.wait()
        loop = self._loop
        if loop is not None and not self._stopping:
            with contextlib.suppress(RuntimeError):  # (a closed loop: the next flush notices)
                loop.call_soon_threadsafe(self._exited, proc)

    def _exited(self, proc: subprocess.Popen[bytes]) -> None:  # on the loop
        with self._lock:
            if proc is self.proc and not self._down and not self._closed:
                self._gone(f"exited with status {proc.returncode}")

    def _gone(self, why: str) -> None:  # under _lock, on the loop or with none running
        """The child is gone: what it had not read is dropped, a new one due after the backoff."""
        self._down = True
        if self._watching and self._loop is not None:
            self._loop.remove_writer(self.fd)
            self._watching = False
        self._unsent()
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        if self.proc.returncode is None:  # (its pipe broke but it lives on: it would never read again)
            with contextlib.suppress(OSError):
                self.proc.kill()
        now = time.monotonic()
        delay = self._backoff.next(now - self._started_at)
        self._restart_at = now + delay
        if self._stopping:
            log.warning("traces: the exporter process %s while the gateway stopped", why)
            return
        log.warning("traces: the exporter process %s; starting a new one in %g s", why, delay)
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None  # the next flush starts it
        if loop is not None and self._restart is None:
            self._restart = loop.call_later(delay, self._restart_due)

    def _restart_due(self) -> None:  # on the loop
        self._restart = None
        with self._lock:
            # Race: the loop's clock may lag time.monotonic() (uvloop reads it once an iteration), so
            # the timer can fire a little before _restart_at; _revive would then do nothing and, with
            # no span to flush, nothing would ever start the child: the timer is set again instead.
            early = self._restart_at - time.monotonic()
            if self._down and early > 0 and not self._stopping and not self._closed:
                self._restart = asyncio.get_running_loop().call_later(early + 0.001, self._restart_due)
                return
            self._revive()
        self.flush()

    def _revive(self) -> None:  # under _lock
        """A new child in place of the dead one, once its backoff is over."""
        if not self._down or self._closed or self._stopping or time.monotonic() < self._restart_at:
            return
        try:
            self._spawn()
        except OSError as exc:  # (no process could be made: later, with a longer backoff)
            self._started_at = time.monotonic()
            self._gone(f"could not be started again ({exc})")
            return
        self._down = False
        self.restarts += 1
        log.info("traces: a new exporter process (pid %d) was started", self.proc.pid)

    # -- spans in ----------------------------------------------------------------------------
    def submit(self, spans: list[Any]) -> None:
        if self._closed or len(self._pending) + len(spans) > self.max_spans:
            self._drop(len(spans))
            return
        self._pending += spans
        if len(self._pending) >= FLUSH_SPANS:
            self.flush()
        elif self._timer is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = self._loop.call_later(FLUSH_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.flush()

    def _drop(self, n: int) -> None:
        if not n:
            return
        if not self.dropped:
            log.warning("traces: %d spans dropped (the exporter is behind or gone); counting", n)
        self.dropped += n

    def flush(self) -> None:
        """The waiting spans written to the pipe, as much as it takes now (while the child is
        down they wait for the next, within ``max_spans``)."""
        with self._lock:
            if not self._pending or self._closed:
                return
            if not self._down and self.proc.returncode is not None:  # (reaped, and no loop told us)
                self._gone(f"exited with status {self.proc.returncode}")
            if self._down:
                self._revive()
                if self._down:
                    if self._stopping:
                        self._drop(len(self._pending))
                        self._pending = []
                    return
            batch, self._pending = self._pending, []
            data = marshal.dumps(batch)
            if len(self._out) + len(data) + 4 > MAX_BUFFER_BYTES:
                self._drop(len(batch))
                return
            self._out += len(data).to_bytes(4, "big") + data
            self._frames.append([len(data) + 4, len(batch)])
            self._write()

    def _write(self) -> None:  # under _lock
        try:
            n = os.write(self.fd, self._out)
        except BlockingIOError:
            n = 0
        except OSError as exc:  # the child is gone: what it did not take is lost
            self._gone(f"is gone ({exc})")
            return
        self._written(n)
        if self._out and not self._watching and self._loop is not None and not self._stopping:
            self._loop.add_writer(self.fd, self._writable)
            self._watching = True
        elif not self._out and self._watching and self._loop is not None:
            self._loop.remove_writer(self.fd)
            self._watching = False

    def _written(self, n: int) -> None:
        del self._out[:n]
        while n and self._frames:
            took = min(n, self._frames[0][0])
            self._frames[0][0] -= took
            n -= took
            if not self._frames[0][0]:
                self._frames.popleft()

    def _unsent(self) -> None:
        self._drop(sum(n for _, n in self._frames))
        self._frames.clear()
        self._out.clear()

    def _writable(self) -> None:
        with self._lock:
            if not self._closed and not self._down:
                self._write()

    # -- shutdown ----------------------------------------------------------------------------
    def _detach(self) -> None:  # on the loop: no more timers, no more writer
        for timer in (self._timer, self._restart):
            if timer is not None:
                timer.cancel()
        self._timer = self._restart = None
        if self._watching and self._loop is not None:
            self._loop.remove_writer(self.fd)
            self._watching = False

    def shutdown(self) -> None:
        """Every waiting span written (within ``SHUTDOWN_S``), the pipe closed, the child waited for
        while it sends them; killed if it overstays."""
        deadline = time.monotonic() + SHUTDOWN_S
        self._stopping = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop or not loop.is_running():
                self._detach()
            else:
                done: concurrent.futures.Future[None] = concurrent.futures.Future()

                def detach() -> None:
                    self._detach()
                    done.set_result(None)

                loop.call_soon_threadsafe(detach)
                with contextlib.suppress(concurrent.futures.TimeoutError):
                    done.result(timeout=2.0)
        self.flush()
        with self._lock:
            self._closed = True
            while self._out and not self._down and time.monotonic() < deadline:
                select.select([], [self.fd], [], max(0.0, deadline - time.monotonic()))
                try:
                    self._written(os.write(self.fd, self._out))
                except BlockingIOError:
                    continue
                except OSError:
                    break
            self._unsent()  # (what the deadline or a gone child left)
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.dropped:
            log.warning("traces: %d spans dropped in all", self.dropped)
