"""Admin routes on a real gateway process: the separate admin port, the admin key, clients behind
a reverse proxy, the stats window against the access log, and the [metrics] switches.

Runs against ``passerelle fake-backend`` (fast and deterministic); the same routes against the
real llama-server are exercised by test_prometheus_llama.py and tests/e2e/.
"""

from __future__ import annotations

import signal
import statistics
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port, upstream_config, wait_until

REMOTE = {"X-Forwarded-For": "203.0.113.9"}  # what a reverse proxy on loopback says for a remote client
BEHIND_PROXY = '\n[server]\ntrusted_proxies = ["127.0.0.1"]\n'  # ...believed only when configured


def chat(url: str, i: int, *, stream: bool = True, priority: str = "standard") -> httpx.Response:
    body = {"model": "fake-model", "stream": stream, "max_tokens": 8,
            "messages": [{"role": "user", "content": f"hello {i}"}]}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Priority": priority}, timeout=30)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_stats_window_matches_the_access_log_and_remote_clients_are_refused(gateway, fake_backend):
    fake = fake_backend(ttft_ms=30, itl_ms=5, slots=4)
    gw = gateway(upstream_config(fake.url, model="fake-model") + BEHIND_PROXY)
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda i: chat(gw.url, i, priority="batch" if i % 3 == 0 else "standard"),
                                  range(24)))
    assert all(r.status_code == 200 for r in responses)
    assert httpx.post(gw.url + "/v1/chat/completions", json={"model": "nope", "messages": []}).status_code == 400
    lines = wait_until(lambda: log if len(log := gw.access_log()) == 25 else None, 10, what="25 log lines")
    stats = httpx.get(gw.url + "/admin/stats").json()
    assert stats["totals"]["requests"] == 25 and stats["totals"]["errors"] == 1
    assert stats["causes"] == {"ok": 24, "invalid_request": 1}
    assert stats["recent_errors"][0]["cause"] == "invalid_request" and stats["recent_errors"][0]["status"] == 400
    for cls in ("standard", "batch"):
        ttfts = sorted(r["ttft_ms"] for r in lines if r["priority"] == cls and r["cause"] == "ok")
        got = stats["classes"][cls]
        assert got["ok"] == len(ttfts) == (8 if cls == "batch" else 16)
        # same requests, same clock: the window's median is the access log's, to rounding
        assert abs(got["ttft_ms"]["p50"] - statistics.median(ttfts)) < 0.2
        assert 30 <= got["ttft_ms"]["p50"] <= got["ttft_ms"]["p95"] < 1000
        assert got["itl_ms"]["count"] == 7 * len(ttfts) and 4 <= got["itl_ms"]["p50"] < 100
    assert stats["totals"]["tokens_per_s"] > 0
    (backend,) = stats["backends"]
    assert backend["up"] and backend["slots_total"] == 4 and backend["capacity"] == 4
    # a client the reverse proxy says is remote gets 403 on admin routes, not on the API
    for path in ("/ui", "/metrics", "/admin/stats"):
        r = httpx.get(gw.url + path, headers=REMOTE)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert httpx.get(gw.url + "/v1/models", headers=REMOTE).status_code == 200


def test_separate_admin_port_serves_only_admin_routes_and_stops_with_the_gateway(gateway, fake_backend):
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    admin_port = free_port()
    gw = gateway(upstream_config(fake.url, model="fake-model") + f"\n[admin]\nport = {admin_port}\n")
    admin = f"http://127.0.0.1:{admin_port}"
    assert f"dashboard at {admin}/ui" in gw.log_text()
    assert chat(gw.url, 1).status_code == 200
    for path in ("/ui", "/metrics", "/admin/stats"):
        assert httpx.get(gw.url + path).status_code == 404
        assert httpx.get(admin + path).status_code == 200
        # no trusted proxy configured: a local client's X-Forwarded-For is not believed (uvicorn's
        # default would believe it from loopback)
        assert httpx.get(admin + path, headers=REMOTE).status_code == 200
    assert httpx.get(admin + "/v1/models").status_code == 404
    assert httpx.post(admin + "/v1/chat/completions", json={}).status_code == 404
    assert "passerelle_time_to_first_token_seconds_count" in httpx.get(admin + "/metrics").text
    assert httpx.get(admin + "/admin/stats").json()["totals"]["requests"] == 1
    with httpx.Client() as keepalive:  # an open keep-alive connection must not hold up the stop
        assert keepalive.get(admin + "/admin/stats").status_code == 200
        assert gw.stop(signal.SIGTERM, timeout=20) == 0
    try:
        httpx.get(admin + "/health", timeout=1)
        raise AssertionError("the admin port still answers after the gateway stopped")
    except httpx.ConnectError:
        pass


def test_admin_key_tenant_label_off_and_metrics_off(gateway, fake_backend):
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(upstream_config(fake.url, model="fake-model")
                 + '\n[admin]\nkey = "a7c3e9f1d05b2846e8c1f0a3"\n[metrics]\ntenant_label = false\nenabled = false\n')
    for i in range(3):
        assert chat(gw.url, i).status_code == 200
    r = httpx.get(gw.url + "/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(gw.url + "/ui", headers={"Authorization": "Bearer wrong"}).status_code == 401
    auth = {"Authorization": "Bearer a7c3e9f1d05b2846e8c1f0a3"}
    assert httpx.get(gw.url + "/ui", headers=auth).status_code == 200
    with httpx.Client(base_url=gw.url) as browser:  # a browser: the login form, then its cookie
        assert browser.get("/ui").status_code == 401 and "<form" in browser.get("/ui").text
        login = browser.post("/admin/login", data={"key": "a7c3e9f1d05b2846e8c1f0a3"})
        assert login.status_code == 303 and "HttpOnly" in login.headers["set-cookie"]
        assert browser.get("/ui").status_code == 200 and browser.get("/admin/stats").status_code == 200
        # a page of another site cannot use it to reload the configuration
        assert browser.post("/admin/reload", headers={"origin": "http://evil.example"}).status_code == 403
    text = httpx.get(gw.url + "/metrics", headers=auth).text
    assert "tenant=" not in text
    got = samples(text)
    labels = (("cause", "ok"), ("model", "fake-model"), ("priority", "standard"))
    assert got[("passerelle_requests_total", labels)] == 3
    assert got[("passerelle_generation_tokens_total",
                (("backend", "b1"), ("model", "fake-model"), ("priority", "standard")))] == 24
    # enabled = false: no latency histogram observed, no request statistics kept
    hist = [v for (name, _), v in got.items() if name.endswith("_count") and name.startswith(
        ("passerelle_time_to_first_token", "passerelle_inter_token", "passerelle_e2e", "passerelle_queue_wait"))]
    assert hist == [0.0] * len(hist)
    stats = httpx.get(gw.url + "/admin/stats", headers=auth).json()
    assert stats["metrics_enabled"] is False and stats["totals"]["requests"] == 0
    assert stats["backends"][0]["up"] is True
