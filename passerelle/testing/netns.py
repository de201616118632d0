"""Boxes that are network namespaces: several machines' worth of addresses on one machine, for the
tests and benchmarks of passerelle over several boxes.

A :class:`Network` makes a bridge in the calling (root) namespace with the address ``.1`` of a
private /24, and each :class:`Box` a namespace joined to the bridge by a veth pair, with the
address ``.2``, ``.3``, … and its own loopback up. The gateway the team uses runs in the root
namespace and reaches every box at its address; boxes reach each other over the bridge. Traffic
stays on those addresses. Everything is removed on :meth:`Network.close` (and so at the end of a
``with`` block): the processes started in the boxes first, then the links, then the namespaces.

Needs root (``CAP_NET_ADMIN``) and ``ip`` (iproute2); :func:`available` says whether both are here.

Example::

    with Network("pb", boxes=2) as net:
        a, b = net.boxes
        proc = a.popen(["python", "-m", "http.server", "--bind", a.address, "8000"])
        b.link_down()          # the box's cable pulled: its address no longer answers
        b.link_up()
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=10)


def available() -> str:
    """'' when namespaces can be made here; else why not (for a test's skip or failure message)."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"pbprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


class Box:
    """One namespace: its name, its address on the bridge, and the processes started in it."""

    def __init__(self, network: Network, index: int) -> None:
        self.network = network
        self.index = index
        self.name = f"{network.prefix}{index}"
        self.address = f"{network.subnet}.{index + 2}"
        self.host_veth = f"{network.prefix}h{index}"  # the root namespace's end, on the bridge
        self.procs: list[subprocess.Popen[bytes]] = []

    def create(self) -> None:
        n = self.network
        _ip("netns", "add", self.name)
        _ip("link", "add", self.host_veth, "type", "veth", "peer", "name", "eth0", "netns", self.name)
        _ip("link", "set", self.host_veth, "master", n.bridge)
        _ip("link", "set", self.host_veth, "up")
        self.exec_ip("addr", "add", f"{self.address}/24", "dev", "eth0")
        self.exec_ip("link", "set", "eth0", "up")
        self.exec_ip("link", "set", "lo", "up")

    def exec_ip(self, *args: str) -> None:
        _ip("-n", self.name, *args)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this box."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: Sequence[str], *, stdout: IO[Any] | int | None = None,
              stderr: IO[Any] | int | None = subprocess.STDOUT, env: dict[str, str] | None = None,
              cwd: str | Path | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` in this box, in a process group of its own (so :meth:`kill` takes its
        children too); it is killed when the network closes.

        Not in a session of its own: on Linux a new session is a new scheduler autogroup, and a
        box whose runtime computes flat out then took the CPU from every other process (the team's
        gateway, the other boxes, the test) for seconds at a time, as the supervisor's runtimes
        would (runtimes/supervisor.py)."""
        proc = subprocess.Popen(self.command(argv), stdout=stdout, stderr=stderr, env=env, cwd=cwd,
                                process_group=0)
        self.procs.append(proc)
        return proc

    def link_down(self) -> None:
        """Pull the box's cable: its address stops answering (connections hang, no reset)."""
        _ip("link", "set", self.host_veth, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.host_veth, "up")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Every process started in the box gets ``sig`` (the box lost: a power cut by default)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            for proc in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
            self.procs = [p for p in self.procs if p.poll() is None]

    def remove(self) -> None:
        self.kill()
        _ip("link", "del", self.host_veth, check=False)
        _ip("netns", "del", self.name, check=False)


class Network:
    """A bridge and ``boxes`` namespaces on it. ``prefix`` names them (kept short: interface names
    have at most 15 characters); the /24 is chosen from the process id so that two runs at once do
    not collide."""

    def __init__(self, prefix: str = "pb", boxes: int = 2, subnet: str | None = None) -> None:
        tag = os.getpid() % 10000
        self.prefix = f"{prefix}{tag}x"
        self.bridge = f"{self.prefix}br"
        self.subnet = subnet or f"10.{200 + tag % 50}.{tag % 250}"
        self.address = f"{self.subnet}.1"  # the root namespace (the team's gateway) on the bridge
        self.boxes = [Box(self, i) for i in range(boxes)]

    def __enter__(self) -> Network:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for box in self.boxes:
                box.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for box in self.boxes:
            box.remove()
        _ip("link", "del", self.bridge, check=False)
