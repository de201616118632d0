"""A model split over two boxes with llama.cpp's RPC, on network namespaces: a head box (passerelle
and its llama-server --rpc) and a member box (passerelle and its supervised rpc-server), each at
its own address, traffic only between those addresses.

The tiny model split over the head and the member answers the same greedy text as one box; a
member killed while streams run ends every stream with an error event (no hang) and takes the
replica out within 5 s with the member named (the log, /health, `runtime list`); the member
returned, the replica is back and answering."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest

from passerelle.runtimes import embedded
from passerelle.testing.netns import Network, available
from passerelle.testing.split_boxes import RPC_PORT, BoxGateway, split_config, start_gateway, worker_config
from tests.conftest import MODEL_ID, start_llama
from tests.waiting import wait_until

pytestmark = pytest.mark.llama

GREEDY = {"model": MODEL_ID, "temperature": 0, "max_tokens": 24, "seed": 1,
          "messages": [{"role": "user", "content": "Name three things you find in a lighthouse."}]}


@pytest.fixture(scope="module")
def rpc_build() -> tuple[Path, Path, Path]:
    """llama-server and rpc-server of the CPU build with RPC (built once, as `make setup` does), and Gemma."""
    build = embedded.llama_server_build(flavour="cpu")
    rpc_server = embedded.cached_rpc_server(build.spec)
    assert rpc_server.is_file(), f"the RPC build has no rpc-server at {rpc_server}"
    return build.binary, rpc_server, embedded.ensure_gemma()


def test_rpc_server_and_llama_server_s_rpc_flag_are_built(rpc_build):
    binary, rpc_server, _ = rpc_build
    usage = subprocess.run([str(rpc_server), "--help"], capture_output=True, text=True, timeout=30)
    assert "--host HOST" in usage.stderr and "--port PORT" in usage.stderr
    shown = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    helptext = shown.stdout + shown.stderr
    assert "--rpc SERVERS" in helptext


@pytest.fixture
def split(rpc_build, tmp_path):
    """A member box lending its memory and a head box serving the model split over both."""
    assert available() == ""
    binary, rpc_server, model = rpc_build
    with Network("rs", boxes=2) as net:
        head_box, member_box = net.boxes
        endpoint = f"{member_box.address}:{RPC_PORT}"
        member_cfg = worker_config(member_box.address, admin=net.subnet, rpc_server=rpc_server)
        member = start_gateway(member_cfg, tmp_path / "member", box=member_box)
        member.wait("/health")
        wait_until(lambda: member.runtimes()["lend"]["state"] == "ready", 60, what="the member's rpc-server ready")
        head = start_gateway(split_config(head_box.address, binary, model, [endpoint], alias=MODEL_ID, slots=4,
                                          admin=net.subnet), tmp_path / "head", box=head_box)
        head.wait("/ready")

        def restart_member() -> BoxGateway:
            return start_gateway(member_cfg, tmp_path / "member", box=member_box)

        yield net, head, member, endpoint, restart_member
        head.stop()
        for box in net.boxes:
            box.kill(signal.SIGTERM)


def chat(url: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", json=GREEDY, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_a_model_split_over_a_head_and_a_member_answers_as_one_box(split, rpc_build, tmp_path):
    _, head, member, endpoint, _ = split
    binary, _, model = rpc_build
    one_box = start_llama(binary, model, tmp_path / "one-box.log", slots=1)
    try:
        alone = chat(one_box.url)
    finally:
        one_box.stop()
    assert alone.strip()
    assert chat(head.url) == alone
    row = head.runtimes()["split"]
    command = " ".join(row["command"])
    assert f"--rpc {endpoint} -sm layer" in command and "-ngl 9" in command
    assert row["split"]["state"] == "serving" and row["split"]["members"][0]["up"]
    # the member really holds layers: its rpc-server grew by the weights it was sent
    lend = member.runtimes()["lend"]
    assert lend["kind"] == "rpc-server" and lend["url"] == f"rpc://{endpoint}"
    rss_kib = int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{lend['pid']}/status").read_text()).group(1))
    assert rss_kib > 40 * 1024, rss_kib


def split_out(url: str, endpoint: str) -> dict | None:
    """The split's entry in the head's /health ``runtimes_out``, once it names ``endpoint``. When it
    went out is the head's own record (``since``, wall clock): a poll of /health on a loaded
    machine would add its own delay to the figure."""
    for t in httpx.get(url + "/health", timeout=2).json().get("runtimes_out", []):
        if t["runtime"] == "split" and endpoint in t["cause"]:
            return t
    return None


def stream(url: str, out: dict, started: threading.Event) -> None:
    body = {**GREEDY, "stream": True, "max_tokens": 2000, "temperature": 0.8,
            "messages": [{"role": "user", "content": "Tell a very long story about a lighthouse keeper."}]}
    events: list[bytes] = []
    out["events"] = events
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=30)) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line.encode())
                    if len(events) >= 3:
                        started.set()
    except httpx.HTTPError as exc:
        out["exception"] = repr(exc)
    out["ended_at"] = time.monotonic()


def test_a_member_killed_while_streams_run_takes_the_replica_out_and_its_return_brings_it_back(split):
    net, head, _, endpoint, restart_member = split
    outs: list[dict] = [{} for _ in range(3)]
    starts = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=stream, args=(head.url, o, s), daemon=True)
               for o, s in zip(outs, starts, strict=True)]
    for t in threads:
        t.start()
    for s in starts:
        assert s.wait(120), "a stream did not start"
    member_box = net.boxes[1]
    killed_at, killed_wall = time.monotonic(), time.time()
    member_box.kill()  # the member box's passerelle and its rpc-server, at once (a power cut)

    trouble = wait_until(lambda: split_out(head.url, endpoint), 15, what="the split out with its member named")
    assert 0 < trouble["since"] - killed_wall <= 5.0, trouble
    assert f"member {endpoint}" in trouble["cause"]
    for t in threads:
        t.join(15)
        assert not t.is_alive(), "a stream hung after its member died"
    for o in outs:
        assert o.get("status") == 200 and "exception" not in o, o.get("exception")
        last = orjson.loads(o["events"][-1].removeprefix(b"data:").strip())
        assert "error" in last, o["events"][-3:]  # ended with an error event, not [DONE]
        assert o["ended_at"] - killed_at <= 10.0
    rows = head.runtimes()
    assert not rows["split"]["up"] and rows["split"]["split"]["members"][0]["up"] is False
    listed = subprocess.run([sys.executable, "-m", "passerelle", "runtime", "list", "--url", head.url],
                            capture_output=True, text=True, timeout=60)
    assert f"members {endpoint} DOWN" in listed.stdout, listed.stdout + listed.stderr
    assert f"member {endpoint}" in head.log_text()

    restart_member().wait("/health")
    wait_until(lambda: httpx.get(head.url + "/ready", timeout=2).status_code == 200
               and head.runtimes()["split"]["split"]["state"] == "serving", 120,
               what="the split back once its member returned")
    assert head.runtimes()["split"]["restarts"] >= 1
    assert chat(head.url).strip()
    assert "runtimes_out" not in httpx.get(head.url + "/health", timeout=2).json()


def test_a_member_s_cable_pulled_while_streams_run_takes_the_replica_out_and_plugging_it_back_restores_it(split):
    net, head, _, endpoint, _ = split
    outs: list[dict] = [{} for _ in range(2)]
    starts = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=stream, args=(head.url, o, s), daemon=True)
               for o, s in zip(outs, starts, strict=True)]
    for t in threads:
        t.start()
    for s in starts:
        assert s.wait(120), "a stream did not start"
    member_box = net.boxes[1]
    pulled_wall = time.time()
    member_box.link_down()  # no FIN, no RST: the head's data to the member goes unanswered

    trouble = wait_until(lambda: split_out(head.url, endpoint), 15, what="the split out with its member named")
    assert 0 < trouble["since"] - pulled_wall <= 5.0 and "does not answer" in trouble["cause"], trouble
    for t in threads:
        t.join(15)
        assert not t.is_alive(), "a stream hung after its member's cable was pulled"
    for o in outs:
        last = orjson.loads(o["events"][-1].removeprefix(b"data:").strip())
        assert "error" in last, o["events"][-3:]
    member_box.link_up()
    wait_until(lambda: head.runtimes()["split"]["split"]["state"] == "serving", 180,
               what="the split back once its member's cable is back")
    assert chat(head.url).strip()


def test_an_idle_head_notices_its_member_s_cable_pulled_within_5_s(split):
    """No request in flight: the head sends nothing for the kernel to retransmit, so only the
    keepalive set on its member connections (runtimes/tcp_conns.py) can tell the link is gone."""
    net, head, _, endpoint, _ = split
    assert chat(head.url).strip()  # served, then idle
    member_box = net.boxes[1]
    pulled_wall = time.time()
    member_box.link_down()
    trouble = wait_until(lambda: split_out(head.url, endpoint), 15, what="the idle split out with its member named")
    assert 0 < trouble["since"] - pulled_wall <= 5.0, trouble
    assert "keepalive probes" in trouble["cause"], trouble
    member_box.link_up()
    wait_until(lambda: head.runtimes()["split"]["split"]["state"] == "serving", 180,
               what="the split back once its member's cable is back")
    assert chat(head.url).strip()
