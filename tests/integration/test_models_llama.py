"""Several models on one box, with real llama-servers: swaps under a memory budget decided by the
scheduler, measured memory, and the model catalogue (aliases, rewrite, overrides, fallbacks).

The two models are different GGUFs: Gemma 3 270M (runtime "a", served as ``gemma-3-270m``, about
0.35 GiB once loaded, estimated 0.53 from its file) and the small random-weight Llama the tests
write (runtime "b", ``tiny-llama``, about 0.30 GiB, estimated 0.40); a 0.55 GiB budget holds one at
a time.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from passerelle.proxy.protocols import form_fields, form_parts
from passerelle.testing.tiny_llama_gguf import MODEL_ID as TINY_ID
from tests.conftest import MODEL_ID, free_port, wait_until
from tests.integration.test_replicas_llama import replica, runtimes

pytestmark = pytest.mark.llama

BUDGET = 0.55
NAMES = {"a": MODEL_ID, "b": TINY_ID}  # runtime -> the model it serves


def on_demand(binary, model, name: str, *, extra: str = "") -> str:
    return replica(name, binary, model, models=(NAMES[name],), extra=f"on_demand = true\n{extra}")


def two_models(binary, gemma, tiny) -> str:
    """Runtime "a" serves Gemma, "b" the tiny Llama, both on demand (2 slots, 4,096 tokens)."""
    return on_demand(binary, gemma, "a") + on_demand(binary, tiny, "b")


def admin(gw) -> dict:
    return httpx.get(gw.url + "/admin/runtimes", timeout=10).json()


def swaps(gw) -> list[dict]:
    return admin(gw)["swaps"]["recent"]


def stream_text(client, model: str, content: str, max_tokens: int = 6, **kw) -> str:
    chunks = list(client.chat.completions.create(model=model, max_tokens=max_tokens, stream=True,
                                                 messages=[{"role": "user", "content": content}], **kw))
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_alternating_bursts_swap_per_burst_and_never_under_a_stream(gateway, llama_paths, tiny_llama_path):
    binary, model = llama_paths
    gw = gateway(f"[runtimes]\nmax_loaded_gib = {BUDGET}\nmin_resident_s = 3\ndrain_timeout_s = 60\n"
                 + two_models(binary, model, tiny_llama_path))
    client = gw.openai()
    bursts, per_burst = 4, 3
    results: dict[str, list[str]] = {"one": [], "two": []}
    errors: list[BaseException] = []

    def user(name: str, order: tuple[str, str]) -> None:
        try:
            for i in range(bursts):
                target = NAMES[order[i % 2]]
                for j in range(per_burst):
                    results[name].append(stream_text(client, target, f"{name} burst {i} request {j}"))
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=user, args=("one", ("a", "b"))),
               threading.Thread(target=user, args=("two", ("b", "a")))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    # every request was served, none timed out in the queue
    assert len(results["one"]) == len(results["two"]) == bursts * per_burst
    log = gw.access_log()
    assert len(log) == 2 * bursts * per_burst and {r["cause"] for r in log} == {"ok"}
    state = admin(gw)
    done = state["swaps"]
    assert 1 <= done["swaps"] <= 2 * bursts  # at most one swap per burst
    events = swaps(gw)
    assert events and all(e["cut"] == 0 and not e["error"] for e in events)  # never stopped under a stream
    # the premise: measured, each fits the budget alone and not beside the other
    rows = {r["name"]: r for r in state["runtimes"]}
    measured = [rows[n]["measured_gib"] for n in ("a", "b")]
    assert all(m is not None and m <= BUDGET for m in measured) and sum(measured) > BUDGET
    # two different models: different files, footprints and served names
    assert abs(measured[0] - measured[1]) > 0.02 and rows["a"]["estimated_gib"] > rows["b"]["estimated_gib"]
    assert (rows["a"]["models"], rows["b"]["models"]) == ([MODEL_ID], [TINY_ID])
    metrics = httpx.get(gw.url + "/metrics").text
    assert "passerelle_swaps_total{" in metrics and 'passerelle_runtime_loaded{backend="a"}' in metrics


def test_a_start_deferred_for_memory_runs_as_soon_as_the_holder_goes_idle(gateway, llama_paths, tiny_llama_path):
    binary, model = llama_paths
    # a long residency: only the holder going idle can let b in
    gw = gateway(f"[runtimes]\nmax_loaded_gib = {BUDGET}\nmin_resident_s = 600\n"
                 + two_models(binary, model, tiny_llama_path))
    client = gw.openai()
    assert stream_text(client, MODEL_ID, "warm up", max_tokens=2) is not None
    ended: dict[str, float] = {}

    def long_stream() -> None:
        stream_text(client, MODEL_ID, "A long story", max_tokens=48, extra_body={"ignore_eos": True})
        ended["a"] = time.time()

    t = threading.Thread(target=long_stream)
    t.start()
    wait_until(lambda: runtimes(gw)["a"]["in_flight"] == 1, 30, what="a streaming")
    got: dict[str, object] = {}
    tb = threading.Thread(target=lambda: got.setdefault("b", stream_text(client, TINY_ID, "hello", max_tokens=2)))
    tb.start()
    wait_until(lambda: admin(gw)["swaps"]["waiting_for_load"].get("b") == 1, 30, what="b waiting for a load")
    assert runtimes(gw)["b"]["state"] == "stopped" and runtimes(gw)["a"]["in_flight"] == 1  # deferred
    t.join(300)
    tb.join(300)
    assert "b" in got
    event = swaps(gw)[0]
    assert (event["unloaded"], event["loaded"], event["reason"], event["cut"]) == (["a"], "b", "idle", 0)
    # retried on the release (after the idle grace), not when a's 600 s residency ran out
    assert event["at"] - ended["a"] < 30
    assert {r["state"] for r in runtimes(gw).values()} == {"stopped", "ready"}


def test_a_swap_lets_the_running_stream_finish_before_stopping_its_model(gateway, llama_paths, tiny_llama_path):
    binary, model = llama_paths
    gw = gateway(f"[runtimes]\nmax_loaded_gib = {BUDGET}\nmin_resident_s = 0\n"
                 + two_models(binary, model, tiny_llama_path))
    client = gw.openai()
    got: dict[str, object] = {}

    def long_stream() -> None:
        chunks = list(client.chat.completions.create(
            model=MODEL_ID, max_tokens=40, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "A long story"}], extra_body={"ignore_eos": True}))
        got["a"] = chunks[-1].usage.completion_tokens

    t = threading.Thread(target=long_stream)
    t.start()
    wait_until(lambda: runtimes(gw)["a"]["in_flight"] == 1, 60, what="a streaming")
    assert stream_text(client, TINY_ID, "hello", max_tokens=2)  # a is outranked: it drains, then b loads
    t.join(300)
    assert got["a"] == 40  # the stream ran to its end on the model being swapped out
    event = swaps(gw)[0]
    assert (event["unloaded"], event["loaded"], event["reason"], event["cut"]) == (["a"], "b", "outranked", 0)
    assert event["drain_s"] > 0
    b_line = next(r for r in gw.access_log() if r["model"] == TINY_ID)
    assert b_line["queue_ms"] / 1000 >= event["drain_s"]  # b waited for the drain


class Recorder(ThreadingHTTPServer):
    """A pass-through HTTP proxy in front of a real llama-server that keeps the request bodies it
    forwards, to see what the runtime received: JSON ones decoded in ``bodies``, every one as its
    (content type, bytes) in ``raw``."""

    daemon_threads = True

    def __init__(self, target: str) -> None:
        self.target = urlsplit(target)
        self.bodies: list[dict] = []
        self.raw: list[tuple[str, bytes]] = []
        super().__init__(("127.0.0.1", free_port()), _Forward)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Forward(BaseHTTPRequestHandler):
    server: Recorder
    protocol_version = "HTTP/1.1"

    def _forward(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        ctype = self.headers.get("Content-Type") or "application/json"
        if body:
            self.server.raw.append((ctype, body))
            if ctype.startswith("application/json"):
                self.server.bodies.append(json.loads(body))
        conn = http.client.HTTPConnection(self.server.target.hostname, self.server.target.port, timeout=120)
        conn.request(method, self.path, body=body or None, headers={"Content-Type": ctype})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.getheader("Content-Type") or "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._forward("GET")

    def do_POST(self) -> None:
        self._forward("POST")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def recorder(llama_server):
    rec = Recorder(llama_server.url)
    yield rec
    rec.shutdown()
    rec.server_close()


def test_aliases_rewrite_overrides_fallback_and_model_metadata(gateway, llama_server, recorder):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the "big" pool is down
    gw = gateway(f"""
[[backends]]
name = "small"
kind = "openai"
url = "{recorder.url}"
models = ["{MODEL_ID}"]
max_concurrency = 4

[[backends]]
name = "direct"
kind = "llama-server"
url = "{llama_server.url}"
models = ["{MODEL_ID}-direct"]
max_concurrency = 4

[[backends]]
name = "big"
kind = "openai"
url = "{dead}"
models = ["big-model"]

[[models]]
name = "chat"
aliases = ["gpt-4o*"]
served_name = "{MODEL_ID}"
cap = {{ max_tokens = 3 }}
set = {{ temperature = 0.25 }}
strip = ["logit_bias"]
context_length = 2048
capabilities = ["chat", "tools"]

[[models]]
name = "smart"
aliases = ["claude-*"]
served_name = "big-model"
fallbacks = ["chat"]

[[models]]
name = "direct"
served_name = "{MODEL_ID}-direct"
set = {{ top_k = 7 }}
""")
    client = gw.openai()
    resp = client.chat.completions.create(model="gpt-4o-mini", max_tokens=50, logit_bias={"1": 1},
                                          messages=[{"role": "user", "content": "Hello"}],
                                          extra_body={"ignore_eos": True})
    sent = recorder.bodies[-1]
    assert sent["model"] == MODEL_ID  # the runtime got its served name, not the alias
    assert sent["max_tokens"] == 3 and sent["temperature"] == 0.25 and "logit_bias" not in sent
    assert resp.usage.completion_tokens == 3  # the cap held at the runtime (ignore_eos would go on)
    # fallback: "smart"'s pool is down, so a claude-* request is served by "chat" (with chat's rules)
    n = len(recorder.bodies)
    assert stream_text(client, "claude-3-5-sonnet-latest", "Hi", max_tokens=20)
    assert len(recorder.bodies) == n + 1 and recorder.bodies[-1]["model"] == MODEL_ID
    assert recorder.bodies[-1]["max_tokens"] == 3
    lines = gw.access_log()
    assert [(r["model"], r["backend"], r["cause"]) for r in lines[-2:]] == [("chat", "small", "ok")] * 2
    # an override seen by llama-server itself: its last task's sampling parameters
    client.chat.completions.create(model="direct", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    params = [s["params"] for s in httpx.get(llama_server.url + "/slots").json() if "params" in s]
    assert any(p["top_k"] == 7 for p in params)
    # /v1/models and /v1/models/{id} through the official client
    assert [m.id for m in client.models.list()] == ["chat", "smart", "direct"]
    chat = client.models.retrieve("gpt-4o-2024-08-06")
    extra = chat.model_extra or {}
    assert chat.id == "chat" and extra["context_length"] == 2048 and extra["capabilities"] == ["chat", "tools"]
    assert extra["loaded"] is True and extra["routes"] == ["/v1/chat/completions", "/v1/completions",
                                                           "/v1/embeddings"]
    direct = client.models.retrieve("direct").model_extra or {}
    assert direct["context_length"] == 2048  # as llama-server reports it (slot n_ctx)
    # every route a llama-server model is served on, not only the classic three; not those its
    # runtime refuses (started without --embeddings or --reranking, a model without audio)
    assert direct["routes"] == ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                                "/v1/responses/input_tokens", "/v1/messages", "/v1/messages/count_tokens",
                                "/tokenize", "/detokenize", "/apply-template", "/infill"]
    listed = {m["id"]: m for m in httpx.get(gw.url + "/v1/models", timeout=10).json()["data"]}
    assert listed["direct"]["routes"] == direct["routes"] and listed["chat"]["routes"] == extra["routes"]
    # ... and routes beyond the classic three answer for it through the gateway
    tokens = httpx.post(gw.url + "/tokenize", json={"model": "direct", "content": "Hello"}, timeout=30)
    assert tokens.status_code == 200 and tokens.json()["tokens"]
    msg = gw.anthropic().messages.create(model="direct", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert msg.usage.output_tokens >= 1
    smart = client.models.retrieve("smart").model_extra or {}
    assert smart["loaded"] is False and smart["state"] == "down" and smart["fallbacks"] == ["chat"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nothing-like-this")


def test_an_alias_reaches_the_runtime_in_an_upload_with_only_its_model_field_changed(gateway, recorder):
    gw = gateway(f"""
[[backends]]
name = "speech"
kind = "llama-server"
url = "{recorder.url}"
models = ["{MODEL_ID}"]
endpoints = ["transcriptions"]  # declared: passed on as it is (Gemma's own 501 comes back)

[[models]]
name = "transcribe"
aliases = ["whisper-*"]
served_name = "{MODEL_ID}"
""")
    audio = b"RIFF" + bytes(range(256)) * 64 + b"\r\n--not-the-boundary\r\n" + b"\x00" * 3000
    files = {"file": ("a.wav", audio, "audio/wav")}
    r = httpx.post(gw.url + "/v1/audio/transcriptions", data={"model": "whisper-1", "language": "fr"}, files=files,
                   timeout=30)
    # llama-server got the form (its Gemma has no audio: its own 501 is passed on)
    assert r.status_code == 501 and "audio" in r.json()["error"]["message"]
    ctype, sent = recorder.raw[-1]
    assert form_fields(sent, ctype, ("model", "language")) == {"model": MODEL_ID, "language": "fr"}
    file_part = next(p for p in form_parts(sent, ctype) if p.is_file)
    assert sent[file_part.start:file_part.end] == audio  # the upload itself, byte for byte
    line = gw.log_for(r.headers["x-request-id"])
    assert (line["endpoint"], line["model"], line["backend"]) == ("transcriptions", "transcribe", "speech")
    # the public name and the served name pass as they are
    for name in ("transcribe", MODEL_ID):
        r = httpx.post(gw.url + "/v1/audio/transcriptions", data={"model": name}, files=files, timeout=30)
        assert r.status_code == 501
        ctype, sent = recorder.raw[-1]
        assert form_fields(sent, ctype, ("model",)) == {"model": MODEL_ID}
    r = httpx.post(gw.url + "/v1/audio/transcriptions", data={"model": "parakeet"}, files=files, timeout=30)
    assert r.status_code == 404 and "transcribe" in r.json()["error"]["message"]


def test_measured_memory_replaces_the_estimate_and_matches_rss(gateway, llama_paths):
    binary, model = llama_paths
    gw = gateway(f"[runtimes]\nmax_loaded_gib = {BUDGET}\n" + on_demand(binary, model, "a"))
    before = runtimes(gw)["a"]
    assert before["measured_gib"] is None and before["need_gib"] == before["estimated_gib"]
    assert stream_text(gw.openai(), MODEL_ID, "Hello", max_tokens=4)
    row = runtimes(gw)["a"]
    pid = row["pid"]
    rss = sum(int(line.split()[1]) * 1024 for p in [pid, *children(pid)]
              for line in open_status(p) if line.startswith("VmRSS:")) / 2**30
    assert row["measured_gib"] is not None and row["need_gib"] == row["measured_gib"]
    assert row["measured_gib"] != row["estimated_gib"]
    assert abs(row["measured_gib"] - rss) <= 0.2 * rss
    out = subprocess.run([sys.executable, "-m", "passerelle", "runtime", "list", "--url", gw.url],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "EST GiB" in out.stdout and "MEASURED" in out.stdout
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("a "))
    assert f"{row['estimated_gib']:.2f}" in line and f"{row['measured_gib']:.2f}" in line
    assert "memory budget" in out.stdout
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'passerelle_runtime_memory_bytes{backend="a",kind="measured"}' in metrics


NVIDIA_SMI = """#!/bin/sh
# A stand-in for nvidia-smi on a box without an NVIDIA GPU: one 8 GiB card, on which each
# llama-server its caller (the gateway) launched holds 3 GiB, or 1 GiB for the tiny Llama.
for pid in $(pgrep -P "$PPID" -x llama-server); do
  if grep -q tiny-llama "/proc/$pid/cmdline"; then mib=1024; else mib=3072; fi
  apps="$apps$pid, $mib
"
  used=$(( ${used:-500} + mib ))
done
case "$*" in
  *--query-compute-apps=pid,used_memory*) printf "%s" "$apps" ;;
  *--query-gpu=memory.used,memory.total*) echo "${used:-500}, 8192" ;;
  *) exit 2 ;;
esac
"""


def test_gpu_memory_from_nvidia_smi_is_counted_per_runtime_and_sizes_the_budget(gateway, llama_paths,
                                                                                tiny_llama_path, tmp_path):
    """The GPU path end to end: the gateway runs the ``nvidia-smi`` it finds on PATH (a script
    here, answering what the real one answers), reads the budget as a share of the card, and counts
    each runtime's own processes' GPU memory, found by pid in its process tree."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(NVIDIA_SMI)
    (tools / "nvidia-smi").chmod(0o755)
    gw = gateway('[runtimes]\nmax_loaded = "50%"\nmemory = "gpu"\n' + two_models(*llama_paths, tiny_llama_path),
                 env={"PATH": f"{tools}:{os.environ['PATH']}"})
    assert admin(gw)["budget"]["max_loaded_gib"] == 4.0  # 50 % of the card's 8 GiB
    client = gw.openai()
    assert stream_text(client, MODEL_ID, "Hello", max_tokens=2)
    assert stream_text(client, TINY_ID, "Hello", max_tokens=2)  # 3 GiB + 0.40 estimated: fits beside a
    rows = runtimes(gw)
    for name, gib in (("a", 3.0), ("b", 1.0)):
        row = rows[name]
        assert (row["memory_source"], row["gpu_gib"], row["measured_gib"], row["need_gib"]) == (
            "nvidia-smi", gib, gib, gib)  # memory = "gpu": the budget counts the card's memory
        assert 0.1 < row["rss_gib"] < 1  # RAM read from /proc as well, shown, not counted
    assert admin(gw)["budget"]["loaded_gib"] == 4.0
    metrics = httpx.get(gw.url + "/metrics").text.splitlines()
    gpu_b = next(x for x in metrics if x.startswith('passerelle_runtime_memory_bytes{backend="b",kind="gpu"}'))
    assert float(gpu_b.rsplit(" ", 1)[1]) == 2**30


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def open_status(pid: int) -> list[str]:
    with open(f"/proc/{pid}/status") as f:
        return f.read().splitlines()
