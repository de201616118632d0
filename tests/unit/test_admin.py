"""Admin routes (/admin/*, /ui, /metrics): who gets them, the error shapes, and what they serve.

Drives the ASGI app in process with hand-made scopes; the real listeners (a second port, a
reverse proxy's X-Forwarded-For) are covered in tests/integration/test_admin_routes.py.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Any

import httpx
import orjson
import pytest

from passerelle.config import AdminConfig, load_config
from passerelle.errors import ConfigError
from passerelle.server.admin import AdminGuard, session_token
from passerelle.server.app import App
from passerelle.server.routes import is_admin_path

KEY, OTHER = "7d1e9c04b8a25f36e0c4a9b1", "c2a8f05e91d74b36a5e0f8c1"  # admin keys strong enough for [admin] key


def scope(path: str, client: str | None = "127.0.0.1", headers: list[tuple[bytes, bytes]] | None = None,
          method: str = "GET") -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "headers": headers or [],
            "client": (client, 50000) if client else None}


async def call(app, sc: dict[str, Any], *, admin_port: bool = False) -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await (app.admin_app if admin_port else app)(sc, receive, send)
    start = sent[0]
    return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture(autouse=True)
def _state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PASSERELLE_STATE", str(tmp_path / "state"))  # the app opens its key store there


def make_app(**admin: Any) -> App:
    cfg = load_config(env={})
    cfg = dataclasses.replace(cfg, admin=dataclasses.replace(cfg.admin, **admin))
    return App(cfg, [])


@pytest.mark.parametrize(("client", "allowed"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True), (None, True),
    ("192.0.2.10", False), ("10.1.2.3", False), ("2001:db8::1", False), ("::ffff:192.0.2.1", False),
    ("not-an-address", False),
])
def test_default_is_loopback_only(client, allowed):
    err = AdminGuard(AdminConfig()).check(scope("/ui", client))
    assert (err is None) is allowed
    if not allowed:
        assert err.status == 403 and orjson.loads(err.body())["error"]["code"] == "forbidden"


def test_allow_replaces_the_default_networks():
    guard = AdminGuard(AdminConfig(allow=("10.0.0.0/8", "2001:db8::/32")))
    assert guard.check(scope("/ui", "10.9.8.7")) is None
    assert guard.check(scope("/ui", "2001:db8::5")) is None
    assert guard.check(scope("/ui", "127.0.0.1")).status == 403


def test_key_is_needed_when_set():
    guard = AdminGuard(AdminConfig(key=KEY))
    assert guard.check(scope("/ui")).status == 401
    assert guard.check(scope("/ui", headers=[(b"authorization", b"Bearer wrong")])).status == 401
    assert guard.check(scope("/ui", headers=[(b"authorization", b"Basic " + KEY.encode())])).status == 401
    assert guard.check(scope("/ui", headers=[(b"authorization", b"Bearer " + KEY.encode())])) is None
    assert guard.check(scope("/ui", headers=[(b"authorization", b"bearer " + KEY.encode())])) is None
    # the key does not open the admin routes to other networks
    assert guard.check(scope("/ui", "192.0.2.1", [(b"authorization", b"Bearer " + KEY.encode())])).status == 403


def test_admin_paths():
    assert all(map(is_admin_path, ["/ui", "/metrics", "/admin/stats", "/admin/anything", "/admin"]))
    assert not any(map(is_admin_path, ["/health", "/ready", "/v1/models", "/uix", "/administrator"]))


async def test_app_refuses_admin_routes_to_remote_clients_but_not_the_rest():
    app = make_app()
    for path in ("/ui", "/metrics", "/admin/stats"):
        status, headers, body = await call(app, scope(path, "192.0.2.10"))
        assert status == 403 and headers[b"content-type"] == b"application/json"
        err = orjson.loads(body)["error"]
        assert set(err) == {"message", "type", "code"} and err["type"] == "permission_error"
        assert "[admin] allow" in err["message"] and headers[b"x-request-id"].startswith(b"req_")
    status, _, _ = await call(app, scope("/health", "192.0.2.10"))
    assert status == 200


async def test_app_serves_stats_ui_and_metrics_to_loopback():
    app = make_app()
    status, headers, body = await call(app, scope("/admin/stats"))
    assert status == 200 and headers[b"cache-control"] == b"no-store"
    snap = orjson.loads(body)
    assert list(snap["classes"]) == ["interactive", "standard", "batch"]
    assert snap["metrics_enabled"] is True and snap["backends"] == [] and snap["window_s"] == 300.0
    status, headers, body = await call(app, scope("/ui"))
    assert status == 200 and headers[b"content-type"].startswith(b"text/html")
    assert b"/admin/stats" in body and b"<script" in body
    # self-contained: no external script, style or font, and a policy that would block one anyway
    for needle in (b"http://", b"https://", b"//cdn", b"<link", b"src="):
        assert needle not in body.replace(b'xmlns="http://www.w3.org/2000/svg"', b"")
    assert b"default-src 'none'" in headers[b"content-security-policy"]
    assert b"connect-src 'self'" in headers[b"content-security-policy"]
    status, _, body = await call(app, scope("/metrics"))
    assert status == 200 and b"passerelle_time_to_first_token_seconds" in body


async def test_with_an_admin_port_the_main_port_does_not_serve_admin_routes():
    app = make_app(port=19999)
    for path in ("/ui", "/metrics", "/admin/stats"):
        status, _, body = await call(app, scope(path))
        assert status == 404 and b"on this port" in body
        status, _, _ = await call(app, scope(path), admin_port=True)
        assert status == 200
    status, _, _ = await call(app, scope("/v1/models"), admin_port=True)
    assert status == 404
    status, _, _ = await call(app, scope("/admin/stats", method="POST"), admin_port=True)
    assert status == 405
    status, _, _ = await call(app, scope("/ui", "192.0.2.10"), admin_port=True)
    assert status == 403


async def test_admin_key_applies_to_every_admin_route():
    app = make_app(key=KEY)
    for path in ("/ui", "/metrics", "/admin/stats"):
        status, headers, body = await call(app, scope(path))
        if path == "/ui":  # a browser's navigation: the login form (below)
            assert status == 401 and headers[b"content-type"].startswith(b"text/html") and b"<form" in body
        else:
            assert status == 401 and orjson.loads(body)["error"]["code"] == "invalid_api_key"
        status, _, _ = await call(app, scope(path, headers=[(b"authorization", b"Bearer " + KEY.encode())]))
        assert status == 200


# -- a browser: the login cookie, Origin and Host --------------------------------------------------
def browser(app: App, base: str = "http://127.0.0.1:8080") -> httpx.AsyncClient:
    """httpx in front of the ASGI app, as a browser on loopback (client 127.0.0.1, its cookie jar)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base, follow_redirects=False)


async def test_with_an_admin_key_the_dashboard_opens_in_a_browser_after_a_login():
    app = make_app(key=KEY)
    async with browser(app) as b:
        page = await b.get("/ui")  # a navigation: no Authorization header, so the login form
        assert page.status_code == 401 and page.headers["content-type"].startswith("text/html")
        assert 'action="/admin/login"' in page.text and 'name="key"' in page.text
        assert "form-action 'self'" in page.headers["content-security-policy"]
        assert (await b.get("/admin/stats")).status_code == 401  # JSON routes stay JSON
        wrong = await b.post("/admin/login", data={"key": "guess"})
        assert wrong.status_code == 401 and "not the admin key" in wrong.text and "set-cookie" not in wrong.headers
        ok = await b.post("/admin/login", data={"key": KEY})
        assert ok.status_code == 303 and ok.headers["location"] == "/ui"
        cookie = ok.headers["set-cookie"]
        attrs = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
        assert {"httponly", "samesite", "path"} <= attrs and "SameSite=Strict" in cookie
        value = cookie.split(";")[0].split("=", 1)[1]
        assert KEY not in cookie and value == session_token(KEY).decode()
        for path in ("/ui", "/admin/stats", "/metrics", "/admin/runtimes"):  # what the dashboard polls, and more
            assert (await b.get(path)).status_code == 200, path
        out = await b.post("/admin/logout")
        assert out.status_code == 303 and "Max-Age=0" in out.headers["set-cookie"]
        assert (await b.get("/admin/stats")).status_code == 401
    async with browser(app) as b:  # a cookie that is not the key's HMAC opens nothing
        for forged in (KEY, session_token(OTHER).decode(), ""):
            b.cookies.set("passerelle_admin", forged)
            assert (await b.get("/admin/stats")).status_code == 401, forged
    async with browser(make_app(key=OTHER)) as b:  # another key, another cookie: changing the key logs out
        b.cookies.set("passerelle_admin", value)
        assert (await b.get("/admin/stats")).status_code == 401


async def test_a_login_form_too_big_is_refused():
    async with browser(make_app(key=KEY)) as b:
        big = await b.post("/admin/login", content=b"key=" + b"x" * 5000,
                           headers={"content-type": "application/x-www-form-urlencoded"})
        assert big.status_code == 413  # the body cap of every request (proxy/intake.py)


async def test_without_an_admin_key_the_login_sends_the_browser_to_the_dashboard():
    async with browser(make_app()) as b:
        assert (await b.get("/ui")).status_code == 200
        r = await b.post("/admin/login", data={"key": "x"})
        assert r.status_code == 303 and r.headers["location"] == "/ui" and "set-cookie" not in r.headers


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/admin/reload"), ("POST", "/admin/runtimes/chat/stop"), ("GET", "/admin/stats"),
    ("POST", "/admin/keys"),
])
@pytest.mark.parametrize(("headers", "why"), [
    ({"origin": "http://evil.example"}, "Origin"),  # a page of another site
    ({"origin": "http://127.0.0.1:3000"}, "Origin"),  # a page on this host, another port
    ({"origin": "null"}, "Origin"),  # a sandboxed frame, a file
    ({"host": "evil.example:8080"}, "host names"),  # DNS rebinding: the attacker's name, resolving to 127.0.0.1
    ({"host": "evil.example:8080", "origin": "http://evil.example:8080"}, "host names"),
])
async def test_admin_routes_refuse_other_sites_and_unknown_hosts(method, path, headers, why):
    app = make_app()
    async with browser(app) as b:
        r = await b.request(method, path, headers=headers)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden" and why in r.json()["error"]["message"]


async def test_admin_routes_answer_their_own_origin_and_host_names(tmp_path):
    app = make_app(hosts=("gpu.example.org",))
    machine = socket.gethostname()
    async with browser(app) as b:
        for host in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "192.0.2.7", machine, "gpu.example.org",
                     "GPU.example.org.:443", "app.localhost"):
            assert (await b.get("/admin/stats", headers={"host": host})).status_code == 200, host
        same = {"origin": "http://127.0.0.1:8080", "sec-fetch-site": "same-origin"}
        assert (await b.get("/admin/stats", headers=same)).status_code == 200
        # a reverse proxy that rewrites the Host: its public name, configured, is the page's origin
        assert (await b.get("/admin/stats", headers={"origin": "https://gpu.example.org"})).status_code == 200
        cross = await b.post("/admin/reload", headers={"sec-fetch-site": "cross-site"})
        assert cross.status_code == 403 and "Sec-Fetch-Site" in cross.json()["error"]["message"]
        # a cross-site navigation to the dashboard (a link) is no change: it may open it
        assert (await b.get("/ui", headers={"sec-fetch-site": "cross-site"})).status_code == 200
    async with browser(make_app(hosts=("*",))) as b:
        assert (await b.get("/admin/stats", headers={"host": "anything.example"})).status_code == 200
        assert (await b.get("/admin/stats", headers={"origin": "http://evil.example"})).status_code == 403
    (tmp_path / "p.toml").write_text("[admin]\nhosts = ['http://x:80']\n")
    with pytest.raises(ConfigError, match=r"admin\.hosts"):
        load_config(tmp_path / "p.toml", env={})
