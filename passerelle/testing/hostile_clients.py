"""Clients written to abuse a gateway, and a probe of what the abuse costs the gateway's process.

Used by ``tests/integration/test_hostile_clients.py`` (pass/fail) and ``bench/hostile_clients.py``
(figures before and after a change). Everything is plain blocking sockets on loopback, so an attack
is exactly the bytes written here, whatever HTTP library the tests also use.

    probe = Probe(gateway_pid, gateway_port, upstream_ports={fake_port})
    base = probe.sample()
    socks = open_idle(("127.0.0.1", gateway_port), 300)
    ...
    close_all(socks)
    probe.wait_fds(base.fds, timeout=10)   # the gateway's own sockets are back where they were

The probe counts the gateway's file descriptors except its sockets to the runtimes (the upstream
pool opens and closes those on its own schedule), so "back to baseline" can be asserted exactly.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import orjson

Addr = tuple[str, int]
CHAT = "/v1/chat/completions"


# --- what the gateway's process holds ---------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    rss_kib: int
    cpu_s: float  # user + system, since the process started
    fds: int  # open file descriptors, sockets to the runtimes excluded
    t: float  # time.monotonic() of the sample


def _socket_inodes_to(pid: int, remote_ports: set[int]) -> set[str]:
    """Inodes of ``pid``'s TCP sockets whose peer port is one of ``remote_ports``."""
    out: set[str] = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) > 9 and int(parts[2].rsplit(":", 1)[1], 16) in remote_ports:
                    out.add(parts[9])
    return out


class Probe:
    """Memory, CPU time and file descriptors of one process (Linux ``/proc``)."""

    def __init__(self, pid: int, upstream_ports: Iterable[int] = ()) -> None:
        self.pid = pid
        self.upstream_ports = set(upstream_ports)
        self._tick = os.sysconf("SC_CLK_TCK")

    def rss_kib(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError(f"no VmRSS for {self.pid}")

    def cpu_s(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime, stime

    def fds(self) -> int:
        upstream = _socket_inodes_to(self.pid, self.upstream_ports) if self.upstream_ports else set()
        n = 0
        for name in os.listdir(f"/proc/{self.pid}/fd"):
            try:
                target = os.readlink(f"/proc/{self.pid}/fd/{name}")
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:[") and target[8:-1] in upstream:
                continue
            n += 1
        return n

    def sample(self) -> Sample:
        return Sample(self.rss_kib(), self.cpu_s(), self.fds(), time.monotonic())

    def wait_fds(self, target: int, timeout: float) -> float:
        """Seconds until the descriptor count is ``target`` again; AssertionError after ``timeout``."""
        start = time.monotonic()
        while True:
            now = self.fds()
            if now == target:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(f"the gateway holds {now} file descriptors {timeout:g} s later, "
                                     f"not its baseline {target}")
            time.sleep(0.05)


class PeakRss:
    """Samples a process's RSS every 20 ms in a thread; ``peak_kib`` is the highest seen."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.peak_kib = probe.rss_kib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(OSError, RuntimeError):
                self.peak_kib = max(self.peak_kib, self.probe.rss_kib())

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# --- raw HTTP -----------------------------------------------------------------------------------
def connect(addr: Addr, timeout: float = 5.0) -> socket.socket:
    s = socket.create_connection(addr, timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def head(method: str, path: str, headers: dict[str, str] | None = None, host: str = "gateway") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chat_body(model: str, *, stream: bool = False, max_tokens: int = 4, user: str | None = None,
              **extra: object) -> bytes:
    body: dict[str, object] = {"model": model, "max_tokens": max_tokens, "stream": stream,
                               "messages": [{"role": "user", "content": "hello"}], **extra}
    if user is not None:
        body["user"] = user
    return orjson.dumps(body)


def post(addr: Addr, path: str, body: bytes, headers: dict[str, str] | None = None, timeout: float = 30.0) -> bytes:
    """One request on a fresh connection (``Connection: close``); the raw response, read to the end."""
    with connect(addr, timeout) as s:
        h = {"Content-Type": "application/json", "Content-Length": str(len(body)), "Connection": "close",
             **(headers or {})}
        s.sendall(head("POST", path, h) + body)
        return read_to_close(s, timeout)


def read_to_close(s: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes (or ``timeout``); a reset ends the read too."""
    s.settimeout(timeout)
    out = bytearray()
    deadline = time.monotonic() + timeout
    with contextlib.suppress(ConnectionError, TimeoutError):
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    return bytes(out)


def status_of(raw: bytes) -> int:
    """The status code of a raw HTTP response (0 when there is none)."""
    if not raw.startswith(b"HTTP/1."):
        return 0
    return int(raw.split(b" ", 2)[1])


def body_of(raw: bytes) -> bytes:
    return raw.partition(b"\r\n\r\n")[2]


def closed_by_peer(s: socket.socket, timeout: float) -> tuple[bool, bytes]:
    """(True, what it sent) once the server closed ``s``; (False, what it sent) after ``timeout``."""
    s.settimeout(0.2)
    out = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionError:
            return True, bytes(out)
        if not chunk:
            return True, bytes(out)
        out += chunk
    return False, bytes(out)


def close_all(socks: Iterable[socket.socket]) -> None:
    for s in socks:
        with contextlib.suppress(OSError):
            s.close()


def wait_all_closed(socks: list[socket.socket], timeout: float) -> tuple[int, list[bytes]]:
    """Read all of ``socks`` at once until the server has closed every one or ``timeout`` passed;
    (how many it closed, what each received)."""
    got = [bytearray() for _ in socks]
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    closed = 0
    deadline = time.monotonic() + timeout
    while closed < len(socks) and (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(min(left, 0.2)):
            i = key.data
            try:
                chunk = socks[i].recv(65536)
            except BlockingIOError:
                continue
            except ConnectionError:
                chunk = b""
            if chunk:
                got[i] += chunk
            else:
                closed += 1
                sel.unregister(socks[i])
    sel.close()
    for s in socks:
        with contextlib.suppress(OSError):
            s.setblocking(True)
    return closed, [bytes(g) for g in got]


# --- attacks ------------------------------------------------------------------------------------
def open_idle(addr: Addr, n: int) -> list[socket.socket]:
    """``n`` connections that never send a byte."""
    out = []
    for _ in range(n):
        try:
            out.append(connect(addr))
        except OSError:
            break
    return out


class Trickle:
    """Keeps writing ``step`` to every socket every ``interval`` seconds, in a thread, until
    stopped or until the server closes them (slowloris). Sockets the server closed are counted."""

    def __init__(self, socks: list[socket.socket], step: bytes, interval: float) -> None:
        self.socks, self.step, self.interval = socks, step, interval
        self.refused: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for i, s in enumerate(self.socks):
                if i in self.refused:
                    continue
                try:
                    s.send(self.step)
                except OSError:
                    self.refused.add(i)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def slow_heads(addr: Addr, n: int, interval: float = 0.5) -> tuple[list[socket.socket], Trickle]:
    """``n`` connections sending a request head one header byte every ``interval`` seconds."""
    socks = open_idle(addr, n)
    start = head("POST", CHAT, {"Content-Type": "application/json"})[:-2]  # no blank line: never ends
    for s in socks:
        s.sendall(start)
    return socks, Trickle(socks, b"X", interval)


def slow_bodies(addr: Addr, n: int, *, declared: int, sent: int, headers: dict[str, str] | None = None,
                path: str = CHAT) -> list[socket.socket]:
    """``n`` connections that announce a ``declared``-byte body, send ``sent`` bytes, then go silent."""
    socks = open_idle(addr, n)
    h = head("POST", path, {"Content-Type": "application/json", "Content-Length": str(declared), **(headers or {})})
    chunk = b"x" * 65536
    for s in socks:
        s.sendall(h)
    for s in socks:
        left = sent
        with contextlib.suppress(OSError):  # refused early: the server closed it
            while left > 0:
                s.sendall(chunk[:left])
                left -= min(left, len(chunk))
    return socks


def huge_header(addr: Addr, size: int, timeout: float = 60.0) -> tuple[int, float]:
    """Send a head with one ``size``-byte header line; (status answered, seconds until the
    server answered or closed). Sending stops as soon as the server has answered."""
    s = connect(addr, timeout)
    start = time.monotonic()
    try:
        s.sendall(head("GET", "/health")[:-2] + b"X-Big: ")
        chunk = b"a" * 65536
        s.setblocking(False)
        sent, answer = 0, bytearray()
        while sent < size and time.monotonic() - start < timeout:
            with contextlib.suppress(BlockingIOError):
                got = s.recv(65536)
                if not got:
                    break
                answer += got
                break
            try:
                sent += s.send(chunk[: size - sent])
            except BlockingIOError:
                time.sleep(0.001)
            except OSError:
                break
        if sent >= size:
            with contextlib.suppress(OSError):
                s.setblocking(True)
                s.sendall(b"\r\n\r\n")
        s.setblocking(True)
        rest = read_to_close(s, max(0.1, timeout - (time.monotonic() - start)))
        return status_of(bytes(answer) + rest), time.monotonic() - start
    finally:
        s.close()


def many_headers(addr: Addr, count: int, timeout: float = 10.0) -> int:
    """The status answered to a head with ``count`` small headers."""
    with connect(addr, timeout) as s:
        s.sendall(head("GET", "/health", {f"X-H{i}": "v" for i in range(count)} | {"Connection": "close"}))
        return status_of(read_to_close(s, timeout))


def stream_without_reading(addr: Addr, body: bytes, headers: dict[str, str] | None = None,
                           path: str = CHAT) -> socket.socket:
    """A streaming request whose answer is never read (the socket's receive buffer kept small).
    Ask for a long answer at a fast pace (e.g. 200,000 tokens from a fake runtime without delays):
    the gateway's writes block only once the kernel's buffers between the two are full."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(5)
    s.connect(addr)
    s.sendall(head("POST", path, {"Content-Type": "application/json", "Content-Length": str(len(body)),
                                  **(headers or {})}) + body)
    return s


def request_id(raw: bytes) -> str:
    """The ``X-Request-Id`` of a raw response (its head, at least)."""
    for line in raw.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"x-request-id":
            return value.strip().decode("latin-1")
    raise ValueError(f"no X-Request-Id in {raw[:300]!r}")


def unsent_to(pid: int, client: socket.socket) -> int:
    """Bytes the kernel of process ``pid`` holds for the client socket ``client`` (the send queue
    of ``pid``'s end of that connection: written, not yet taken); -1 when there is no such
    connection any more."""
    try:
        local_port, server_port = client.getsockname()[1], client.getpeername()[1]
    except OSError:  # not connected any more: reset
        return -1
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) > 4 and int(parts[1].rsplit(":", 1)[1], 16) == server_port \
                        and int(parts[2].rsplit(":", 1)[1], 16) == local_port:
                    return int(parts[4].split(":")[0], 16)
    return -1


def wait_stalled(pid: int, clients: list[socket.socket], timeout: float, steady: float = 0.2) -> list[int]:
    """Until what process ``pid`` holds for each of ``clients`` has stopped growing (the client's
    window is shut and the kernel's buffer full: from then on the server's writes wait); those
    byte counts. Raises AssertionError after ``timeout``, or when a connection is gone first."""
    deadline = time.monotonic() + timeout
    last = [unsent_to(pid, c) for c in clients]
    while time.monotonic() < deadline:
        time.sleep(steady)
        now = [unsent_to(pid, c) for c in clients]
        if -1 in now:
            raise AssertionError(f"a connection was closed before it stalled: {now}")
        if all(n > 0 and n == m for n, m in zip(now, last, strict=True)):
            return now
        last = now
    raise AssertionError(f"the server's queues to the clients did not stop growing in {timeout:g} s ({last} bytes)")


# --- the well-behaved client ----------------------------------------------------------------------
@dataclass
class Served:
    ok: int = 0
    failed: int = 0
    worst_s: float = 0.0
    last_error: str = ""


class WellBehaved:
    """A client sending one small streaming chat after another, each with a fresh connection and a
    ``timeout``; counts the answers that were complete (``[DONE]``)."""

    def __init__(self, addr: Addr, model: str, *, timeout: float = 10.0,
                 headers: dict[str, str] | None = None, pause: float = 0.05) -> None:
        self.addr, self.model, self.timeout, self.headers, self.pause = addr, model, timeout, headers, pause
        self.served = Served()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def once(self) -> bool:
        start = time.monotonic()
        try:
            raw = post(self.addr, CHAT, chat_body(self.model, stream=True), self.headers, self.timeout)
            ok = status_of(raw) == 200 and b"data: [DONE]" in raw
            if not ok:
                self.served.last_error = raw[:300].decode("latin-1")
        except OSError as exc:
            ok, self.served.last_error = False, repr(exc)
        took = time.monotonic() - start
        self.served.worst_s = max(self.served.worst_s, took)
        if ok:
            self.served.ok += 1
        else:
            self.served.failed += 1
        return ok

    def _run(self) -> None:
        while not self._stop.is_set():
            self.once()
            self._stop.wait(self.pause)

    def __enter__(self) -> WellBehaved:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(probe: Probe, action: Callable[[], object]) -> tuple[object, Sample, Sample, int]:
    """Run ``action``; (its result, sample before, sample after, peak RSS in KiB during it)."""
    before = probe.sample()
    with PeakRss(probe) as peak:
        result = action()
    return result, before, probe.sample(), peak.peak_kib
