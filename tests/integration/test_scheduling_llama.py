"""Priority, queueing, keys and limits in front of a real llama-server."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import orjson
import pytest

from tests.conftest import MODEL_ID, upstream_config, wait_until

pytestmark = pytest.mark.llama

ONE_SLOT = """
[auth]
anonymous_max_priority = "interactive"
[scheduler]
aging_s = 600
"""


def chat(url: str, *, priority: str | None = None, max_tokens: int = 8, prompt: str = "Hello",
         key: str | None = None, timeout: float = 120) -> httpx.Response:
    headers = {}
    if priority:
        headers["X-Priority"] = priority
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(url + "/v1/chat/completions", headers=headers, timeout=timeout, json={
        "model": MODEL_ID, "max_tokens": max_tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": prompt}]})


def in_background(fn, *args, **kw) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        out["resp"] = fn(*args, **kw)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def running(gw) -> float:
    """Requests the gateway has dispatched and not finished (its own gauge)."""
    text = httpx.get(gw.url + "/metrics").text
    m = re.search(rf'passerelle_requests_running{{backend="b1",model="{MODEL_ID}"}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def waiting(gw, cls: str) -> float:
    text = httpx.get(gw.url + "/metrics").text
    m = re.search(rf'passerelle_requests_waiting{{model="{MODEL_ID}",priority="{cls}"}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def test_interactive_queued_later_is_dispatched_before_earlier_batch(gateway, llama_server):
    # the queue's order alone: with preemption (the default) the interactive request would not
    # wait for the running batch request at all (tests/integration/test_preemption_llama.py)
    gw = gateway(upstream_config(llama_server.url, slots=1) + ONE_SLOT + "preemption = false\n")
    first = in_background(chat, gw.url, priority="batch", max_tokens=400, prompt="batch 0")
    wait_until(lambda: running(gw) == 1, 30, what="first batch request running")
    batch = [in_background(chat, gw.url, priority="batch", max_tokens=8, prompt=f"batch {i}") for i in (1, 2, 3)]
    wait_until(lambda: waiting(gw, "batch") == 3, 10, what="three batch requests queued")
    inter = in_background(chat, gw.url, priority="interactive", max_tokens=4, prompt="interactive")
    wait_until(lambda: waiting(gw, "interactive") == 1, 10, what="interactive request queued")
    for t, _ in [first, *batch, inter]:
        t.join(120)
    assert all(out["resp"].status_code == 200 for _, out in [first, *batch, inter])
    order = [line["priority"] for line in gw.access_log()]
    # one slot: requests finish in the order they were dispatched
    assert order[:2] == ["batch", "interactive"], order
    inter_line = next(line for line in gw.access_log() if line["priority"] == "interactive")
    assert inter_line["queue_ms"] > 0


def prompt_tokens_total(llama_url: str) -> float:
    text = httpx.get(llama_url + "/metrics").text
    return float(re.search(r"^llamacpp:prompt_tokens_total (\S+)", text, re.M).group(1))


def test_queued_request_whose_client_left_is_never_sent_upstream(gateway, llama_server):
    gw = gateway(upstream_config(llama_server.url, slots=1) + ONE_SLOT)
    before = prompt_tokens_total(llama_server.url)
    first = in_background(chat, gw.url, max_tokens=400, prompt="short")
    wait_until(lambda: running(gw) == 1, 30, what="first request running")
    big = "lighthouse keeper " * 300  # about 900 prompt tokens if it ever reached llama-server
    payload = orjson.dumps({"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": big}]})
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    wait_until(lambda: waiting(gw, "standard") == 1, 10, what="request queued")
    sock.close()
    wait_until(lambda: waiting(gw, "standard") == 0, 2, what="departed request removed from the queue")
    first[0].join(120)
    after_small = chat(gw.url, max_tokens=2, prompt="third")  # would run after the departed one
    assert after_small.status_code == 200
    left = next(line for line in gw.access_log() if line["cause"] == "client_disconnect")
    assert left["backend"] == "" and left["completion_tokens"] == 0
    assert prompt_tokens_total(llama_server.url) - before < 300


def test_queue_full_and_queue_timeout_are_429_with_retry_after(gateway, llama_server):
    gw = gateway(upstream_config(llama_server.url, slots=1) + ONE_SLOT + """
[[classes]]
name = "standard"
rank = 1
max_queue = 1
max_queue_wait_s = 1.5
""")
    first = in_background(chat, gw.url, max_tokens=200, prompt="occupy the slot")
    wait_until(lambda: running(gw) == 1, 30, what="slot occupied")
    queued = in_background(chat, gw.url, max_tokens=2, prompt="queued")
    wait_until(lambda: waiting(gw, "standard") == 1, 10, what="one queued")
    full = chat(gw.url, max_tokens=2)
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
    assert int(full.headers["retry-after"]) >= 1
    queued[0].join(30)
    late = queued[1]["resp"]
    assert late.status_code == 429 and late.json()["error"]["code"] == "queue_timeout"
    assert int(late.headers["retry-after"]) >= 1
    first[0].join(120)
    causes = [line["cause"] for line in gw.access_log()]
    assert causes.count("queue_full") == 1 and causes.count("queue_timeout") == 1


def cli(gw_env: dict, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "passerelle", *args], env={**os.environ, **gw_env},
                          capture_output=True, text=True, check=True).stdout


def test_keys_401_and_429_with_the_openai_sdk(gateway, llama_server, tmp_path):
    env = {"PASSERELLE_STATE": str(tmp_path / "state")}
    secret = cli(env, "keys", "create", "--tenant", "alice", "--rpm", "2").strip()
    assert secret.startswith("psk_")
    gw = gateway(upstream_config(llama_server.url), env=env)
    anon = openai.OpenAI(base_url=gw.url + "/v1", api_key="wrong", max_retries=0)
    gw.extra.setdefault("clients", []).append(anon)  # closed with the gateway, pass or fail
    with pytest.raises(openai.AuthenticationError) as info:
        anon.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert info.value.status_code == 401
    alice = openai.OpenAI(base_url=gw.url + "/v1", api_key=secret, max_retries=0)
    gw.extra["clients"].append(alice)
    for _ in range(2):
        alice.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        alice.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert 1 <= int(info.value.response.headers["retry-after"]) <= 60
    assert info.value.body["code"] == "rate_limit_exceeded"
    # the log line is written just after the answer: wait for it
    causes = wait_until(lambda: (c := [(line["tenant"], line["cause"]) for line in gw.access_log()])
                        and ("alice", "rate_limited") in c and c, 5, what="rate_limited in the access log")
    assert causes.count(("alice", "ok")) == 2
    assert ("anonymous", "unauthorized") in causes
    # the key's tenant shows in usage; keys list never shows secrets
    listing = cli(env, "keys", "list")
    assert "alice" in listing and secret not in listing and secret.split("_")[2] not in listing
    key_id = secret.split("_")[1]
    cli(env, "keys", "revoke", key_id)
    wait_until(lambda: chat(gw.url, key=secret, max_tokens=1).status_code == 401, 5, what="revoked key refused")


def test_failed_attempts_are_throttled_per_address(gateway, llama_server, tmp_path):
    env = {"PASSERELLE_STATE": str(tmp_path / "state")}
    cli(env, "keys", "create", "--tenant", "bob")
    gw = gateway(upstream_config(llama_server.url) + "[auth]\nfailed_attempts_per_minute = 3\n", env=env)
    codes = [chat(gw.url, key="psk_nope_nope", max_tokens=1).status_code for _ in range(5)]
    assert codes[:3] == [401, 401, 401] and codes[3:] == [429, 429]


def test_x_priority_raises_only_up_to_the_keys_max(gateway, llama_server, tmp_path):
    env = {"PASSERELLE_STATE": str(tmp_path / "state")}
    low = cli(env, "keys", "create", "--tenant", "bulk", "--priority", "batch").strip()
    high = cli(env, "keys", "create", "--tenant", "chat", "--priority", "standard",
               "--max-priority", "interactive").strip()
    gw = gateway(upstream_config(llama_server.url), env=env)
    assert chat(gw.url, key=low, priority="interactive", max_tokens=1).status_code == 200
    assert chat(gw.url, key=high, priority="interactive", max_tokens=1).status_code == 200
    assert chat(gw.url, key=high, priority="batch", max_tokens=1).status_code == 200
    assert chat(gw.url, key=high, priority="urgent", max_tokens=1).status_code == 400
    got = [(line["tenant"], line["priority"]) for line in gw.access_log() if line["cause"] == "ok"]
    assert got == [("bulk", "batch"), ("chat", "interactive"), ("chat", "batch")]


def test_usage_survives_kill_9(gateway, llama_server, tmp_path):
    env = {"PASSERELLE_STATE": str(tmp_path / "state")}
    gw = gateway(upstream_config(llama_server.url), env=env)
    for i in range(3):
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL_ID, "max_tokens": 3, "user": "carol", "messages": [{"role": "user", "content": f"{i}"}]})
        assert r.status_code == 200
    time.sleep(1.2)  # the contract: what completed more than one second before the kill is kept
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait(10)
    out = cli(env, "usage")
    row = next(line.split() for line in out.splitlines() if line.startswith("carol"))
    assert row[1] == "standard" and int(row[2]) == 3 and int(row[4]) == 9
