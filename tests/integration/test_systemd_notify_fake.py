"""A real gateway process under a notify socket the test binds, as systemd would (Type=notify,
WatchdogSec=): READY=1 only once /ready is 200, watchdog pings at WATCHDOG_USEC/2, SIGHUP answered
with RELOADING=1 then READY=1, SIGTERM with STOPPING=1."""

from __future__ import annotations

import itertools
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from passerelle.runtimes.supervisor import free_port
from tests.conftest import http_ok, upstream_config, wait_until

MODEL = "fake-model"


class NotifySocket:
    """A datagram socket bound like systemd's, recording each message and when it came."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, list[str]]] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            with self._lock:
                self.messages.append((time.monotonic(), data.decode().split("\n")))

    def having(self, field: str) -> list[tuple[float, list[str]]]:
        with self._lock:
            return [m for m in self.messages if field in m[1]]

    def fields(self) -> list[str]:
        with self._lock:
            return [f for _, fs in self.messages for f in fs]

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def notify(tmp_path):
    made: list[NotifySocket] = []

    def bind(address: str | bytes) -> NotifySocket:
        made.append(NotifySocket(address))
        return made[-1]

    yield bind
    for n in made:
        n.close()


def process_state(pid: int) -> str:
    """The state letter of /proc/PID/stat: ``T`` once a SIGSTOP has taken effect."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def start_fake(port: int, tmp_path) -> subprocess.Popen:
    log = open(tmp_path / "fake.log", "wb")  # noqa: SIM115  (closed with the process below)
    proc = subprocess.Popen([sys.executable, "-m", "passerelle", "fake-backend", "--port", str(port),
                             "--ttft-ms", "5", "--itl-ms", "1"], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return proc


def test_ready_watchdog_reload_and_stop_over_a_notify_socket(gateway, notify, tmp_path):
    ns = notify(str(tmp_path / "notify.sock"))
    port = free_port()
    # the runtime is not up yet: the gateway listens, /ready is 503, systemd must not hear READY
    gw = gateway(upstream_config(f"http://127.0.0.1:{port}", model=MODEL, kind="openai"), wait_ready=False,
                 env={"NOTIFY_SOCKET": ns.sock.getsockname(), "WATCHDOG_USEC": "300000"})
    wait_until(lambda: "STATUS=waiting for a backend to come up" in ns.fields(), 30, what="STATUS while waiting")
    assert httpx.get(gw.url + "/ready", timeout=5).status_code == 503
    assert not ns.having("READY=1")
    fake = start_fake(port, tmp_path)
    try:
        ready = wait_until(lambda: ns.having("READY=1"), 60, what="READY=1")
        assert httpx.get(gw.url + "/ready", timeout=5).status_code == 200
        assert any(f.startswith("STATUS=serving on ") for f in ready[0][1])
        assert f"MAINPID={gw.proc.pid}" in ready[0][1]

        # pings every WATCHDOG_USEC/2 = 0.15 s from the event loop
        pings = wait_until(lambda: (p := ns.having("WATCHDOG=1")) and len(p) >= 6 and p, 30, what="6 pings")
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(pings)]
        assert min(gaps) > 0.1, gaps  # never faster than asked (a slow machine may be slower)

        # a stopped process stops pinging: that is what lets systemd restart a hung gateway. Waited
        # for as systemd sees it: its watchdog fires once no ping came for WatchdogSec (0.3 s); here,
        # for twice that. A process that went on pinging would never let it fire.
        gw.proc.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: process_state(gw.proc.pid) == "T", 10, "the gateway stopped", interval=0.01)
            wait_until(lambda: time.monotonic() - ns.having("WATCHDOG=1")[-1][0] > 0.6, 10,
                       "the watchdog to fire: no ping for 2 x WatchdogSec", interval=0.01)
            n = len(ns.having("WATCHDOG=1"))
        finally:
            gw.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: len(ns.having("WATCHDOG=1")) > n, 30, what="pings again after SIGCONT")

        # SIGHUP: RELOADING=1, then READY=1 again
        seen = len(ns.messages)
        gw.proc.send_signal(signal.SIGHUP)

        def since_hup() -> list[list[str]]:
            return [fs for _, fs in ns.messages[seen:] if "WATCHDOG=1" not in fs]

        wait_until(lambda: any("READY=1" in fs for fs in since_hup()), 30, what="READY=1 after SIGHUP")
        after = since_hup()
        assert "RELOADING=1" in after[0] and any(f.startswith("MONOTONIC_USEC=") for f in after[0]), after
        assert "READY=1" in after[1], after
        assert "configuration reloaded" in gw.log_text()
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=10, json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200

        # SIGTERM: STOPPING=1, then a clean exit
        assert gw.stop() == 0
        assert ns.having("STOPPING=1")
    finally:
        fake.kill()
        fake.wait(10)


def test_ready_over_an_abstract_socket(gateway, fake_backend, notify):
    name = f"passerelle-test-{uuid.uuid4().hex}"
    ns = notify(b"\0" + name.encode())
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(upstream_config(fake.url, model=MODEL, kind="openai"), env={"NOTIFY_SOCKET": "@" + name})
    wait_until(lambda: ns.having("READY=1"), 30, what="READY=1 on @" + name)
    assert http_ok(gw.url + "/ready")
    assert not ns.having("WATCHDOG=1")  # no WATCHDOG_USEC: no pings
