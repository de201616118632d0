"""Admin routes (/admin/*, /ui, /metrics): who gets them, the error shapes, and what they serve.

Drives the ASGI app in process with hand-made scopes; the real listeners (a second port, a
reverse proxy's X-Forwarded-For) are covered in tests/integration/test_admin_routes.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest

from passerelle.config import AdminConfig, load_config
from passerelle.server.admin import AdminGuard
from passerelle.server.app import App
from passerelle.server.routes import is_admin_path


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
    guard = AdminGuard(AdminConfig(key="s3cret"))
    assert guard.check(scope("/ui")).status == 401
    assert guard.check(scope("/ui", headers=[(b"authorization", b"Bearer wrong")])).status == 401
    assert guard.check(scope("/ui", headers=[(b"authorization", b"Basic s3cret")])).status == 401
    assert guard.check(scope("/ui", headers=[(b"authorization", b"Bearer s3cret")])) is None
    assert guard.check(scope("/ui", headers=[(b"authorization", b"bearer s3cret")])) is None
    # the key does not open the admin routes to other networks
    assert guard.check(scope("/ui", "192.0.2.1", [(b"authorization", b"Bearer s3cret")])).status == 403


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
    app = make_app(key="s3cret")
    for path in ("/ui", "/metrics", "/admin/stats"):
        status, _, body = await call(app, scope(path))
        assert status == 401 and orjson.loads(body)["error"]["code"] == "invalid_api_key"
        status, _, _ = await call(app, scope(path, headers=[(b"authorization", b"Bearer s3cret")]))
        assert status == 200
