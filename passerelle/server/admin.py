"""Who may reach the admin routes, and the optional admin listener on a port of its own.

Admin routes are ``/admin/*``, ``/ui`` and ``/metrics``: they show every tenant's traffic and
the runtimes' state, so by default only loopback clients get them (others get a 403 in OpenAI's
error shape). ``[admin]`` in the configuration changes that:

* ``allow = ["10.0.0.0/8"]``: the client networks served (replaces the loopback default);
* ``key = "…"``: the admin routes also need ``Authorization: Bearer …`` or the dashboard's login
  cookie (401 without either). ``/admin/login`` is the form a browser opens ``/ui`` with: it
  sets an HttpOnly, SameSite=Strict cookie whose value is an HMAC of the key (never the key).
  Key and cookie are checked by tenants/admin_key.py, as on every route that takes the admin key:
  failed attempts are throttled per address and in all *before* anything is compared (429 with
  ``Retry-After``), then compared in constant time, and each wrong one is logged and counted;
* ``hosts = ["gpu.example.org"]``: host names the admin routes answer to besides loopback, IP
  literals and this machine's name (``"*"``: any);
* ``port = 9090``: a second HTTP server in the same process and event loop serves the admin
  routes (and nothing else) on ``host:port``, and the main port no longer serves them (404).

Whatever the client address, a browser can be made to send requests: a web page on the gateway's
host (a cross-site ``Origin``), or a name of the attacker's that resolves to 127.0.0.1 (DNS
rebinding: the ``Host`` is that name). So an admin request whose ``Host`` is not one of the
gateway's own names, or whose ``Origin`` is another site's (or ``null``), or that a browser marks
cross-site (``Sec-Fetch-Site``) on a method that changes something, gets 403.

The client address is the connection's peer, or the address a reverse proxy listed in
``[server] trusted_proxies`` gives in its forwarded headers (server/forwarded.py; none is trusted
by default, loopback included), so a proxy in front does not make every client look local.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import uvicorn

from passerelle.config import AdminConfig
from passerelle.errors import Forbidden, GatewayError, RateLimited, Unauthorized
from passerelle.server.connections import ConnectionLimits, guarded_protocol
from passerelle.tenants.admin_key import AdminKeyCheck, client_ip, session_token

__all__ = ["COOKIE", "AdminGuard", "AdminListener", "session_token"]

Scope = dict[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]
COOKIE = b"passerelle_admin"
_UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _headers(scope: Scope, *names: bytes) -> dict[bytes, bytes]:
    found: dict[bytes, bytes] = {}
    for name, value in scope["headers"]:
        if name in names:
            found[name] = value  # the last one, as the key check always read it
    return found


def _cookie(raw: bytes, name: bytes) -> bytes | None:
    for part in raw.split(b";"):
        k, sep, v = part.strip().partition(b"=")
        if sep and k == name:
            return v.strip()
    return None


def _host_name(netloc: str) -> str:
    """``host[:port]`` (``[v6]:port`` too) → the host, lower case, without a trailing dot."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1:netloc.find("]")] if "]" in netloc else ""
    return netloc.rpartition(":")[0].rstrip(".") if netloc.count(":") == 1 else netloc.rstrip(".")


class AdminGuard:
    """Decides whether one request may see an admin route; the admin key itself is checked by
    ``key_check`` (tenants/admin_key.py: throttled before it is compared), shared with the login
    form and the Batch API."""

    def __init__(self, cfg: AdminConfig, *, own_hosts: tuple[str, ...] = (),
                 key_check: AdminKeyCheck | None = None) -> None:
        self.own_hosts = own_hosts
        self.key_check = key_check if key_check is not None else AdminKeyCheck(cfg)
        self.configure(cfg)

    def configure(self, cfg: AdminConfig) -> None:
        """``[admin]`` allow, key and hosts (a reload's too): a new key stops the old one and its
        login cookies at once."""
        own_hosts = self.own_hosts
        self.key_check.configure(cfg)
        self.any_host = "*" in cfg.hosts
        self.named = {h.lower().rstrip(".") for h in cfg.hosts if h != "*"}  # the operator's names
        machine = socket.gethostname().lower()
        self.hosts = self.named | {h.lower().rstrip(".") for h in (*own_hosts, machine, machine.partition(".")[0]) if h}

    @property
    def key(self) -> bytes:
        return self.key_check.key

    @property
    def token(self) -> bytes:
        return self.key_check.token

    def own_host(self, name: str) -> bool:
        """Is ``name`` (a Host's or an Origin's host) one this gateway answers to? Loopback names and
        any IP literal are (DNS rebinding needs a name of the attacker's), and the configured ones."""
        if self.any_host or name in self.hosts or name == "localhost" or name.endswith(".localhost"):
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def check(self, scope: Scope, *, need_key: bool = True) -> GatewayError | None:
        """None when allowed, else the error to answer with. ``need_key=False``: everything but the
        admin key (the login form, which is where a browser presents it)."""
        if not self.key_check.allowed(scope):
            return Forbidden(f"The admin routes are not served to {client_ip(scope) or 'this client'}; "
                             "see [admin] allow in the configuration.")
        h = _headers(scope, b"host", b"origin", b"sec-fetch-site", b"authorization", b"cookie")
        host = h.get(b"host")
        if host is not None and not self.own_host(_host_name(host.decode("latin-1"))):
            return Forbidden("The admin routes answer only to this gateway's own host names; "
                             "see [admin] hosts in the configuration.")
        origin = h.get(b"origin")
        if origin is not None and not self._same_origin(origin.decode("latin-1"), host):
            return Forbidden("The admin routes are not served to pages of another site (Origin).")
        if scope["method"] in _UNSAFE_METHODS and h.get(b"sec-fetch-site") in (b"cross-site", b"same-site"):
            return Forbidden("The admin routes are not served to pages of another site (Sec-Fetch-Site).")
        if self.key_check.enabled and need_key:
            return self._key_error(scope, h)
        return None

    def _same_origin(self, origin: str, host: bytes | None) -> bool:
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (a sandboxed frame, a file), or no origin of the web
        if host is not None and parts.netloc.lower() == host.decode("latin-1").strip().lower():
            return True  # the page was served by this very host and port
        # a name the operator gave: the public name of a reverse proxy that rewrites the Host
        return _host_name(parts.netloc) in self.named

    def _key_error(self, scope: Scope, h: dict[bytes, bytes]) -> GatewayError | None:
        """The admin key (Bearer) or the login cookie: None when one is right; a 429 while failed
        attempts are throttled (nothing compared), else 401."""
        scheme, _, token = h.get(b"authorization", b"").partition(b" ")
        bearer = token.strip() if scheme.lower() == b"bearer" else None
        cookie = _cookie(h.get(b"cookie", b""), COOKIE)
        if bearer is not None or cookie is not None:
            try:
                if self.key_check.verify(scope, "admin", key=bearer, cookie=cookie):
                    return None
            except RateLimited as err:
                return err
        return Unauthorized("The admin routes need 'Authorization: Bearer <admin key>' ([admin] key), "
                            "or a login at /admin/login in a browser.")


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
