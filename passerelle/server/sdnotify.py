"""systemd's notify protocol, spoken directly: readiness, status, reload, stop and watchdog pings,
each a datagram to ``$NOTIFY_SOCKET`` (no library; the protocol is a line ``KEY=VALUE`` per field).

``Type=notify`` units learn from ``READY=1`` that the gateway serves (its listener is open and a
backend can answer, as ``/ready`` says), not merely that the process exists; ``WatchdogSec=`` units
are restarted when ``WATCHDOG=1`` stops arriving. The pings come from a task of the event loop
itself, so a loop that stalls (a blocking call, a busy loop) stops them and systemd restarts the
gateway; a thread would keep pinging for a hung loop.

Example::

    notifier = Notifier.from_env()          # None outside systemd: every call site checks
    if notifier is not None:
        notifier.send("READY=1", "STATUS=serving")
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, MutableMapping

log = logging.getLogger("passerelle.server.sdnotify")

# systemd refuses a watchdog interval this small; below it a ping loop would only burn CPU.
MIN_WATCHDOG_S = 0.01


def _address(value: str) -> str | bytes | None:
    """``$NOTIFY_SOCKET`` → an AF_UNIX address: a path, or ``@name`` for the abstract namespace
    (a leading NUL byte on the wire)."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # (vsock addresses, for virtual machines, are not served)


def watchdog_interval(environ: MutableMapping[str, str]) -> float | None:
    """Seconds between pings (half of ``$WATCHDOG_USEC``, as sd_watchdog_enabled advises), or None
    when systemd asks for no watchdog, or asks it of another process (``$WATCHDOG_PID``)."""
    usec, pid = environ.get("WATCHDOG_USEC"), environ.get("WATCHDOG_PID")
    if not usec:
        return None
    if pid and pid.strip() != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not a number: no watchdog pings", usec)
        return None
    return max(MIN_WATCHDOG_S, value / 2e6) if value > 0 else None


class Notifier:
    """Datagrams to one notify socket. Sending never blocks nor raises: a service manager that
    went away is logged once, and the gateway goes on serving."""

    def __init__(self, address: str | bytes, *, watchdog_s: float | None = None) -> None:
        self.address = address
        self.watchdog_s = watchdog_s
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setblocking(False)
        self._failed = False
        self._pinger: asyncio.Task[None] | None = None
        self.ready_sent = False

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None) -> Notifier | None:
        """The notifier systemd asked for, or None. The variables are taken out of the
        environment (sd_notify's ``unset_environment``): the runtimes the gateway launches must not
        speak for it (the unit also says ``NotifyAccess=main``)."""
        env = os.environ if environ is None else environ
        raw = env.pop("NOTIFY_SOCKET", "")
        watchdog = watchdog_interval(env)
        env.pop("WATCHDOG_USEC", None)
        env.pop("WATCHDOG_PID", None)
        if not raw:
            return None
        address = _address(raw)
        if address is None:
            log.warning("NOTIFY_SOCKET=%r is not a unix socket address: systemd will not be notified", raw)
            return None
        return cls(address, watchdog_s=watchdog)

    def send(self, *fields: str) -> bool:
        """Send ``fields`` (``"READY=1"``, ``"STATUS=…"``) as one datagram; False if it failed."""
        data = "\n".join(fields).encode()
        try:
            self._sock.sendto(data, self.address)
        except OSError as exc:
            if not self._failed:
                log.warning("cannot notify systemd at %r: %s", self.address, exc)
                self._failed = True
            return False
        return True

    def ready(self, status: str) -> None:
        self.ready_sent = True
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def reloading(self) -> None:
        # MONOTONIC_USEC lets Type=notify-reload tell this reload from an earlier one
        self.send("RELOADING=1", "STATUS=reloading the configuration",
                  f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def reloaded(self, status: str) -> None:
        # READY=1 ends the reload; before the first one the service is still starting, and stays so
        self.send(*(("READY=1",) if self.ready_sent else ()), f"STATUS={status}")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=stopping: finishing the requests in flight")

    def start_watchdog(self, healthy: Callable[[], bool] = lambda: True) -> None:
        """Ping every ``watchdog_s`` from the running loop, while ``healthy()`` says so."""
        if self.watchdog_s is not None and self._pinger is None:
            self._pinger = asyncio.get_running_loop().create_task(self._ping(healthy), name="passerelle-watchdog")

    async def _ping(self, healthy: Callable[[], bool]) -> None:
        assert self.watchdog_s is not None
        while True:
            if healthy():
                self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_s)

    async def wait_ready(self, is_ready: Callable[[], bool], status: Callable[[], str],
                         poll_s: float = 0.1) -> None:
        """Send READY=1 once ``is_ready()`` (a backend can serve); until then STATUS says why not.
        No deadline here: the unit's ``TimeoutStartSec=`` is the one that counts."""
        said = ""
        while not is_ready():
            text = status()
            if text != said:
                self.status(text)
                said = text
            await asyncio.sleep(poll_s)
        self.ready(status())

    def close(self) -> None:
        if self._pinger is not None:
            self._pinger.cancel()
            self._pinger = None
        self._sock.close()
