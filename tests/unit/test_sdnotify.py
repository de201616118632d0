"""systemd's notify protocol (server/sdnotify.py) over real datagram sockets: the address forms,
the environment taken out, and watchdog pings that stop while the event loop is stalled."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid

import pytest

from passerelle.server.sdnotify import Notifier, watchdog_interval
from tests.waiting import until


@pytest.fixture
def listener(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.settimeout(5)
    yield path, sock
    sock.close()


def drain(sock: socket.socket) -> list[str]:
    out = []
    sock.setblocking(False)
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def test_from_env_takes_the_variables_out_and_reads_the_watchdog():
    env = {"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid()), "A": "1"}
    n = Notifier.from_env(env)
    assert n is not None and n.address == "/run/x" and n.watchdog_s == 1.5
    n.close()
    assert env == {"A": "1"}  # the runtimes the gateway launches never see them
    assert Notifier.from_env({}) is None
    assert Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1"}) is None


def test_the_watchdog_is_for_this_process_only():
    assert watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "nope"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "1000000"}) == 0.5


def test_abstract_namespace_address():
    name = f"passerelle-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        n = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert n is not None
        n.ready("serving")
        fields = sock.recv(4096).decode().split("\n")
        assert fields[0] == "READY=1" and "STATUS=serving" in fields and f"MAINPID={os.getpid()}" in fields
        n.close()
    finally:
        sock.close()


def test_a_reload_says_ready_again_only_once_ready_was_said(listener):
    path, sock = listener
    n = Notifier(path)
    n.reloading()
    n.reloaded("waiting")
    first = sock.recv(4096).decode().split("\n")
    assert first[0] == "RELOADING=1" and any(f.startswith("MONOTONIC_USEC=") for f in first)
    assert sock.recv(4096).decode() == "STATUS=waiting"  # still starting: no READY=1 yet
    n.ready("up")
    sock.recv(4096)
    n.reloaded("up")
    assert sock.recv(4096).decode() == "READY=1\nSTATUS=up"
    n.close()


def test_a_manager_gone_is_not_an_error(tmp_path):
    n = Notifier(str(tmp_path / "nobody"))
    assert n.send("READY=1") is False  # logged once, the gateway goes on
    n.close()


def test_watchdog_pings_stop_while_the_loop_is_stalled(listener):
    path, sock = listener

    async def main() -> int:
        n = Notifier(path, watchdog_s=0.02)
        n.start_watchdog()
        await until(lambda: drain(sock), 10, "a first ping", interval=0.01)
        time.sleep(0.3)  # the loop stalls (a blocking call): 15 intervals without a ping
        during = len(drain(sock))
        await until(lambda: drain(sock), 10, "pings again once the loop runs", interval=0.01)
        n.close()
        return during

    assert asyncio.run(main()) == 0
