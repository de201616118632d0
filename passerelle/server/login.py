"""The dashboard's login, for a browser when ``[admin] key`` is set.

A browser cannot send ``Authorization: Bearer`` on a navigation, so ``/ui`` without the key
answers this form (401) instead of a JSON error. ``POST /admin/login`` with the right key sets a
cookie (server/admin.py's :func:`~passerelle.server.admin.session_token`: an HMAC of the key,
never the key) that is ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's
page sends it) and ``Secure`` over HTTPS, then sends the browser back to ``/ui``; the dashboard's
polls of ``/admin/stats`` carry it. ``POST /admin/logout`` clears it. Failed attempts are
throttled per client address like failed API keys (``[auth] failed_attempts_per_minute``).
"""

from __future__ import annotations

import asyncio
import html
from importlib import resources
from urllib.parse import parse_qs

from passerelle.errors import ClientDisconnect, InvalidRequest
from passerelle.proxy.exchange import Receive, Scope, Send
from passerelle.proxy.intake import read_request_body
from passerelle.server.admin import COOKIE, AdminGuard
from passerelle.server.connections import RequestTimeout
from passerelle.server.responses import raw_response
from passerelle.tenants.limits import FailedAuthThrottle
from passerelle.tenants.policy import client_address

MAX_FORM_BYTES = 4096
_CSP = (b"default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; base-uri 'none'; "
        b"frame-ancestors 'none'")


async def read_form(scope: Scope, receive: Receive, timeout_s: float) -> dict[str, str]:
    """A small ``application/x-www-form-urlencoded`` body (at most 4 KiB, within ``timeout_s``)."""
    try:
        async with asyncio.timeout(timeout_s):
            body = await read_request_body(scope, receive, MAX_FORM_BYTES)
    except TimeoutError:
        raise RequestTimeout(timeout_s) from None
    except ClientDisconnect:
        raise InvalidRequest("The client left while sending the form.") from None
    fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
    return {k: v[-1] for k, v in fields.items()}


class AdminLogin:
    def __init__(self, guard: AdminGuard, *, failed_per_minute: int, body_timeout_s: float) -> None:
        self.guard = guard
        self.throttle = FailedAuthThrottle(failed_per_minute)
        self.body_timeout_s = body_timeout_s
        self._page: str | None = None

    async def page(self, send: Send, status: int, message: str = "") -> None:
        """The login form (``/ui`` without the key answers it, 401)."""
        if self._page is None:
            self._page = (resources.files("passerelle") / "static" / "login.html").read_text()
        note = f'<p class="error">{html.escape(message)}</p>' if message else ""
        body = self._page.replace("<!--message-->", note).encode()
        await raw_response(send, status, body, b"text/html; charset=utf-8",
                           [(b"cache-control", b"no-store"), (b"content-security-policy", _CSP)])

    async def login(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.guard.key:
            await _see_other(send, b"/ui")  # nothing to log in to
            return
        if scope["method"] != "POST":
            await self.page(send, 200)
            return
        form = await read_form(scope, receive, self.body_timeout_s)
        if not self.guard.matches_key(form.get("key", "")):
            client = client_address(scope)
            self.throttle.check(client, "admin")  # raises RateLimited (the right key always passes)
            self.throttle.failed(client, "admin")
            await self.page(send, 401, "That is not the admin key.")
            return
        await _see_other(send, b"/ui", _cookie(scope, self.guard.token))

    async def logout(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _see_other(send, b"/admin/login", _cookie(scope, b"", max_age=0))


def _cookie(scope: Scope, value: bytes, *, max_age: int | None = None) -> bytes:
    parts = [COOKIE + b"=" + value, b"Path=/", b"HttpOnly", b"SameSite=Strict"]
    if scope.get("scheme") == "https":
        parts.append(b"Secure")
    if max_age is not None:
        parts.append(b"Max-Age=%d" % max_age)
    return b"; ".join(parts)


async def _see_other(send: Send, location: bytes, cookie: bytes | None = None) -> None:
    extra = [(b"location", location), (b"cache-control", b"no-store")]
    if cookie is not None:
        extra.append((b"set-cookie", cookie))
    await raw_response(send, 303, b"", b"text/plain; charset=utf-8", extra)
