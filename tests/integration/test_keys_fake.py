"""Keys on a real gateway process in front of ``passerelle fake-backend``: a key's surplus streams
wait their turn, the key API with and without the admin key, allow-lists, quotas across a restart,
/v1/me, the failed-key throttle, and one key store per configuration.

The fake runtime counts the requests it has in flight (``/fake/stats``), so "at most N at once at
the runtime" is read from the runtime itself, not from the gateway's own figures.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from passerelle.tenants.quota import window
from tests.conftest import wait_until

ADMIN = {"Authorization": "Bearer a7c3e9f1d05b2846e8c1f0a3"}


def config(url: str, *, models: tuple[str, ...] = ("fake-model",), slots: int = 32, extra: str = "") -> str:
    listed = ", ".join(f'"{m}"' for m in models)
    return f"""
    [[backends]]
    name = "fake"
    kind = "openai"
    url = "{url}"
    models = [{listed}]
    max_concurrency = {slots}
    {extra}
    """


def cli(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "passerelle", *args], env={**os.environ, **env},
                          capture_output=True, text=True, check=check, timeout=60)


def chat(url: str, key: str | None, *, model: str = "fake-model", max_tokens: int = 8,
         stream: bool = False) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", headers=headers, timeout=30, json={
        "model": model, "max_tokens": max_tokens, "stream": stream, "messages": [{"role": "user", "content": "hi"}]})


def fake_stats(fake) -> dict:
    return httpx.get(fake.url + "/fake/stats", timeout=5).json()


def test_twenty_streams_on_a_key_of_four_all_complete_four_at_once_at_the_runtime(gateway, fake_backend, tmp_path):
    env = {"PASSERELLE_STATE": str(tmp_path / "state")}
    fake = fake_backend(ttft_ms=40, itl_ms=15, slots=0)  # unlimited: only the key limits what runs
    secret = cli(env, "keys", "create", "--tenant", "sdk-user", "--max-concurrency", "4").stdout.strip()
    gw = gateway(config(fake.url), env=env)

    async def run() -> list[int]:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=secret, max_retries=0)
        async with client:
            async def one(i: int) -> int:
                stream = await client.chat.completions.create(
                    model="fake-model", max_tokens=12, stream=True, messages=[{"role": "user", "content": f"s{i}"}])
                return len([c async for c in stream if c.choices and c.choices[0].delta.content])

            return await asyncio.gather(*(one(i) for i in range(20)))

    tokens = asyncio.run(run())
    assert tokens == [12] * 20  # every stream complete: none refused, none cut
    stats = fake_stats(fake)
    assert stats["completed"] == 20 and stats["in_flight"] == 0
    assert stats["peak_in_flight"] == 4  # never more than the key's 4 at the runtime, and the 4 were used
    lines = [line for line in gw.access_log() if line.get("key_id") == secret.split("_")[1]]
    assert len(lines) == 20 and {line["cause"] for line in lines} == {"ok"}
    # the 16 that waited for the key's turn show it as queue time
    assert sum(1 for line in lines if line["queue_ms"] >= 30) >= 12


def test_key_api_needs_the_admin_key_and_audits_every_change(gateway, fake_backend, tmp_path):
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(config(fake.url, models=("fake-model", "fake-big")) + '\n[admin]\nkey = "a7c3e9f1d05b2846e8c1f0a3"\n',
                 env={"PASSERELLE_STATE": str(tmp_path / "state")})
    url = gw.url + "/admin/keys"
    spec = {"tenant": "ci", "label": "CI runners", "owner": "ops@example.org", "models": ["fake-model"],
            "quotas": ["2M/day"], "rpm": 600}
    assert httpx.post(url, json=spec).status_code == 401
    assert httpx.post(url, json=spec, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(url).status_code == 401
    created = httpx.post(url, json=spec, headers={**ADMIN, "X-Passerelle-Actor": "alice"})
    assert created.status_code == 201, created.text
    body = created.json()
    secret, key_id = body["key"], body["id"]
    assert secret.startswith(f"psk_{key_id}_") and body["models"] == ["fake-model"] and body["quotas"] == ["2M/day"]
    # bad input: 400 naming the field, nothing created
    bad = httpx.post(url, json={"tenant": "x", "quotas": ["lots"]}, headers=ADMIN)
    assert bad.status_code == 400 and "quotas" in bad.json()["error"]["message"]
    # the secret is never shown again
    listing = httpx.get(url, headers=ADMIN)
    assert listing.status_code == 200 and secret not in listing.text and secret.split("_")[2] not in listing.text
    (row,) = listing.json()["data"]
    assert row["id"] == key_id and row["label"] == "CI runners" and row["activity"]["requests"] == 0
    # the key works at once, on its model only; the 403 lists what it may use
    assert chat(gw.url, secret).status_code == 200
    refused = chat(gw.url, secret, model="fake-big")
    assert refused.status_code == 403
    err = refused.json()["error"]
    assert err["type"] == "permission_error" and err["code"] == "model_not_allowed" and "fake-model" in err["message"]
    assert gw.log_for(refused.headers["x-request-id"])["cause"] == "forbidden"
    # /v1/models: only to a key, only its models
    assert httpx.get(gw.url + "/v1/models").status_code == 401
    models = httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}).json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    # update the limits: takes effect for the next request (one request counted so far this minute)
    patched = httpx.patch(f"{url}/{key_id}", json={"models": ["fake-*"], "rpm": 2}, headers=ADMIN)
    assert patched.status_code == 200 and patched.json()["models"] == ["fake-*"]
    assert chat(gw.url, secret, model="fake-big").status_code == 200
    limited = chat(gw.url, secret)
    assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
    # revoke
    assert httpx.delete(f"{url}/{key_id}", headers=ADMIN).json()["revoked"] is True
    assert chat(gw.url, secret).status_code == 401
    assert httpx.delete(f"{url}/{key_id}", headers=ADMIN).status_code == 404
    audit = httpx.get(gw.url + "/admin/audit", headers=ADMIN).json()["data"]
    assert [a["action"] for a in audit] == ["revoke", "update", "create"]
    assert audit[2]["actor"] == "admin API from 127.0.0.1 (alice)" and audit[0]["actor"] == "admin API from 127.0.0.1"
    assert audit[1]["detail"]["rpm"] == {"from": 600, "to": 2}
    # the CLI reads the same store and log
    out = cli({"PASSERELLE_STATE": str(tmp_path / "state")}, "keys", "audit").stdout
    assert out.count(key_id) == 3


def test_without_an_admin_key_the_key_api_says_how_to_enable_it(gateway, fake_backend, tmp_path):
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(config(fake.url), env={"PASSERELLE_STATE": str(tmp_path / "state")})
    r = httpx.post(gw.url + "/admin/keys", json={"tenant": "x"})
    assert r.status_code == 403 and "[admin] key" in r.json()["error"]["message"]
    assert httpx.get(gw.url + "/admin/keys").status_code == 403
    # and nothing was created: the gateway still needs no key
    assert chat(gw.url, None).status_code == 200


def test_quota_429_until_the_windows_end_survives_a_restart_and_me_shows_it(gateway, fake_backend, tmp_path):
    env = {"PASSERELLE_STATE": str(tmp_path / "state")}
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    secret = cli(env, "keys", "create", "--tenant", "ci", "--label", "nightly", "--quota", "100/day",
                 "--model", "fake-model").stdout.strip()
    gw = gateway(config(fake.url), env=env)
    auth = {"Authorization": f"Bearer {secret}"}
    me = httpx.get(gw.url + "/v1/me", headers=auth).json()
    assert me["label"] == "nightly" and me["models"] == ["fake-model"]
    assert me["quotas"] == [{"quota": "100/day", "tokens": 100, "period": "day", "unit": "tokens", "used": 0,
                             "remaining": 100, "resets_at": me["quotas"][0]["resets_at"]}]
    codes = []
    while not codes or codes[-1] == 200:
        codes.append((r := chat(gw.url, secret, max_tokens=20)).status_code)
        assert len(codes) < 10
    assert 3 <= codes.count(200) <= 5 and r.status_code == 429
    err = r.json()["error"]
    assert err["code"] == "quota_exceeded" and "100 tokens a day" in err["message"]
    to_midnight = window("day", time.time())[1] - time.time()
    assert abs(int(r.headers["retry-after"]) - to_midnight) <= 5
    assert gw.log_for(r.headers["x-request-id"])["cause"] == "quota_exceeded"
    used = httpx.get(gw.url + "/v1/me", headers=auth).json()["quotas"][0]["used"]
    usage = httpx.get(gw.url + "/v1/me/usage?since=1h", headers=auth).json()
    assert usage["total"]["total_tokens"] == used and usage["total"]["limited"] == 1
    assert [row["model"] for row in usage["data"]] == ["fake-model"]
    # the dashboard's figures for the key and its tenant
    stats = httpx.get(gw.url + "/admin/stats").json()
    (k,) = stats["keys"]
    assert (k["label"], k["requests"], k["limited"], k["tokens"]) == ("nightly", len(codes), 1, used)
    assert k["quotas"][0]["used"] == used and k["quotas"][0]["remaining"] == max(0, 100 - used)
    assert {t["tenant"]: t["requests"] for t in stats["tenants"]} == {"ci": len(codes)}
    # a restart reads the day's usage back from the store
    gw.stop()
    gw2 = gateway(config(fake.url), env=env)
    again = chat(gw2.url, secret, max_tokens=20)
    assert again.status_code == 429 and again.json()["error"]["code"] == "quota_exceeded"
    assert httpx.get(gw2.url + "/v1/me", headers=auth).json()["quotas"][0]["used"] == used
    # the operator's view: usage by key, on the command line (after a stop, every row is written)
    gw2.stop()
    report = cli(env, "usage", "--by", "key", "--since", "1h").stdout.splitlines()
    row = next(line.split() for line in report if line.startswith(secret.split("_")[1]))
    assert row[1] == "nightly" and row[2] == "ci" and int(row[6]) == used and int(row[8]) == 2


def test_a_bad_key_from_an_address_does_not_lock_out_a_good_one(gateway, fake_backend, tmp_path):
    env = {"PASSERELLE_STATE": str(tmp_path / "state")}
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    secret = cli(env, "keys", "create", "--tenant", "team").stdout.strip()
    gw = gateway(config(fake.url), env=env)
    codes = [chat(gw.url, "psk_0123456789ab_stale").status_code for _ in range(21)]
    assert codes == [401] * 20 + [429]
    assert chat(gw.url, secret).status_code == 200  # same address (loopback), valid key: served
    throttle = httpx.get(gw.url + "/admin/stats").json()["auth_throttle"]
    assert [(b["client"], b["key_prefix"], b["failures"]) for b in throttle["blocked"]] == [
        ("127.0.0.1", "psk_0123456789ab", 20)]


def test_each_configuration_has_its_own_key_store(gateway, fake_backend, tmp_path):
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    no_env = {"PASSERELLE_STATE": ""}  # as a user would run it: the store follows the configuration
    team, lab = tmp_path / "team", tmp_path / "lab"
    for d in (team, lab):
        d.mkdir()
        (d / "gw.toml").write_text(config(fake.url))
    secret = cli(no_env, "keys", "create", "--config", str(team / "gw.toml"), "--tenant", "t").stdout.strip()
    assert (team / "gw.state" / "passerelle.db").exists() and not (lab / "gw.state").exists()
    gw_team = gateway(config(fake.url), args=("--config", str(team / "gw.toml")), env=no_env)
    gw_lab = gateway(config(fake.url), args=("--config", str(lab / "gw.toml")), env=no_env)
    assert chat(gw_team.url, None).status_code == 401 and chat(gw_team.url, secret).status_code == 200
    assert chat(gw_lab.url, None).status_code == 200  # keys for one gateway turn on nothing in another
    assert f"key store {team / 'gw.state' / 'passerelle.db'}" in gw_team.log_text()
    wait_until(lambda: "key store" in gw_lab.log_text(), 5, what="lab's start-up lines")
    assert f"key store {lab / 'gw.state' / 'passerelle.db'} (no key yet" in gw_lab.log_text()
    assert Path(team / "gw.state").is_dir()


@pytest.mark.parametrize("stream", [False, True])
def test_usage_rows_carry_the_key(gateway, fake_backend, tmp_path, stream):
    env = {"PASSERELLE_STATE": str(tmp_path / "state")}
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    a = cli(env, "keys", "create", "--tenant", "team", "--label", "alice laptop").stdout.strip()
    b = cli(env, "keys", "create", "--tenant", "team", "--label", "bob laptop").stdout.strip()
    gw = gateway(config(fake.url), env=env)
    for key, n in ((a, 2), (b, 1)):
        for _ in range(n):
            assert chat(gw.url, key, max_tokens=5, stream=stream).status_code == 200
    gw.stop()
    csv = cli(env, "usage", "--by", "key,model", "--csv").stdout.splitlines()
    assert csv[0] == ("key,label,key_tenant,model,requests,prompt_tokens,completion_tokens,total_tokens,not_ok,"
                      "limited,last_seen")
    rows = {line.split(",")[1]: line.split(",") for line in csv[1:]}
    assert rows["alice laptop"][4] == "2" and rows["alice laptop"][6] == "10"
    assert rows["bob laptop"][4] == "1" and rows["bob laptop"][2] == "team"
    by_tenant = cli(env, "usage", "--by", "tenant").stdout.splitlines()
    assert by_tenant[1].split()[:2] == ["team", "3"]
