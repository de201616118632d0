"""A hostile runtime against a real gateway process (the fake runtime's scripted misbehaviours,
passerelle/testing/faults.py): every termination cause is produced here, and each test also checks
that a well-behaved client beside the hostile one was served and that the gateway's slots
(``/admin/stats`` running, ``passerelle_requests_running``), memory (RSS, and its peak from the
kernel's VmHWM) and file descriptors (``/proc/PID/fd``) came back to where they were.

``internal_error`` (a fault of the gateway itself) cannot be provoked from outside a correct
gateway; tests/unit/test_faults_inprocess.py produces it with a patched bug.

One gateway and its fakes serve the whole module (they start in a few seconds, not per test).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest

from passerelle.runtimes.supervisor import free_port
from tests.conftest import http_ok, wait_until

MiB = 1 << 20
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}
LIMITS = {"max_answer_bytes": 4 * MiB, "max_error_bytes": 64 * 1024, "max_event_bytes": 256 * 1024}


@dataclass
class Proc:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def _spawn(args: list[str], log: Path, url: str, ready: str, env: dict[str, str] | None = None) -> Proc:
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    p = Proc(url, proc, log)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"{args[3]} exited:\n{log.read_text()[-3000:]}")
        return http_ok(url + ready)

    wait_until(up, 60, what=f"{args[3]} to answer")
    return p


def _stop(p: Proc) -> None:
    if p.proc.poll() is None:
        p.proc.terminate()
        try:
            p.proc.wait(30)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait(10)


@dataclass
class Setup:
    gw: Proc
    fake: Proc
    fast: Proc

    def access_log(self) -> list[dict]:
        httpx.get(self.gw.url + "/health", timeout=5)  # (lines are flushed on the loop's next pass)
        return [orjson.loads(line) for line in self.gw.log.read_text().splitlines()
                if line.startswith("{") and '"request_id"' in line]

    def cause_of(self, request_id: str) -> str:
        line = wait_until(lambda: next((r for r in self.access_log() if r["request_id"] == request_id), None), 10,
                          what=f"the access log line of {request_id}")
        return line["cause"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("faults")
    py = [sys.executable, "-m", "passerelle"]
    port = free_port()
    fake = _spawn([*py, "fake-backend", "--port", str(port), "--ttft-ms", "5", "--itl-ms", "5", "--drip-ms", "50"],
                  tmp / "fake.log", f"http://127.0.0.1:{port}", "/health")
    port = free_port()
    fast = _spawn([*py, "fake-backend", "--port", str(port), "--ttft-ms", "0", "--itl-ms", "0"],
                  tmp / "fast.log", f"http://127.0.0.1:{port}", "/health")
    config = tmp / "gateway.toml"
    config.write_text(textwrap.dedent(f"""
        [timeouts]
        connect_s = 1
        first_token_s = 1.5
        between_tokens_s = 1.5
        total_s = 4
        client_write_s = 2

        [limits]
        max_answer_bytes = {LIMITS["max_answer_bytes"]}
        max_error_bytes = {LIMITS["max_error_bytes"]}
        max_event_bytes = {LIMITS["max_event_bytes"]}

        [[classes]]
        name = "standard"
        rank = 1
        max_queue = 1
        max_queue_wait_s = 1.0

        [[backends]]
        name = "fake"
        kind = "openai"
        url = "{fake.url}"
        models = ["fake-model"]
        max_concurrency = 8

        [[backends]]
        name = "one-slot"
        kind = "openai"
        url = "{fake.url}"
        models = ["one-slot-model"]
        max_concurrency = 1

        [[backends]]
        name = "fast"
        kind = "openai"
        url = "{fast.url}"
        models = ["fast-model"]
        max_concurrency = 4

        [[backends]]
        name = "dead"
        kind = "openai"
        url = "http://127.0.0.1:{free_port()}"
        models = ["dead-model"]
        """))
    port = free_port()
    gw = _spawn([*py, "serve", "--config", str(config), "--port", str(port)], tmp / "gateway.log",
                f"http://127.0.0.1:{port}", "/ready", env={"PASSERELLE_STATE": str(tmp / "state")})
    try:
        yield Setup(gw, fake, fast)
    finally:
        for p in (gw, fake, fast):
            _stop(p)


# -- what the gateway holds ------------------------------------------------------------------
def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def running(url: str) -> tuple[int, float]:
    """In-flight requests by /admin/stats, and by the passerelle_requests_running gauges."""
    stats = httpx.get(url + "/admin/stats", timeout=5).json()
    gauge = sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
                if line.startswith("passerelle_requests_running{"))
    return stats["running"], gauge


@contextlib.contextmanager
def back_to_baseline(s: Setup) -> Iterator[None]:
    """Around a test: slots, fds and RSS must come back to what they were; the peak RSS during the
    test (VmHWM, reset first) must stay far below what the runtime sent."""
    pid = s.gw.pid
    wait_until(lambda: running(s.gw.url) == (0, 0.0), 10, what="no request in flight before the test")
    base_fds, base_rss = fds(pid), _status(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak RSS starts again from now
    yield
    wait_until(lambda: running(s.gw.url) == (0, 0.0), 15, what="every slot back (admin stats and metrics)")
    wait_until(lambda: fds(pid) <= base_fds, 15, what=f"file descriptors back to {base_fds}")
    wait_until(lambda: _status(pid, "VmRSS") <= base_rss + 16 * MiB, 15, what="RSS back to its baseline")
    peak = _status(pid, "VmHWM") - base_rss
    assert peak < 40 * MiB, f"peak RSS grew by {peak / MiB:.0f} MiB during the test"


def fake_requests(s: Setup) -> int:
    return httpx.get(s.fake.url + "/fake/stats", timeout=5).json()["requests"]


def bystander(s: Setup, results: list, start_when: Callable[[], bool] | None) -> threading.Thread:
    """A well-behaved streaming request, run beside the hostile one once ``start_when`` holds."""
    def run() -> None:
        if start_when is not None:
            wait_until(start_when, 10, interval=0.01, what="the hostile request to reach the runtime")
        with httpx.Client(timeout=30) as c:
            r = c.post(s.gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
        results.append((r.status_code, "data: [DONE]" in r.text, s.cause_of(r.headers["x-request-id"])))

    t = threading.Thread(target=run)
    t.start()
    return t


def hostile(s: Setup, act: Callable[[], httpx.Response | str], *, reaches_runtime: bool = True
            ) -> httpx.Response | str:
    """Run ``act`` with a bystander beside it (sent once the fake has the hostile request, when it
    gets there), inside the baseline checks; ``act``'s result."""
    with back_to_baseline(s):
        results: list = []
        seen = fake_requests(s)
        t = bystander(s, results, (lambda: fake_requests(s) > seen) if reaches_runtime else None)
        out = act()
        t.join(30)
        assert results == [(200, True, "ok")], "the well-behaved client beside the hostile one was not served"
    return out


def post(s: Setup, body: dict, timeout: float = 30) -> httpx.Response:
    with httpx.Client(timeout=timeout) as c:
        return c.post(s.gw.url + "/v1/chat/completions", json=body)


def error(r: httpx.Response) -> dict:
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        data = [ln[5:].strip() for ln in r.text.splitlines() if ln.startswith("data:")]
        return orjson.loads(data[-1])["error"]
    return r.json()["error"]


# -- the runtime misbehaves ------------------------------------------------------------------
FAULTS = [
    # fault, stream, HTTP status, error code, cause, words of the message, seconds at most
    ("never-answer", True, 504, "upstream_timeout", "upstream_timeout", "first token", 3),
    ("never-answer", False, 504, "upstream_timeout", "upstream_timeout", "total", 6),
    ("continue-forever", False, 504, "upstream_timeout", "upstream_timeout", "total", 6),
    ("head-then-silence", True, 504, "upstream_timeout", "upstream_timeout", "first token", 3),
    ("drip", True, 200, "upstream_timeout", "upstream_timeout", "between tokens", 3),
    ("reset-mid-chunk", True, 200, "upstream_error", "upstream_error", "broke the stream", 2),
    ("huge-event", True, 200, "upstream_too_large", "upstream_error", "max_event_bytes", 5),
    ("huge-body", False, 502, "upstream_too_large", "upstream_error", "max_answer_bytes", 5),
    ("huge-error", False, 502, "upstream_too_large", "upstream_error", "max_error_bytes", 5),
    ("redirect", False, 502, "upstream_error", "upstream_error", "does not follow redirects", 2),
    ("html", False, 502, "upstream_error", "upstream_error", "not JSON", 2),
]


@pytest.mark.parametrize(("fault", "stream", "status", "code", "cause", "words", "within"), FAULTS,
                         ids=[f"{f[0]}-{'stream' if f[1] else 'json'}" for f in FAULTS])
def test_a_misbehaving_runtime_ends_the_request_with_its_cause(setup, fault, stream, status, code, cause, words,
                                                               within):
    start = time.monotonic()
    r = hostile(setup, lambda: post(setup, {**CHAT, "stream": stream, "fake_fault": fault}))
    assert isinstance(r, httpx.Response)
    assert r.status_code == status
    err = error(r)
    assert err["code"] == code and words in err["message"], err
    assert setup.cause_of(r.headers["x-request-id"]) == cause
    assert time.monotonic() - start < within + 5  # (the baseline checks take a moment too)


def test_events_after_done_are_dropped_and_a_runtime_idle_after_done_answered_in_full(setup):
    start = time.monotonic()
    r = hostile(setup, lambda: post(setup, {**CHAT, "stream": True, "fake_fault": "after-done"}))
    assert isinstance(r, httpx.Response) and r.status_code == 200
    assert r.text.rstrip().endswith("data: [DONE]") and "after" not in r.text
    assert setup.cause_of(r.headers["x-request-id"]) == "ok"
    assert time.monotonic() - start < 1.5 + 5  # not a between-tokens timeout after [DONE]


# -- the client misbehaves -------------------------------------------------------------------
def _raw_request(url: str, body: dict, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    data = orjson.dumps(body)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


def _request_id(head: bytes) -> str:
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"x-request-id:"):
            return line.split(b":", 1)[1].strip().decode()
    raise AssertionError(head[:500])


def test_a_client_that_stops_reading_is_cut_and_its_slot_comes_back(setup):
    def act() -> str:
        sock = _raw_request(setup.gw.url, {**CHAT, "model": "fast-model", "stream": True, "max_tokens": 200_000},
                            rcvbuf=4096)
        head = sock.recv(2048)  # the head and a little, then nothing more is read
        rid = _request_id(head)
        try:
            assert setup.cause_of(rid) == "client_timeout"
            # the gateway dropped the connection: what is left to read ends in a reset or EOF
            sock.settimeout(10)
            with contextlib.suppress(ConnectionResetError):
                while sock.recv(1 << 20):
                    pass
        finally:
            sock.close()
        return rid

    hostile(setup, act, reaches_runtime=False)  # (it goes to the other fake; it lasts seconds anyway)


def test_a_client_that_leaves_mid_stream(setup):
    def act() -> str:
        with httpx.Client(timeout=30) as c, c.stream("POST", setup.gw.url + "/v1/chat/completions",
                                                     json={**CHAT, "stream": True, "max_tokens": 300}) as r:
            rid = r.headers["x-request-id"]
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break
        assert setup.cause_of(rid) == "client_disconnect"
        return rid

    hostile(setup, act)


# -- the gateway says no ---------------------------------------------------------------------
def test_queue_full_and_queue_timeout_for_one_model_leave_the_others_alone(setup):
    def act() -> str:
        one = {**CHAT, "model": "one-slot-model", "stream": True, "max_tokens": 400}  # 2 s at 5 ms a token
        results: dict[str, httpx.Response] = {}
        threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, post(setup, one)))
                   for k in ("running", "queued")]
        threads[0].start()
        wait_until(lambda: running(setup.gw.url)[0] >= 1, 5, what="the first request to run")
        threads[1].start()
        wait_until(lambda: httpx.get(setup.gw.url + "/admin/stats", timeout=5).json()["totals"]["waiting"] == 1,
                   5, what="the second request to queue")
        full = post(setup, one)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        assert full.headers["retry-after"]
        for t in threads:
            t.join(30)
        assert results["queued"].status_code == 429 and results["queued"].json()["error"]["code"] == "queue_timeout"
        causes = {setup.cause_of(r.headers["x-request-id"]) for r in (full, results["queued"])}
        assert causes == {"queue_full", "queue_timeout"}
        # the first one was never disturbed: 400 tokens at 5 ms, within its 4 s
        assert setup.cause_of(results["running"].headers["x-request-id"]) == "ok"
        return ""

    hostile(setup, act)


@pytest.mark.parametrize(("body", "status", "code", "cause"), [
    ({"model": "fake-model"}, 400, "invalid_request", "invalid_request"),
    ({**CHAT, "model": "dead-model"}, 503, "no_backend", "no_backend"),
])
def test_requests_refused_before_any_runtime(setup, body, status, code, cause):
    r = hostile(setup, lambda: post(setup, body), reaches_runtime=False)
    assert isinstance(r, httpx.Response) and r.status_code == status and r.json()["error"]["code"] == code
    assert setup.cause_of(r.headers["x-request-id"]) == cause


def test_unauthorized_then_rate_limited_by_the_failed_key_throttle(gateway, fake_backend):
    fake = fake_backend(ttft_ms=1, itl_ms=1)
    gw = gateway(f"""
        [auth]
        required = true
        failed_attempts_per_minute = 2

        [[backends]]
        name = "b"
        kind = "openai"
        url = "{fake.url}"
        models = ["fake-model"]
        """)
    got = []
    for _ in range(3):
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer nope"},
                       timeout=10)
        got.append((r.status_code, gw.log_for(r.headers["x-request-id"])["cause"]))
    assert got == [(401, "unauthorized"), (401, "unauthorized"), (429, "rate_limited")]
