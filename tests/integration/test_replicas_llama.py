"""Supervised replicas of a real llama-server: spreading, failover, affinity, on-demand, reload."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from tests.conftest import MODEL_ID, wait_until
from tests.integration.test_gateway_llama import pid_alive

pytestmark = pytest.mark.llama


def replica(name: str, binary, model, *, models=(MODEL_ID,), extra: str = "", slots: int = 2) -> str:
    quoted = ", ".join(f'"{m}"' for m in models)
    return f"""
[[backends]]
name = "{name}"
kind = "llama-server"
launch = ["{binary}", "-m", "{model}", "--alias", "{models[0]}", "--port", "{{port}}", "-np", "{slots}",
          "-c", "{slots * 2048}", "--metrics", "--slots", "--no-webui", "-t", "1"]
models = [{quoted}]
max_concurrency = {slots}
{extra}
"""


def runtimes(gw) -> dict[str, dict]:
    return {r["name"]: r for r in httpx.get(gw.url + "/admin/runtimes").json()["runtimes"]}


def cli(gw, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "passerelle", *args, "--url", gw.url], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def two(gateway, llama_paths):
    binary, model = llama_paths
    return gateway(replica("r1", binary, model) + replica("r2", binary, model))


def ask(gw, opening: str, max_tokens: int = 4, **kw):
    return gw.openai().chat.completions.create(model=MODEL_ID, max_tokens=max_tokens,
                                              messages=[{"role": "user", "content": opening}], **kw)


def test_load_spreads_over_replicas(two):
    threads = [threading.Thread(target=ask, args=(two, f"Conversation number {i}")) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    used = {line["backend"] for line in two.access_log() if line["cause"] == "ok"}
    assert used == {"r1", "r2"}


def test_prefix_affinity_keeps_a_conversation_on_one_replica_and_reuses_its_cache(two):
    messages = [{"role": "system", "content": "You are a patient storyteller who likes lighthouses. " * 8},
                {"role": "user", "content": "Tell me about the keeper."}]
    cached = []
    for turn in range(3):
        r = httpx.post(two.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL_ID, "max_tokens": 6, "messages": messages})
        assert r.status_code == 200
        cached.append(r.json()["timings"]["cache_n"])
        messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"And then? ({turn})"}]
        # other conversations in between push the load around
        ask(two, f"Unrelated question {turn}")
    lines = [line for line in two.access_log() if line["prompt_tokens"] and line["prompt_tokens"] > 60]
    assert len({line["backend"] for line in lines}) == 1
    assert cached[1] > 50 and cached[2] > 50  # llama-server reused the conversation's prompt cache


def test_killing_a_replica_loses_no_request_that_had_not_started(two):
    victim = runtimes(two)["r1"]["pid"]
    results: list[str] = []

    def one(i: int) -> None:
        try:
            stream = ask(two, f"Long story {i}", max_tokens=64, stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                pass
            results.append("ok")
        except openai.APIError:
            results.append("error")

    first = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in first:
        t.start()
    wait_until(lambda: runtimes(two)["r1"]["in_flight"] >= 1, 20, what="r1 busy")
    os.kill(victim, signal.SIGKILL)
    # requests that arrive now are all served: by r2, or retried there after r1 refused them
    later = [ask(two, f"After the crash {i}", max_tokens=2) for i in range(6)]
    assert all(r.choices for r in later)
    for t in first:
        t.join(120)
    assert results.count("ok") + results.count("error") == 4
    broken = [line for line in two.access_log() if line["cause"] == "upstream_error"]
    assert all(line["backend"] == "r1" for line in broken)  # only streams r1 held, with the error event
    wait_until(lambda: runtimes(two)["r1"]["restarts"] == 1 and runtimes(two)["r1"]["up"], 60,
               what="r1 restarted and back")
    assert runtimes(two)["r1"]["pid"] != victim


def test_runtime_commands(two):
    out = cli(two, "runtime", "list")
    assert out.returncode == 0 and "r1" in out.stdout and "ready" in out.stdout
    assert cli(two, "runtime", "stop", "r2").returncode == 0
    assert runtimes(two)["r2"]["state"] == "stopped"
    assert all(ask(two, f"while r2 is stopped {i}").choices for i in range(3))
    assert cli(two, "runtime", "start", "r2").returncode == 0
    assert runtimes(two)["r2"]["state"] == "ready"
    old = runtimes(two)["r1"]["pid"]
    assert cli(two, "runtime", "restart", "r1").returncode == 0
    assert runtimes(two)["r1"]["pid"] != old
    logs = cli(two, "runtime", "logs", "r1", "--lines", "50")
    assert logs.returncode == 0 and "llama" in logs.stdout.lower()
    bad = cli(two, "runtime", "stop", "nope")
    assert bad.returncode == 1 and "No runtime" in bad.stderr


def test_on_demand_start_idle_stop_and_memory_budget(gateway, llama_paths, tiny_llama_path):
    binary, model = llama_paths
    od = 'on_demand = true\nidle_ttl_s = 4\nmemory_gib = 1.0'
    gw = gateway("[runtimes]\nmax_loaded_gib = 1.5\n"  # two different models (Gemma, the tiny Llama)
                 + replica("a", binary, model, models=("model-a",), extra=od)
                 + replica("b", binary, tiny_llama_path, models=("model-b",), extra=od))
    assert {r["state"] for r in runtimes(gw).values()} == {"stopped"}
    client = gw.openai()
    # three requests at once for a stopped model: one start, all served
    threads = [threading.Thread(target=client.completions.create,
                                kwargs={"model": "model-a", "prompt": f"Hi {i}", "max_tokens": 2}) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert runtimes(gw)["a"]["state"] == "ready" and runtimes(gw)["a"]["restarts"] == 0
    assert "=== " in httpx.get(gw.url + "/admin/runtimes/a/logs").text
    assert httpx.get(gw.url + "/admin/runtimes/a/logs").text.count("=== ") == 1  # launched once
    waited = [line["queue_ms"] for line in gw.access_log() if line["model"] == "model-a"]
    assert len(waited) == 3 and max(waited) > 100  # the start shows as queue wait
    # model-b does not fit beside model-a: the idle least recently used runtime makes room
    assert client.completions.create(model="model-b", prompt="Hi", max_tokens=2).choices
    states = {n: r["state"] for n, r in runtimes(gw).items()}
    assert states == {"a": "stopped", "b": "ready"}
    wait_until(lambda: runtimes(gw)["b"]["state"] == "stopped", 15, what="idle stop after idle_ttl_s")
    assert 'queue_wait_seconds_count{model="model-b"' in httpx.get(gw.url + "/metrics").text


def test_reload_adds_and_drains_without_dropping_a_stream(gateway, llama_paths):
    binary, model = llama_paths
    first = replica("r1", binary, model)
    gw = gateway(first)
    done: dict = {}

    def long_stream() -> None:
        chunks = list(ask(gw, "A long story", max_tokens=64, stream=True, extra_body={"ignore_eos": True}))
        done["finish"] = chunks[-1].choices[0].finish_reason

    t = threading.Thread(target=long_stream)
    t.start()
    wait_until(lambda: runtimes(gw)["r1"]["in_flight"] == 1, 20, what="stream running")
    gw.extra["config"].write_text(first + replica("r2", binary, model))
    out = cli(gw, "reload")
    assert out.returncode == 0 and '"added":["r2"]' in out.stdout.replace(" ", "")
    wait_until(lambda: runtimes(gw).get("r2", {}).get("state") == "ready", 60, what="r2 started")
    t.join(120)
    assert done["finish"] == "length"  # the stream on the unchanged backend went on
    r2_pid = runtimes(gw)["r2"]["pid"]
    gw.extra["config"].write_text(first)
    gw.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "r2" not in runtimes(gw), 30, what="r2 drained and stopped")
    wait_until(lambda: not pid_alive(r2_pid), 10, what="r2 process gone")
    assert ask(gw, "still serving").choices
    gw.extra["config"].write_text("[server\nbroken")
    bad = cli(gw, "reload")
    assert bad.returncode == 1 and "Reload refused" in bad.stderr
    assert ask(gw, "still serving after a bad reload").choices
