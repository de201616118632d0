"""A model split over boxes with llama.cpp's RPC backend: the lending boxes' ``rpc-server`` and
the head's ``llama-server --rpc … -sm layer``, the group being one replica.

    member (a box that lends its memory)   [[rpc_workers]]: rpc-server -H <private address> -p 50052,
                                           supervised by that box's passerelle like any runtime
    head   (the box that serves the model) [[backends]] rpc = ["10.0.0.2:50052"]: its llama-server
                                           is launched with --rpc 10.0.0.2:50052 -sm layer

The RPC protocol has no authentication: a worker binds one private address of its box and the
configuration refuses a public or wildcard one unless ``allow_public`` says a firewall stands in
front (config.py). passerelle never forwards anything to it.

The head's health needs every member (:class:`SplitGroup`, attached to the head's
:class:`RuntimeProcess` as its watcher):

    STOPPED ──launch──► WAITING ──every member answers──► LAUNCHING ──head ready──► SERVING
                          ▲  ▲                                │                      │
                          │  └──── launch failed ─────────────┘                      │ member lost, or
                          └──────────────── restart (the supervisor's backoff) ◄── LOST ◄┘ the head died
    any ──stop──► STOPPED

While SERVING the head's own TCP connections to each member are read from ``/proc`` (every
250 ms, tcp_conns.py): a connection the member closed (its rpc-server died: the kernel sent FIN)
or one that retransmits unanswered (its box or link is gone) is a lost member; an idle head sends
nothing to retransmit, so keepalive is turned on for its member connections and unanswered
probes say the same; with no connection at all the member's port is tried (refused: lost). A
lost member takes the replica out at once: the backend is marked down with the member named, its
breaker opened, and the head is killed, since llama.cpp would abort at its next step (or, with a
pulled cable, wait forever): the streams in flight end with an error event. The supervisor's
restart then waits here (WAITING) until every member answers again, polling their ports with
backoff, and launches the head again.

An active probe is never made while the head holds a member: ``rpc-server`` serves one client at
a time with a listen backlog of one, so probes would queue behind the head and then time out.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from passerelle.config import BackendConfig, RpcWorkerConfig, TimeoutConfig, rpc_endpoint
from passerelle.errors import ConfigError
from passerelle.runtimes import embedded
from passerelle.runtimes.base import Backend, BackendStats
from passerelle.runtimes.supervisor import RuntimeFailed, RuntimeProcess
from passerelle.runtimes.tcp_conns import Conn, arm_keepalive, connections, hex_address

log = logging.getLogger("passerelle.runtimes.rpc")

# /proc/net/tcp's states (include/net/tcp_states.h)
_ESTABLISHED = "01"
_GONE_STATES = {"06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK"}
RETRANSMITS_LOST = 3  # unanswered retransmissions of the head's data: ~1.5 s with the minimum RTO
PROBES_LOST = 2  # unanswered keepalive probes of an idle head's connection: ~2 s (tcp_conns.py)
PROBE_TIMEOUT_S = 1.0


class GroupState(enum.Enum):
    STOPPED = "stopped"
    WAITING = "waiting"  # for every member to answer before the head is launched
    LAUNCHING = "launching"
    SERVING = "serving"
    LOST = "lost"  # a member is gone (or the head died): out of rotation until restarted whole


_ALLOWED = {
    GroupState.STOPPED: {GroupState.WAITING},
    GroupState.WAITING: {GroupState.LAUNCHING, GroupState.STOPPED},
    GroupState.LAUNCHING: {GroupState.SERVING, GroupState.WAITING, GroupState.STOPPED},
    GroupState.SERVING: {GroupState.LOST, GroupState.STOPPED},
    GroupState.LOST: {GroupState.WAITING, GroupState.STOPPED},
}


@dataclass
class Member:
    """One member of a split, as the head sees it."""

    endpoint: str  # host:port, as configured
    host: str
    port: int
    up: bool | None = None  # None: not seen yet
    cause: str = ""  # why it is down
    since: float = 0.0  # wall time of the last change

    def mark(self, up: bool, cause: str = "") -> None:
        if up != self.up or cause != self.cause:
            self.up, self.cause, self.since = up, cause, time.time()

    def describe(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "up": self.up, "cause": self.cause or None,
                "since": round(self.since, 3) if self.since else None}


async def probe(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> str:
    """'' when ``host:port`` accepts a TCP connection (closed at once), else why not."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except ConnectionRefusedError:
        return "refuses connections (no rpc-server listening)"
    except OSError as exc:
        return f"unreachable ({exc.strerror or exc})"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return ""


# -- the head's connections, from /proc ----------------------------------------------------------

def judge(conns: list[Conn], remote: str) -> str | None:
    """The verdict on one member from the head's connections to it: '' alive, a cause when it is
    lost, None when the head holds no connection to it (the caller probes its port)."""
    mine = [c for c in conns if c.remote == remote]
    if not mine:
        return None
    established = [c for c in mine if c.state == _ESTABLISHED]
    stuck = [c for c in established if c.retransmits >= RETRANSMITS_LOST]
    if stuck:
        worst = max(c.retransmits for c in stuck)
        return f"does not answer ({worst} unanswered retransmissions: its box or link is down)"
    silent = [c for c in established if c.probes >= PROBES_LOST]
    if silent:
        worst = max(c.probes for c in silent)
        return f"does not answer ({worst} unanswered keepalive probes: its box or link is down)"
    if established:
        return ""
    states = ", ".join(sorted({_GONE_STATES.get(c.state, c.state) for c in mine}))
    return f"closed its connection to the head ({states}: its rpc-server exited)"


# -- the group -----------------------------------------------------------------------------------

class SplitGroup:
    """The members of a split head and their verdict; the head's :class:`RuntimeProcess` calls it
    before each launch (:meth:`before_launch`), once ready (:meth:`ready`), while it serves
    (:meth:`guard`), when it died (:meth:`exited`) and when it is stopped (:meth:`stopped`)."""

    POLL_S = 0.25
    BACKOFF_MAX_S = 2.0

    def __init__(self, proc: RuntimeProcess, members: tuple[str, ...], *, proc_root: Path = Path("/proc")) -> None:
        self.proc = proc
        self.backend = proc.backend
        self.members = []
        for m in members:
            parsed = rpc_endpoint(m)
            if parsed is None:
                raise ValueError(f"rpc member {m!r}: expected host:port")
            self.members.append(Member(m, *parsed))
        self.proc_root = proc_root
        self.state = GroupState.STOPPED
        self.cause = ""  # why the replica is out (the member named), '' while it serves
        self.out_since = 0.0  # when it went out (wall clock, shown): the figure the 5 s goal is about
        self.lost = 0  # times a member was lost
        self._remotes: dict[str, str | None] = {}
        self._armed: set[str] = set()  # inodes of the head's member connections with keepalive on
        self._keepalive_refused = 0  # the head's pid where the kernel refused it
        proc.watcher = self

    def _set(self, state: GroupState) -> None:
        if state is self.state:
            return
        if state not in _ALLOWED[self.state]:
            raise RuntimeError(f"split {self.backend.name}: illegal transition {self.state.name} -> {state.name}")
        log.info("split %s: %s -> %s", self.backend.name, self.state.value, state.value)
        self.state = state

    def _remote(self, m: Member) -> str | None:
        """The member's address as /proc writes it (its host name resolved once, as the head's
        own resolver would: the first address; an IPv4 one first where both exist)."""
        if m.endpoint not in self._remotes:
            ip = m.host
            with contextlib.suppress(OSError, UnicodeError):
                found = socket.getaddrinfo(m.host, m.port, 0, socket.SOCK_STREAM)
                found.sort(key=lambda a: a[0] != socket.AF_INET)
                ip = str(found[0][4][0])
            self._remotes[m.endpoint] = hex_address(ip, m.port)
        return self._remotes[m.endpoint]

    # -- the head's lifecycle ---------------------------------------------------------------------
    async def before_launch(self, timeout_s: float) -> None:
        """Wait until every member accepts a connection, polling with backoff; RuntimeFailed
        naming those that do not after ``timeout_s`` (or when the head is being stopped)."""
        self._set(GroupState.WAITING)
        deadline = time.monotonic() + timeout_s
        delay = self.POLL_S
        while True:
            causes = await asyncio.gather(*(probe(m.host, m.port) for m in self.members))
            for m, cause in zip(self.members, causes, strict=True):
                m.mark(not cause, cause)
            down = [m for m in self.members if not m.up]
            if not down:
                self._set(GroupState.LAUNCHING)
                return
            named = "; ".join(f"member {m.endpoint} {m.cause}" for m in down)
            self._out(f"waiting for {named}")
            if self.proc.stopping:
                raise RuntimeFailed(f"runtime {self.backend.name} was stopped while waiting for {named}")
            if time.monotonic() + delay > deadline:
                raise RuntimeFailed(f"split {self.backend.name}: {named} (waited {timeout_s:g} s)")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, self.BACKOFF_MAX_S)

    def ready(self) -> None:
        """The head loaded the model over every member: the replica serves, its breaker closed."""
        self._set(GroupState.SERVING)
        self._armed.clear()  # (a new head: new connections)
        for m in self.members:
            m.mark(True)
        self.cause = ""
        self.backend.breaker.reset()
        self.backend.stats.error = ""

    async def guard(self) -> str:
        """While the head serves: return the cause once a member is lost (the head is then killed)."""
        while True:
            await asyncio.sleep(self.POLL_S)
            pid = self.proc.pid
            if pid is None:
                continue  # it exited: the supervisor sees it
            try:
                cause = await self.inspect(pid)
            except Exception:  # reading /proc must never take a replica out by itself
                log.exception("split %s: checking the members failed", self.backend.name)
                continue
            if cause:
                return cause

    async def inspect(self, pid: int) -> str:
        """'' while every member holds; else the cause, the lost members marked."""
        conns = await asyncio.to_thread(connections, pid, self.proc_root)
        await self._arm(pid, conns)
        lost: list[Member] = []
        for m in self.members:
            remote = self._remote(m)
            verdict = judge(conns, remote) if remote is not None else None
            if verdict is None:
                verdict = await probe(m.host, m.port)
            if verdict:
                m.mark(False, verdict)
                lost.append(m)
        if not lost:
            return ""
        cause = "; ".join(f"member {m.endpoint} {m.cause}" for m in lost)
        self._lose(cause)
        return cause

    async def _arm(self, pid: int, conns: list[Conn]) -> None:
        """Keepalive on the head's new connections to its members, so that an idle head notices a
        pulled cable too (tcp_conns.py); refused once, not asked again for this process."""
        if self._keepalive_refused == pid:
            return
        remotes = {r for m in self.members if (r := self._remote(m)) is not None}
        fresh = {c.inode for c in conns if c.remote in remotes and c.state == _ESTABLISHED} - self._armed
        if not fresh:
            return
        try:
            self._armed |= await asyncio.to_thread(arm_keepalive, pid, fresh, self.proc_root)
        except OSError as exc:
            self._keepalive_refused = pid
            log.warning("split %s: keepalive on the head's member connections refused (%s): a pulled cable is "
                        "noticed at the head's next request only", self.backend.name, exc)

    def _out(self, cause: str) -> None:
        """The replica out of rotation at once, ``cause`` shown (runtime list, /health, the log)."""
        self.cause, self.out_since = cause, time.time()
        self.backend.stats.up = False
        self.backend.stats.error = cause
        self.backend.breaker.trip(time.monotonic(), self.backend.breaker.max_backoff_s)  # until rebuilt (reset)

    def _lose(self, cause: str) -> None:
        self.lost += 1
        self._set(GroupState.LOST)
        self._out(cause)
        log.error("split %s: %s; the replica is out until every member answers again", self.backend.name, cause)

    async def exited(self, code: int | None) -> None:
        """The head died (killed by :meth:`guard`'s verdict, or on its own: llama.cpp aborts when a
        member's connection breaks). The members are tried at once, to name the one gone."""
        if self.state is GroupState.LOST:
            return
        causes = await asyncio.gather(*(probe(m.host, m.port) for m in self.members))
        for m, c in zip(self.members, causes, strict=True):
            m.mark(not c, c)
        named = "; ".join(f"member {m.endpoint} {m.cause}" for m in self.members if not m.up)
        self._lose(f"the head llama-server exited with code {code}" + (f" ({named})" if named else ""))

    def stopped(self) -> None:
        self._set(GroupState.STOPPED)

    def describe(self) -> dict[str, Any]:
        return {"state": self.state.value, "cause": self.cause or None, "lost": self.lost,
                "since": round(self.out_since, 3) if self.cause else None,
                "members": [m.describe() for m in self.members]}


def head_command(bc: BackendConfig) -> tuple[str, ...]:
    """The head's launch command: what the operator wrote, plus the members and the layer split."""
    if not bc.rpc:
        return bc.launch
    extra = ["--rpc", ",".join(bc.rpc), "-sm", "layer"]
    if bc.rpc_split:
        extra += ["--tensor-split", ",".join(f"{x:g}" for x in bc.rpc_split)]
    return (*bc.launch, *extra)


# -- the lending box's side ----------------------------------------------------------------------

class RpcWorkerBackend(Backend):
    """An ``rpc-server`` as the supervisor sees it: up while its port accepts a connection. It is
    no inference backend (the registry never holds it); nothing is ever forwarded to it."""

    kind = "rpc-server"
    serves = ()

    def __init__(self, w: RpcWorkerConfig, timeouts: TimeoutConfig) -> None:
        super().__init__(BackendConfig(name=w.name, kind="openai", persistent=True, ready_timeout_s=w.ready_timeout_s,
                                       log_file=w.log_file), timeouts)
        self.host, self.port = w.host, w.port
        self.url = f"rpc://{w.host}:{w.port}" if ":" not in w.host else f"rpc://[{w.host}]:{w.port}"

    def set_url(self, url: str) -> None:
        """(Its address is its own, configured: not the supervisor's chosen port.)"""

    async def start(self) -> None:
        """(No HTTP client: the health check is a TCP connection.)"""

    async def check_health(self, timeout: float = 2.0) -> bool:
        # a connection while no head holds it: accepted and closed at once by rpc-server
        return not await probe(self.host, self.port, timeout)

    async def scrape(self) -> BackendStats:
        self.stats.up = await self.check_health()
        self.stats.scraped_at = time.time()
        return self.stats


def worker_command(w: RpcWorkerConfig, binary: str) -> tuple[str, ...]:
    cmd = [binary, "-H", w.host, "-p", str(w.port)]
    if w.threads:
        cmd += ["-t", str(w.threads)]
    if w.devices:
        cmd += ["-d", ",".join(w.devices)]
    if w.cache:
        cmd += ["-c"]
    return tuple(cmd)


def worker_runtime(w: RpcWorkerConfig, timeouts: TimeoutConfig, state: Path | None, *,
                   source: str = "<defaults>") -> RuntimeProcess:
    """The supervised ``rpc-server`` of ``[[rpc_workers]]`` entry ``w`` (the cached build's by default)."""
    binary = w.rpc_server or str(embedded.cached_rpc_server())
    if not w.rpc_server and not Path(binary).is_file():
        raise ConfigError(f"rpc worker {w.name!r} runs the cached rpc-server, and there is none at {binary}: "
                          "run `passerelle setup --flavour cpu` (or vulkan, rocm, cuda: the build that lends this "
                          "box's devices) first; it builds rpc-server beside llama-server", file=source,
                          key="rpc_workers.rpc_server")
    backend = RpcWorkerBackend(w, timeouts)
    log_path = Path(w.log_file) if w.log_file else state / "logs" / f"{w.name}.log" if state else None
    return RuntimeProcess(backend, worker_command(w, binary), log_path=log_path, ready_timeout_s=w.ready_timeout_s)
