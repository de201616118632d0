"""The dashboard's login, for a browser when ``[admin] key`` is set.

A browser cannot send ``Authorization: Bearer`` on a navigation, so ``/ui`` without the key
answers this form (401) instead of a JSON error. ``POST /admin/login`` with the right key sets a
cookie (server/admin.py's :func:`~passerelle.server.admin.session_token`: an HMAC of the key,
never the key) that is ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other site's
page sends it) and ``Secure`` over HTTPS, then sends the browser back to ``/ui``; the dashboard's
polls of ``/admin/stats`` carry it. ``POST /admin/logout`` clears it.

The key is checked by tenants/admin_key.py, as on every route that takes it: throttled per
address and in all before it is compared, so while failed attempts are throttled even the right
key gets this form again with 429 and ``Retry-After`` (nothing was compared: a guesser learns
nothing from it).
"""

from __future__ import annotations

import asyncio
import html
from importlib import resources
from urllib.parse import parse_qs

from passerelle.errors import ClientDisconnect, GatewayError, InvalidRequest, RateLimited, Unauthorized
from passerelle.proxy.exchange import Receive, Scope, Send
from passerelle.proxy.intake import read_request_body
from passerelle.server.admin import COOKIE, AdminGuard
from passerelle.server.connections import BodyBudget, RequestTimeout
from passerelle.server.responses import raw_response

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
    try:
        fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
    except ValueError:  # (more than 8 fields: parse_qs refuses, and that is the client's doing)
        raise InvalidRequest("The form has too many fields; it takes the admin key only.") from None
    return {k: v[-1] for k, v in fields.items()}


class AdminLogin:
    def __init__(self, guard: AdminGuard, budget: BodyBudget) -> None:
        self.guard = guard
        self.budget = budget  # (its ``timeout_s``: [server] body_timeout_s, as every body has)
        self._page: str | None = None

    async def page(self, send: Send, status: int, message: str = "", *, retry_after: bytes | None = None) -> None:
        """The login form (``/ui`` without the key answers it, 401)."""
        if self._page is None:
            self._page = (resources.files("passerelle") / "static" / "login.html").read_text()
        note = f'<p class="error">{html.escape(message)}</p>' if message else ""
        body = self._page.replace("<!--message-->", note).encode()
        extra = [(b"cache-control", b"no-store"), (b"content-security-policy", _CSP)]
        if retry_after is not None:
            extra.append((b"retry-after", retry_after))
        await raw_response(send, status, body, b"text/html; charset=utf-8", extra)

    async def throttled(self, send: Send, err: RateLimited) -> None:
        """The form again, 429 with ``Retry-After``: the route's own shape for a browser."""
        await self.page(send, 429, err.message, retry_after=dict(err.headers()).get(b"retry-after", b"1"))

    async def answer(self, send: Send, err: GatewayError) -> bool:
        """A browser's navigation to ``/ui`` refused for want of the key: the form (401), or the form
        with 429 while failed attempts are throttled. False: ``err`` is another refusal (JSON)."""
        if isinstance(err, Unauthorized):
            await self.page(send, 401)
        elif isinstance(err, RateLimited):
            await self.throttled(send, err)
        else:
            return False
        return True

    async def login(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.guard.key:
            await _see_other(send, b"/ui")  # nothing to log in to
            return
        if scope["method"] != "POST":
            await self.page(send, 200)
            return
        form = await read_form(scope, receive, self.budget.timeout_s)
        try:  # (throttled: 429, the key not compared)
            right = self.guard.key_check.verify(scope, "login", key=form.get("key", "").encode())
        except RateLimited as err:
            await self.throttled(send, err)
            return
        if not right:
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
