"""Who may reach the admin routes, and the optional admin listener on a port of its own.

Admin routes are ``/admin/*``, ``/ui`` and ``/metrics``: they show every tenant's traffic and
the runtimes' state, so by default only loopback clients get them (others get a 403 in OpenAI's
error shape). ``[admin]`` in the configuration changes that:

* ``allow = ["10.0.0.0/8"]``: the client networks served (replaces the loopback default);
* ``key = "…"``: the admin routes also need ``Authorization: Bearer …`` (401 without it);
* ``port = 9090``: a second HTTP server in the same process and event loop serves the admin
  routes (and nothing else) on ``host:port``, and the main port no longer serves them (404).

The client address is the connection's peer, or the address a reverse proxy listed in
``[server] trusted_proxies`` gives in its forwarded headers (server/forwarded.py; none is trusted
by default, loopback included), so a proxy in front does not make every client look local.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn

from passerelle.config import AdminConfig
from passerelle.errors import Forbidden, GatewayError, Unauthorized
from passerelle.server.connections import ConnectionLimits, guarded_protocol

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


def _client_ip(scope: Scope) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    client = scope.get("client")
    if not client:  # a Unix socket: only local processes can connect
        return ipaddress.ip_address("127.0.0.1")
    try:
        ip = ipaddress.ip_address(client[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class AdminGuard:
    """Decides whether one request may see an admin route."""

    def __init__(self, cfg: AdminConfig) -> None:
        self.networks = [ipaddress.ip_network(n, strict=False) for n in cfg.allow]
        self.key = cfg.key.encode()

    def check(self, scope: Scope) -> GatewayError | None:
        """None when allowed, else the error to answer with."""
        ip = _client_ip(scope)
        if ip is None or not any(ip.version == n.version and ip in n for n in self.networks):
            return Forbidden(f"The admin routes are not served to {ip or 'this client'}; "
                             "see [admin] allow in the configuration.")
        if self.key:
            given = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    given = value
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                return Unauthorized("The admin routes need 'Authorization: Bearer <admin key>' ([admin] key).")
        return None


class _AdminServer(uvicorn.Server):
    # The main server owns SIGTERM/SIGINT and stops this one from the app's shutdown; uvicorn's
    # own handlers here would replace the main server's.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class AdminListener:
    """A second uvicorn server, in this process and event loop, serving ``app`` on ``host:port``."""

    def __init__(self, app: ASGIApp, host: str, port: int, limits: ConnectionLimits | None = None) -> None:
        self.app, self.host, self.port = app, host, port
        # the client limits of the main port; at most 64 connections (a dashboard, a scraper, an operator)
        self.limits = limits or ConnectionLimits(max_connections=64)
        self._server: _AdminServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind (an OSError, e.g. address in use, is raised here) and serve."""
        family, kind, proto, _, addr = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"admin port {self.host}:{self.port}: {exc.strerror}") from None
        self.port = sock.getsockname()[1]
        limits = self.limits
        config = uvicorn.Config(self.app, interface="asgi3", http=guarded_protocol(limits), lifespan="off",
                                access_log=False, log_config=None, log_level="warning", timeout_graceful_shutdown=2,
                                timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
                                proxy_headers=False)  # (server/forwarded.py decides, in the app)
        self._server = _AdminServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="passerelle-admin-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the admin server stopped during start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._server = self._task = None
