"""A process's TCP connections as the kernel shows them (``/proc``), and keepalive set on them from
outside: how a split's head is watched (runtimes/rpc.py) without touching llama.cpp.

    connections(pid)            its IPv4 and IPv6 connections: peer, state, unanswered
                                retransmissions and keepalive probes, socket inode
    arm_keepalive(pid, inodes)  SO_KEEPALIVE on those sockets, with short timers

Why keepalive: a head that sends nothing (no request in flight) to a member whose cable was
pulled has no data to retransmit, so nothing in ``/proc`` changes until its next request. With
keepalive on, the kernel probes the idle connection every ``interval_s``; a member that does not
answer shows as probes counting up (``probes``), and one that answers keeps it at 0. The socket
is reached through ``pidfd_getfd(2)`` (Linux 5.6): a copy of the head's descriptor in this
process, set and closed at once (closing the copy leaves the head's socket open). It needs the
right to trace the head, which the supervisor that launched it has (same user, its parent); where
it is refused, the watch goes on without it.

Example::

    conns = connections(pid)                               # [Conn(remote="0200000A:C3D4", ...)]
    armed = arm_keepalive(pid, {c.inode for c in conns})   # the inodes now probed when idle
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

_SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture (the unified syscall table)
KEEPALIVE_IDLE_S = 1  # idle time before the first probe
KEEPALIVE_INTERVAL_S = 1  # between probes
KEEPALIVE_COUNT = 8  # unanswered probes before the kernel itself gives up (the watch decides sooner)


@dataclass(frozen=True)
class Conn:
    remote: str  # /proc's hex ip:port
    state: str
    retransmits: int  # unanswered retransmissions of data in flight
    inode: str
    probes: int = 0  # keepalive (or zero-window) probes sent and not answered yet


def hex_address(ip: str, port: int) -> str | None:
    """``ip:port`` as /proc/net/tcp (IPv4) or tcp6 (IPv6) writes it: the address as 32-bit words,
    each in the host's byte order, then the port."""
    try:
        packed = ipaddress.ip_address(ip).packed
    except ValueError:
        return None
    words = "".join(f"{int.from_bytes(packed[i:i + 4], sys.byteorder):08X}" for i in range(0, len(packed), 4))
    return f"{words}:{port:04X}"


def socket_fds(pid: int, proc: Path = Path("/proc")) -> dict[str, int]:
    """The sockets process ``pid`` holds: inode → its descriptor number there."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for fd in (proc / str(pid) / "fd").iterdir():
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    out[target[8:-1]] = int(fd.name)
    return out


def parse_tcp_table(text: str) -> list[Conn]:
    """The rows of /proc/<pid>/net/tcp or tcp6 (columns: net/ipv4/tcp_ipv4.c get_tcp4_sock)."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) >= 10:
            out.append(Conn(remote=f[2].upper(), state=f[3].upper(), retransmits=int(f[6], 16), inode=f[9],
                            probes=int(f[8]) if f[8].isdigit() else 0))
    return out


def connections(pid: int, proc: Path = Path("/proc")) -> list[Conn]:
    """The TCP connections process ``pid`` holds (IPv4 and IPv6)."""
    inodes = socket_fds(pid, proc)
    out: list[Conn] = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):  # (a kernel without IPv6 has no tcp6)
            out += [c for c in parse_tcp_table((proc / str(pid) / "net" / table).read_text()) if c.inode in inodes]
    return out


def arm_keepalive(pid: int, inodes: set[str], proc: Path = Path("/proc")) -> set[str]:
    """Keepalive on process ``pid``'s sockets with these inodes (idle 1 s, then a probe every
    second); returns the inodes armed. OSError when the kernel refuses (no pidfd_getfd, or no
    right to trace ``pid``): the caller watches without it."""
    fds = {inode: fd for inode, fd in socket_fds(pid, proc).items() if inode in inodes}
    if not fds:
        return set()
    libc = ctypes.CDLL(None, use_errno=True)
    armed: set[str] = set()
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return armed  # (it exited meanwhile: nothing to arm, nothing refused)
    try:
        for inode, fd in fds.items():
            copy = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
            if copy < 0:
                err = ctypes.get_errno()
                if err == errno.EBADF:
                    continue  # (race: it closed that socket since it was listed)
                raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
            try:
                s = socket.socket(fileno=copy)
            except OSError:
                os.close(copy)  # (not a socket after all: the copy is still ours to close)
                raise
            with s:  # (closing the copy leaves the head's socket open)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
            armed.add(inode)
    finally:
        os.close(pidfd)
    return armed
