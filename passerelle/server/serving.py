"""The main listener: uvicorn configured with the client limits (connections.py), a file
descriptor budget that fits them, and a shutdown that ends open requests cleanly (shutdown.py).

Example::

    server = gateway_server(app, cfg)
    server.run(sockets=[sock])
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import resource
from typing import Any, Protocol

import uvicorn

from passerelle.config import Config
from passerelle.runtimes.limiter import DEFAULT_INITIAL
from passerelle.server.connections import ConnectionLimits, guarded_protocol
from passerelle.server.sdnotify import Notifier

log = logging.getLogger("passerelle.server.serving")

# Descriptors the gateway needs besides client connections: the listeners, the key store, logs,
# health checks and the event loop's own; plus one per runtime slot (its upstream connection).
RESERVED_FDS = 64


class _Stoppable(Protocol):
    notifier: Notifier | None

    def begin_shutdown(self) -> None: ...

    def is_ready(self) -> bool: ...

    def service_status(self) -> str: ...


def fd_budget(max_connections: int, upstream_slots: int) -> int:
    """The client connections this process can hold, raising its soft descriptor limit toward the
    hard one when ``max_connections`` needs it; a limit below what is asked lowers the answer
    (and says so), so that a flood meets 503 and reclaim, never a failing ``accept()``."""
    need = max_connections + upstream_slots + RESERVED_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections
    fit = max(16, soft - upstream_slots - RESERVED_FDS)
    log.warning("server.max_connections = %d needs %d file descriptors, the limit is %d: serving at most "
                "%d client connections (raise it with ulimit -n or LimitNOFILE=)", max_connections, need, soft, fit)
    return fit


def return_freed_memory(threshold: int = 128 * 1024) -> bool:
    """Have glibc serve allocations of ``threshold`` bytes and more with their own mappings, given
    back to the system when freed. By default glibc raises that threshold after the first large
    frees, and the request bodies of many clients at once (say 20 of 4 MiB, read in chunks of a
    few hundred KiB) are then carved from the heap and stay in the process after they are freed:
    +70 MiB of RSS for good, where this gives it back (bench/hostile_clients.py, slowloris body).
    Small objects, the hot path's, are not affected. False where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


class GatewayServer(uvicorn.Server):
    """uvicorn's server; its shutdown first tells the app, whose requests still running at the end
    of the grace period are ended with an error (uvicorn's own deadline comes 2 s later)."""

    def __init__(self, config: uvicorn.Config, app: _Stoppable) -> None:
        super().__init__(config)
        self.passerelle_app = app
        self._ready: asyncio.Task[None] | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        notifier = self.passerelle_app.notifier
        if notifier is not None and self.started:
            # the listener is open: READY=1 once a backend can serve (sdnotify.py)
            notifier.start_watchdog()
            self._ready = asyncio.get_running_loop().create_task(
                notifier.wait_ready(self.passerelle_app.is_ready, self.passerelle_app.service_status),
                name="passerelle-sd-ready")

    async def shutdown(self, sockets: Any = None) -> None:
        notifier = self.passerelle_app.notifier
        if notifier is not None:
            if self._ready is not None:
                self._ready.cancel()
            notifier.stopping()
        self.passerelle_app.begin_shutdown()
        await super().shutdown(sockets=sockets)
        if notifier is not None:
            notifier.close()


def gateway_server(app: Any, cfg: Config) -> GatewayServer:
    s = cfg.server
    return_freed_memory()
    # a backend without max_concurrency gets its size from the runtime once it runs: count the
    # learned limit's start, more than most runtimes report
    slots = sum(b.max_concurrency or DEFAULT_INITIAL for b in cfg.backends)
    limits = ConnectionLimits.of(s, max_connections=fd_budget(s.max_connections, slots))
    config = uvicorn.Config(
        app, host=s.host, port=s.port, loop="uvloop", http=guarded_protocol(limits), lifespan="on",
        access_log=False, log_level="warning", timeout_graceful_shutdown=math.ceil(s.shutdown_grace_s) + 2,
        timeout_keep_alive=s.keep_alive_s,  # type: ignore[arg-type]  # a float works: it goes to call_later
        proxy_headers=False)  # (uvicorn would trust X-Forwarded-For from loopback: server/forwarded.py decides)
    return GatewayServer(config, app)
