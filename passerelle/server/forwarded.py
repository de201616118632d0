"""Who the client is when a reverse proxy stands in front of the gateway.

The client's address keys the failed-key throttle, the admin routes' allow-list, a request's
tenant-less accounting and its access-log line. A proxy (nginx, Caddy, Traefik) connects from its
own address and names the client in a header; anybody else can send the same headers. So the
headers are believed only from a peer listed in ``[server] trusted_proxies`` (addresses or
networks; default none, loopback included: a local client would otherwise pick a new address for
each request and never meet its throttle). uvicorn's own reading of ``X-Forwarded-For`` is turned
off (server/serving.py, server/admin.py): this is the one place that decides.

From a trusted peer, the first of these headers present names the client:

* ``X-Forwarded-For: client, proxy1, proxy2`` (every such header, in order);
* ``Forwarded: for=client, for="[2001:db8::1]:4711"`` (RFC 7239);
* ``X-Real-IP: client``.

A chain is read from the right, the hop nearest the gateway first: each trusted proxy hands over
to the hop before it, and the first hop that is not a trusted proxy is the client (what a client
writes on the left of its own header is never reached). A hop that is not an address (``unknown``,
an obfuscated name, garbage) ends the walk at the last address before it.

Example::

    trust = ForwardedTrust(ServerConfig(trusted_proxies=("127.0.0.1", "10.0.0.0/8")))
    scope["client"] = ("127.0.0.1", 5000); scope["headers"] = [(b"x-forwarded-for", b"1.1.1.1, 10.0.0.7")]
    trust.apply(scope)        # scope["client"] == ("1.1.1.1", 0)
"""

from __future__ import annotations

import ipaddress
from typing import Any

from passerelle.config import ServerConfig

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_HEADERS = (b"x-forwarded-for", b"forwarded", b"x-real-ip")
_MAX_HOPS = 32  # a chain longer than this is read from the right this far, no further


def _address(text: str) -> Address | None:
    """An address from a hop as headers write it: ``1.2.3.4``, ``1.2.3.4:80``, ``[::1]:80``, ``::1``."""
    text = text.strip().strip('"')
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:  # IPv4 with a port
        text = text.partition(":")[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _hops(name: bytes, values: list[str]) -> list[str]:
    if name == b"forwarded":
        hops = []
        for element in ",".join(values).split(","):
            for pair in element.split(";"):
                key, _, value = pair.strip().partition("=")
                if key.strip().lower() == "for":
                    hops.append(value)
        return hops
    if name == b"x-real-ip":
        return values[-1:]
    return ",".join(values).split(",")


class ForwardedTrust:
    """Rewrites a request's client address from the forwarded headers of a trusted proxy."""

    __slots__ = ("networks",)

    def __init__(self, server: ServerConfig) -> None:
        self.configure(server)

    def configure(self, server: ServerConfig) -> None:
        """``trusted_proxies``: from the next request on."""
        self.networks = [ipaddress.ip_network(p, strict=False) for p in server.trusted_proxies]

    def _trusted(self, ip: Address) -> bool:
        return any(ip.version == n.version and ip in n for n in self.networks)

    def apply(self, scope: dict[str, Any]) -> None:
        """Set ``scope["client"]`` to the client a trusted proxy names; leave it otherwise."""
        if not self.networks:
            return
        peer = scope.get("client")
        ip = _address(peer[0]) if peer else None
        if ip is None or not self._trusted(ip):
            return
        found: dict[bytes, list[str]] = {}
        for name, value in scope["headers"]:
            if name in _HEADERS:
                found.setdefault(name, []).append(value.decode("latin-1"))
        name = next((n for n in _HEADERS if n in found), None)
        if name is None:
            return
        client = ip
        for hop in reversed(_hops(name, found[name])[-_MAX_HOPS:]):
            addr = _address(hop)
            if addr is None:
                break
            client = addr
            if not self._trusted(addr):
                break
        if client != ip:
            scope["client"] = (str(client), 0)
