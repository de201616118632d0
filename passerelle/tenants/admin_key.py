"""The one check of the admin key (``[admin] key``), for every route that accepts it.

Those routes are the admin routes (``Authorization: Bearer`` or the dashboard's login cookie on
``/admin/*``, ``/ui``, ``/metrics``: server/admin.py), the login form (``/admin/login``:
server/login.py) and the Batch API, where the admin key sees every tenant's files and batches
(batches/api.py). Each asks :meth:`AdminKeyCheck.verify`, which

1. throttles first (tenants/attempts.py: 10 failed attempts a minute per address, 60 in all):
   while throttled the attempt is refused with 429 and ``Retry-After``, and the key is not
   compared at all, so a guesser learns nothing from a refusal, not even "wrong";
2. compares in constant time (``hmac.compare_digest``), the key or the cookie (an HMAC of the
   key, never the key itself: :func:`session_token`);
3. logs a wrong attempt (address and route, never what was presented) and counts it in
   ``passerelle_admin_key_failures_total{route, reason}``, as it counts the throttle's refusals.
   The login cookie of the key before the last change is refused but neither throttled nor logged
   (reason ``former_key``): a dashboard left open polls with it every second, and would otherwise
   lock its own admin out of the login with the new key.

The admin key is taken only from the networks of ``[admin] allow`` (:meth:`allowed`): from any
other address the Batch API treats it as the unknown API key it is there.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from passerelle.config import AdminConfig
from passerelle.errors import RateLimited, clip
from passerelle.tenants.attempts import AttemptThrottle
from passerelle.tenants.keys import PREFIX

log = logging.getLogger("passerelle.admin")

Scope = dict[str, Any]
PER_ADDRESS_PER_MINUTE = 10  # failed admin key attempts from one address (IPv6: one /64)
GLOBAL_PER_MINUTE = 60  # from all addresses together


class _Counter(Protocol):  # (a prometheus_client Counter with labels route, reason)
    def labels(self, route: str, reason: str) -> Any: ...


def session_token(key: str) -> bytes:
    """The login cookie's value for the admin key ``key``: derived from it, never the key itself
    (another key, another value: changing the key logs every browser out)."""
    return hmac.new(key.encode(), b"passerelle admin session v1", hashlib.sha256).hexdigest().encode()


def client_ip(scope: Scope) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The client's address (after server/forwarded.py), None when it is not one."""
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


class AdminKeyCheck:
    """``[admin] key`` and ``allow`` (:meth:`configure` on a reload), and the throttle of failed
    attempts, which a reload keeps."""

    def __init__(self, cfg: AdminConfig, *, failures: _Counter | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.throttle = AttemptThrottle(per_address_per_minute=PER_ADDRESS_PER_MINUTE,
                                        global_per_minute=GLOBAL_PER_MINUTE, clock=clock or time.monotonic)
        self.failures = failures
        self.key, self.token = b"", b""
        self.former = b""  # the login cookie of the key before the last change (see verify)
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self.configure(cfg)

    def configure(self, cfg: AdminConfig) -> None:
        """A new key: the old one, and the login cookies made from it, stop working at once."""
        token = session_token(cfg.key) if cfg.key else b""
        if token != self.token:
            self.former = self.token
        self.key, self.token = cfg.key.encode(), token
        self.networks = [ipaddress.ip_network(n, strict=False) for n in cfg.allow]

    @property
    def enabled(self) -> bool:
        return bool(self.key)

    def allowed(self, scope: Scope) -> bool:
        """Is the client in ``[admin] allow``?"""
        ip = client_ip(scope)
        return ip is not None and any(ip.version == n.version and ip in n for n in self.networks)

    def candidate(self, scope: Scope, presented: str) -> bool:
        """Is ``presented`` (a route's key, e.g. the Batch API's Bearer) an attempt at the admin key?
        Only from ``[admin] allow``, and never an API key of ours (``psk_…``, which the admin key
        cannot be: config.py refuses it)."""
        return bool(self.key and presented) and not presented.startswith(f"{PREFIX}_") and self.allowed(scope)

    def verify(self, scope: Scope, route: str, *, key: bytes | None = None, cookie: bytes | None = None) -> bool:
        """Is ``key`` the admin key, or ``cookie`` the login cookie? Raises RateLimited, without
        comparing anything, while the client's address or the gateway is throttled. ``route``
        (login, admin, batches) names the attempt in the log and the metric."""
        if not self.key:
            return False
        client = scope["client"][0] if scope.get("client") else "local"
        try:
            self.throttle.check(client)
        except RateLimited:
            self._count(route, "throttled")
            raise
        # each one presented is compared, the first being right or not: no short cut to time
        ok_key = key is not None and hmac.compare_digest(key, self.key)
        ok_cookie = cookie is not None and hmac.compare_digest(cookie, self.token)
        if ok_key or ok_cookie:
            return True
        if key is None and cookie is not None and self.former and hmac.compare_digest(cookie, self.former):
            # The cookie this gateway gave for the key before the change, from a dashboard left open
            # (it polls every second): no guess, so not counted, or it would lock its own admin out.
            self._count(route, "former_key")
            return False
        self.throttle.failed(client)
        self._count(route, "wrong_key")
        log.warning("a wrong admin key from %s on %s %s (route %s, %s)", clip(client), clip(scope.get("method", "")),
                    clip(scope.get("path", "")), route, "login cookie" if key is None else "key")
        return False

    def _count(self, route: str, reason: str) -> None:
        if self.failures is not None:
            self.failures.labels(route, reason).inc()

    def snapshot(self) -> dict[str, Any]:
        """For /admin/stats (``admin_key_throttle``)."""
        return self.throttle.snapshot()
