"""A split's configuration and its group's state machine: members' endpoints, shares and a worker's
address are validated at load with the file, key and line named (a public or wildcard bind is
refused); the head's health needs every member: a member that closes its connection takes the
replica out at once (named, breaker open, head killed), and the replica comes back whole once the
member answers again. The head here is a real child process holding a real TCP connection to a
real listening member (the real llama-server and rpc-server are in tests/integration/test_rpc_split.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import pytest

from passerelle.config import BackendConfig, RpcWorkerConfig, TimeoutConfig, load_config, rpc_endpoint
from passerelle.errors import ConfigError
from passerelle.runtimes import rpc, tcp_conns
from passerelle.runtimes.breaker import BreakerState
from passerelle.runtimes.factory import build_runtime
from passerelle.runtimes.rpc import GroupState, SplitGroup, judge
from passerelle.runtimes.supervisor import ProcState
from passerelle.runtimes.tcp_conns import Conn, parse_tcp_table
from passerelle.server.control import render
from tests.waiting import until

G = GroupState


def write(tmp_path, text: str):
    p = tmp_path / "p.toml"
    p.write_text(textwrap.dedent(text))
    return p


HEAD = """
[[backends]]
name = "big"
kind = "llama-server"
models = ["m"]
launch = ["sleep", "{port}"]
"""


@pytest.mark.parametrize(("extra", "key", "line", "expect"), [
    ('rpc = ["10.0.0.2"]', "backends[0].rpc", 7, "expected host:port"),
    ('rpc = ["10.0.0.2:70000"]', "backends[0].rpc", 7, "expected host:port"),
    ('rpc = ["10.0.0.2:50052", "10.0.0.2:50052"]', "backends[0].rpc", 7, "listed twice"),
    ('rpc_split = [1, 1]', "backends[0].rpc_split", 7, "needs rpc"),
    ('rpc = ["10.0.0.2:50052", "10.0.0.3:50052"]\nrpc_split = [1]', "backends[0].rpc_split", 8, "one share per member"),
    ('rpc = ["10.0.0.2:50052"]\nrpc_split = [-1, 2]', "backends[0].rpc_split", 8, "none negative"),
])
def test_a_split_head_is_validated_with_key_and_line(tmp_path, extra, key, line, expect):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, HEAD + extra + "\n"), env={})
    assert (e.value.key, e.value.line) == (key, line) and expect in str(e.value)


def test_rpc_needs_a_launched_llama_server_and_keeps_its_own_flags(tmp_path):
    with pytest.raises(ConfigError, match="rpc needs a llama-server that passerelle launches") as e:
        load_config(write(tmp_path, HEAD.replace("llama-server", "vllm") + 'rpc = ["10.0.0.2:50052"]\n'), env={})
    assert e.value.key == "backends[0].rpc"
    with pytest.raises(ConfigError, match="leave --rpc") as e:
        load_config(write(tmp_path, HEAD.replace('"{port}"]', '"{port}", "--rpc", "h:1"]')
                          + 'rpc = ["10.0.0.2:50052"]\n'), env={})
    assert e.value.key == "backends[0].launch"


def test_a_member_serves_one_head(tmp_path):
    second = HEAD.replace('name = "big"', 'name = "other"')
    with pytest.raises(ConfigError, match="serves one head at a time") as e:
        load_config(write(tmp_path, HEAD + 'rpc = ["10.0.0.2:50052"]\n' + second + 'rpc = ["10.0.0.2:50052"]\n'),
                    env={})
    assert (e.value.key, e.value.line) == ("backends[1].rpc", 14)


def test_runtime_list_names_a_split_s_members_and_why_it_is_out():
    row = {"name": "big", "kind": "llama-server", "state": "failed", "pid": None, "up": False, "in_flight": 0,
           "restarts": 1, "url": "http://127.0.0.1:1",
           "split": {"state": "waiting", "cause": "waiting for member 10.0.0.2:50052 refuses connections", "lost": 1,
                     "members": [{"endpoint": "10.0.0.2:50052", "up": False}]}}
    text = render(orjson.dumps({"runtimes": [row]}))
    assert ("split big: waiting; members 10.0.0.2:50052 DOWN; out: waiting for member 10.0.0.2:50052 refuses "
            "connections") in text


def test_a_valid_split_loads_and_its_head_command_names_the_members_and_the_shares(tmp_path):
    cfg = load_config(write(tmp_path, HEAD + 'rpc = ["10.0.0.2:50052", "[fd00::3]:50052"]\nrpc_split = [2, 1, 1]\n'),
                      env={})
    b = cfg.backends[0]
    assert b.rpc == ("10.0.0.2:50052", "[fd00::3]:50052") and b.rpc_split == (2.0, 1.0, 1.0)
    assert rpc.head_command(b)[2:] == ("--rpc", "10.0.0.2:50052,[fd00::3]:50052", "-sm", "layer",
                                       "--tensor-split", "2,1,1")
    assert rpc_endpoint("[fd00::3]:50052") == ("fd00::3", 50052) and rpc_endpoint("box-b.lan:50052") == ("box-b.lan",
                                                                                                         50052)


WORKER = """
[server]
port = 8080

[[rpc_workers]]
name = "lend"
"""


@pytest.mark.parametrize(("host", "expect"), [
    ("0.0.0.0", "is every address"),
    ("::", "is every address"),
    ("8.8.8.8", "is public"),
    ("box-b.lan", "expected an IP address"),
])
def test_a_worker_never_binds_a_public_or_wildcard_address_by_default(tmp_path, host, expect):
    with pytest.raises(ConfigError, match=expect) as e:
        load_config(write(tmp_path, WORKER + f'host = "{host}"\n'), env={})
    assert (e.value.key, e.value.line) == ("rpc_workers[0].host", 7)


def test_a_worker_on_a_private_address_loads_and_a_public_one_only_when_allowed(tmp_path):
    cfg = load_config(write(tmp_path, WORKER + 'host = "10.0.0.2"\nthreads = 4\ndevices = ["Vulkan0"]\n'), env={})
    w = cfg.rpc_workers[0]
    assert (w.host, w.port, w.threads, w.devices) == ("10.0.0.2", 50052, 4, ("Vulkan0",))
    assert not cfg.uses_embedded  # a box that only lends its memory runs no model of its own
    assert rpc.worker_command(w, "/x/rpc-server") == ("/x/rpc-server", "-H", "10.0.0.2", "-p", "50052", "-t", "4",
                                                      "-d", "Vulkan0")
    cfg = load_config(write(tmp_path, WORKER + 'host = "0.0.0.0"\nallow_public = true\n'), env={})
    assert cfg.rpc_workers[0].allow_public
    with pytest.raises(ConfigError, match="taken by another") as e:
        load_config(write(tmp_path, WORKER + 'host = "10.0.0.2"\n[[rpc_workers]]\nname = "b"\nhost = "10.0.0.2"\n'),
                    env={})
    assert e.value.key == "rpc_workers[1].port"


def test_the_head_s_connections_judge_each_member():
    table = textwrap.dedent("""\
          sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
           0: 0200000A:9C40 0300000A:C3D4 01 00000000:00000000 00:00000000 00000000     0        0 111 1
           1: 0200000A:9C41 0400000A:C3D4 08 00000000:00000000 00:00000000 00000000     0        0 112 1
           2: 0200000A:9C42 0500000A:C3D4 01 00000010:00000000 01:00000040 00000005     0        0 113 1
        """)
    conns = parse_tcp_table(table)
    assert conns[0] == Conn(remote="0300000A:C3D4", state="01", retransmits=0, inode="111")
    assert tcp_conns.hex_address("10.0.0.3", 50132) == "0300000A:C3D4"
    assert judge(conns, "0300000A:C3D4") == ""  # established: alive
    assert "closed its connection" in (judge(conns, "0400000A:C3D4") or "")  # CLOSE_WAIT: its rpc-server exited
    assert "5 unanswered retransmissions" in (judge(conns, "0500000A:C3D4") or "")  # its cable pulled
    assert judge(conns, "0600000A:C3D4") is None  # no connection: the caller probes the port


def test_the_head_s_connections_are_read_from_the_kernel_for_ipv4_and_ipv6():
    """This process as the head: its real connections to a listener on 127.0.0.1 and on ::1 are
    found in /proc with the address the group computes for each member."""
    held = []
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            server = socket.socket(family, socket.SOCK_STREAM)
            server.bind((host, 0))
        except OSError:
            assert family == socket.AF_INET6, "no IPv4 loopback"
            continue  # (a machine without IPv6: its table is not there to read)
        server.listen(1)
        client = socket.create_connection((host, server.getsockname()[1]), timeout=5)
        held += [server, client]
        remote = tcp_conns.hex_address(host, server.getsockname()[1])
        assert remote is not None
        assert judge(tcp_conns.connections(os.getpid()), remote) == "", (host, remote)
    assert tcp_conns.hex_address("::1", 0x1F90) == "00000000000000000000000001000000:1F90"
    for s in held:
        s.close()


def test_an_idle_connection_whose_keepalive_probes_go_unanswered_is_a_lost_member():
    row = "   0: 0200000A:9C40 0300000A:C3D4 01 00000000:00000000 02:0000005E 00000000     0        {} 111 1"
    answered, silent = parse_tcp_table("header\n" + row.format(1)), parse_tcp_table("header\n" + row.format(2))
    assert answered[0].probes == 1 and judge(answered, "0300000A:C3D4") == ""  # one probe out: not yet
    assert "2 unanswered keepalive probes" in (judge(silent, "0300000A:C3D4") or "")


def test_keepalive_is_set_on_another_process_s_connection_which_goes_on_working(tmp_path):
    """A child process stands for the head: its idle connection to a listener here gets keepalive
    (the kernel's keepalive timer runs on it, in /proc), and the child's socket still works after
    the copy used to set it was closed."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""\
        import socket, sys
        c = socket.create_connection(("127.0.0.1", {port}))
        sys.stdin.readline()
        c.sendall(b"still here")
        sys.stdin.readline()
        """)], stdin=subprocess.PIPE)
    try:
        peer, _ = server.accept()
        remote = tcp_conns.hex_address("127.0.0.1", port)
        conns = [c for c in tcp_conns.connections(child.pid) if c.remote == remote]
        assert len(conns) == 1 and conns[0].state == "01"

        def timer() -> str:
            table = Path(f"/proc/{child.pid}/net/tcp").read_text()
            return next(line.split()[5][:2] for line in table.splitlines() if line.split()[9] == conns[0].inode)

        assert timer() == "00"  # idle, no timer: a pulled cable would go unseen
        assert tcp_conns.arm_keepalive(child.pid, {conns[0].inode}) == {conns[0].inode}
        assert timer() == "02"  # the keepalive timer runs on the child's socket
        assert child.stdin is not None
        child.stdin.write(b"\n")
        child.stdin.flush()
        peer.settimeout(10)
        assert peer.recv(64) == b"still here"
        peer.close()
    finally:
        child.kill()
        child.communicate()  # (closes its stdin pipe too)
        server.close()


# -- the group against a real head process and a real member socket -----------------------------

class Member:
    """A listening socket standing for an rpc-server: accepts and holds connections."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.port = 0
        self.held: list[asyncio.StreamWriter] = []

    async def start(self, port: int = 0) -> None:
        async def hold(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.held.append(w)

        self.server = await asyncio.start_server(hold, "127.0.0.1", port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def kill(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.held:
            w.close()
        self.held.clear()
        await self.server.wait_closed()


def head_launch(member_port: int) -> tuple[str, ...]:
    # a head that holds a connection to its member the whole time it serves, as llama-server does
    code = ("import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
            "from passerelle.cli import main; sys.exit(main(['fake-backend', '--port', sys.argv[2], "
            "'--ttft-ms', '1', '--itl-ms', '1']))")
    return (sys.executable, "-c", code, str(member_port), "{port}")


def track(group: SplitGroup) -> list[tuple[G, G]]:
    seen: list[tuple[G, G]] = []
    real = group._set

    def spy(state: G) -> None:
        before = group.state
        real(state)
        if state is not before:
            assert state in rpc._ALLOWED[before]
            seen.append((before, state))

    group._set = spy  # type: ignore[method-assign]
    return seen


async def test_a_lost_member_takes_the_replica_out_at_once_and_its_return_brings_it_back(tmp_path):
    member = Member()
    await member.start()
    endpoint = f"127.0.0.1:{member.port}"
    bc = BackendConfig(name="big", kind="openai", launch=head_launch(member.port), models=("m",),
                       log_file=str(tmp_path / "big.log"), ready_timeout_s=60, rpc=(endpoint,))
    backend, proc = build_runtime(bc, TimeoutConfig())
    assert proc is not None and isinstance(proc.watcher, SplitGroup)
    group = proc.watcher
    seen = track(group)
    try:
        await proc.start()
        assert group.state is G.SERVING and backend.stats.up and proc.state is ProcState.READY
        await until(lambda: member.held, 10, "the head connected to its member")
        head = proc.pid
        assert head is not None
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await member.kill()  # the member's rpc-server dies: the head's connection gets its FIN
        await until(lambda: group.state is G.LOST, 5, "the split noticed its member gone")
        assert loop.time() - t0 < 2.0
        assert not backend.stats.up and backend.breaker.state is BreakerState.OPEN
        assert f"member {endpoint} closed its connection" in group.cause == backend.stats.error
        out = proc.watcher.describe()  # when it went out, on the wall clock (the figure /health shows)
        assert out["since"] is not None and 0 <= time.time() - out["since"] < 5
        await until(lambda: proc.pid != head, 5, "the head killed")
        stat = Path(f"/proc/{head}/stat")
        assert not stat.exists() or stat.read_text().split(")")[1].split()[0] == "Z"  # gone (or a zombie)
        await until(lambda: group.state is G.WAITING and "waiting for" in group.cause, 10,
                    "the restart waits for the member")
        assert f"member {endpoint} refuses connections" in group.cause and not backend.routable(loop.time())
        await member.start(member.port)  # the member returns on its port
        await until(lambda: group.state is G.SERVING and proc.state is ProcState.READY, 30, "the split back whole")
        assert backend.stats.up and backend.breaker.state is BreakerState.CLOSED and group.cause == ""
        assert proc.restarts == 1 and group.lost == 1
        assert seen == [(G.STOPPED, G.WAITING), (G.WAITING, G.LAUNCHING), (G.LAUNCHING, G.SERVING),
                        (G.SERVING, G.LOST), (G.LOST, G.WAITING), (G.WAITING, G.LAUNCHING),
                        (G.LAUNCHING, G.SERVING)]
    finally:
        await proc.stop()
        await backend.close()
        await member.kill()
    assert group.state is G.STOPPED


async def test_a_head_does_not_launch_while_a_member_is_missing_and_says_which(tmp_path):
    member = Member()
    await member.start()
    port = member.port
    await member.kill()  # nobody listens there now
    bc = BackendConfig(name="big", kind="openai", launch=head_launch(port), models=("m",),
                       log_file=str(tmp_path / "big.log"), ready_timeout_s=0.6, rpc=(f"127.0.0.1:{port}",))
    backend, proc = build_runtime(bc, TimeoutConfig())
    assert proc is not None
    with pytest.raises(rpc.RuntimeFailed, match=f"member 127.0.0.1:{port} refuses connections"):
        await proc.start()
    assert proc.pid is None and proc.state is ProcState.FAILED  # never spawned without its member
    assert proc.watcher is not None and proc.watcher.describe()["members"][0]["up"] is False
    await proc.stop()
    await backend.close()


def test_an_illegal_group_transition_raises():
    bc = BackendConfig(name="big", kind="openai", launch=("sleep", "{port}"), models=("m",), rpc=("10.0.0.2:1",))
    _, proc = build_runtime(bc, TimeoutConfig())
    assert proc is not None and isinstance(proc.watcher, SplitGroup)
    with pytest.raises(RuntimeError, match="illegal transition STOPPED -> SERVING"):
        proc.watcher._set(G.SERVING)


async def test_a_worker_is_up_while_its_port_accepts(tmp_path):
    member = Member()
    await member.start()
    w = RpcWorkerConfig(name="lend", host="127.0.0.1", port=member.port)
    backend = rpc.RpcWorkerBackend(w, TimeoutConfig())
    assert backend.url == f"rpc://127.0.0.1:{member.port}" and backend.kind == "rpc-server"
    assert await backend.check_health()
    await member.kill()
    assert not await backend.check_health()


async def test_a_split_waiting_for_its_member_does_not_hold_up_the_box_s_other_runtimes(tmp_path):
    from passerelle.config import RuntimesConfig
    from passerelle.runtimes.supervisor import Supervisor

    member = Member()
    await member.start()
    port = member.port
    await member.kill()
    fake = (sys.executable, "-m", "passerelle", "fake-backend", "--port", "{port}", "--ttft-ms", "1", "--itl-ms", "1")
    split = BackendConfig(name="big", kind="openai", launch=head_launch(port), models=("m",),
                          log_file=str(tmp_path / "big.log"), ready_timeout_s=30, rpc=(f"127.0.0.1:{port}",))
    other = BackendConfig(name="small", kind="openai", launch=fake, models=("s",), log_file=str(tmp_path / "s.log"),
                          ready_timeout_s=60)
    built = [build_runtime(split, TimeoutConfig()), build_runtime(other, TimeoutConfig())]
    sup = Supervisor([p for _, p in built if p is not None], RuntimesConfig())
    starting = asyncio.gather(sup.start("big"), sup.start("small"), return_exceptions=True)
    try:
        await until(lambda: sup.processes["small"].state is ProcState.READY, 25, "the other runtime ready")
        assert sup.processes["big"].pid is None  # still waiting for its member, not launched
        await member.start(port)
        await until(lambda: sup.processes["big"].state is ProcState.READY, 30, "the split ready once its member is")
        assert await starting == [None, None]
    finally:
        await sup.stop_all()
        for b, _ in built:
            await b.close()
        await member.kill()


def test_a_reload_names_a_changed_worker_and_keeps_the_running_one():
    from passerelle.config import Config
    from passerelle.runtimes.reload_plan import effective, plan_reload

    old = Config(rpc_workers=(RpcWorkerConfig(name="lend", host="10.0.0.2"),))
    new = Config(rpc_workers=(RpcWorkerConfig(name="lend", host="10.0.0.2", port=50053),))
    plan = plan_reload(old, new)
    assert plan.restart == ("rpc_workers",) and plan.live == ()
    assert effective(old, new).rpc_workers == old.rpc_workers


def test_a_worker_without_an_rpc_server_built_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PASSERELLE_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="passerelle setup --flavour cpu") as e:
        rpc.worker_runtime(RpcWorkerConfig(name="lend", host="10.0.0.2"), TimeoutConfig(), None)
    assert e.value.key == "rpc_workers.rpc_server"
    proc = rpc.worker_runtime(RpcWorkerConfig(name="lend", host="10.0.0.2", rpc_server="/bin/true"), TimeoutConfig(),
                              tmp_path)
    assert proc.template == ("/bin/true", "-H", "10.0.0.2", "-p", "50052") and proc.backend.cfg.persistent
    assert proc.log_path == tmp_path / "logs" / "lend.log"
