"""A box that disappears while streams run, and comes back: each box a network namespace running
passerelle with the real llama-server and the small real model (the embedded default), the
team's gateway in the root namespace.

Killed (every process of the box, a power cut) or its cable pulled (no reset: connections hang),
its replica leaves the rotation within 5 s with the box and the cause named (log, /health), the
streams it carried end with an error event (never a hang), the other box's streams go on, new
requests go to the other box; returned, its replica is back."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx
import orjson
import pytest

from passerelle.runtimes.embedded import DEFAULT_MODEL_ID
from passerelle.testing.netns import Network, available
from tests.integration.boxes_support import BoxGateway, boxes_config, llama_box_config, start_box
from tests.waiting import wait_until

pytestmark = pytest.mark.llama
MODEL = DEFAULT_MODEL_ID


@dataclass
class Stream:
    """One streamed chat request, read in a thread: its content events, how it ended."""

    url: str
    prompt: str
    events: int = 0
    ended: str = ""  # "done", "error: …", "cut: …"
    error_text: str = ""
    finished_at: float = 0.0
    thread: threading.Thread = field(init=False)

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": 4000, "ignore_eos": True,
                "messages": [{"role": "user", "content": self.prompt}]}
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                              timeout=httpx.Timeout(120, read=60)) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        self.ended = self.ended or "done"
                        continue
                    event = orjson.loads(data)
                    if "error" in event:
                        self.ended, self.error_text = "error", orjson.dumps(event["error"]).decode()
                    elif event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                        self.events += 1
            self.ended = self.ended or "cut: the stream closed without [DONE]"
        except httpx.HTTPError as exc:
            self.ended = f"cut: {exc!r}"
        finally:
            self.finished_at = time.monotonic()


def replicas(gw) -> dict[str, dict]:
    rows = httpx.get(gw.url + "/admin/runtimes", timeout=10).json()["runtimes"]
    return {r["name"]: r for r in rows if r.get("remote")}


def box_health(gw, name: str) -> dict:
    return next(b for b in httpx.get(gw.url + "/health", timeout=10).json()["boxes"] if b["name"] == name)


def two_boxes(net: Network, gateway, tmp_path) -> tuple[list[BoxGateway], object]:
    boxes = [start_box(box, tmp_path / "boxes", llama_box_config(net)) for box in net.boxes]
    gw = gateway(boxes_config(net))
    wait_until(lambda: all(r["up"] for r in replicas(gw).values()) and len(replicas(gw)) == 2, 30,
               what="both boxes' replicas up")
    return boxes, gw


def streams_on_both(gw, net: Network) -> list[Stream]:
    """Two long streams, one per box (the least loaded replica first), both generating; a slot is
    left free on each box."""
    streams = [Stream(gw.url, f"Count slowly, story {i}.").start() for i in range(2)]
    wait_until(lambda: all(s.events >= 2 for s in streams), 120, what="every stream generating")
    busy = replicas(gw)
    assert all(busy[f"{b.name}/{MODEL}"]["in_flight"] == 1 for b in net.boxes), busy
    return streams


def check_gone(gw, streams: list[Stream], lost: str, t0: float, t0_wall: float) -> None:
    """``lost``'s replica out within 5 s of ``t0``; its streams ended with an error event, the others run.

    When it went out is the gateway's own record (the box's DOWN transition, wall clock, in
    ``/health``), the moment its replicas left the rotation: a poll of ``/admin/runtimes`` that
    itself waits on a loaded machine would add its own delay to the figure."""
    name = f"{lost}/{MODEL}"
    wait_until(lambda: not replicas(gw)[name]["up"], 15, what=f"{name} out")
    health = box_health(gw, lost)
    assert health["state"] == "down" and health["cause"], health
    out_after = health["since"] - t0_wall
    assert 0 < out_after <= 5.0, f"{name} out {out_after:.2f} s after the box was lost (goal: 5 s)"
    assert f"box {lost} is DOWN (" in gw.log_text()
    # the stream on the lost box ends (no hang) with an error event; the other still runs
    wait_until(lambda: any(s.ended for s in streams), 15, what="the lost box's stream ended")
    ended = [s for s in streams if s.ended]
    assert len(ended) == 1 and all(s.ended == "error" for s in ended), [(s.ended, s.error_text) for s in ended]
    assert all(s.finished_at - t0 <= 10 for s in ended)
    assert lost in ended[0].error_text, ended[0].error_text  # the replica (its box) is named
    running = [s for s in streams if not s.ended]
    before = [s.events for s in running]
    wait_until(lambda: all(s.events > n + 3 for s, n in zip(running, before, strict=True)), 30,
               what="the other box's streams going on")
    # a new request is served by the box that is left
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text


def in_session(gw, session: str) -> str:
    """One short request of an agent's session; the replica that served it."""
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60, headers={"X-Claude-Code-Session-Id": session},
                   json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    return gw.log_for(r.headers["x-request-id"])["backend"]


def finish(streams: list[Stream]) -> None:
    """End the long streams still running (the box's processes go with the network)."""
    for s in streams:
        s.thread.join(0.1)


def test_a_box_killed_while_streams_run_leaves_at_once_and_comes_back_when_it_returns(gateway, tmp_path):
    assert available() == ""
    with Network("bk", boxes=2) as net:
        _, gw = two_boxes(net, gateway, tmp_path)
        streams = streams_on_both(gw, net)
        home = in_session(gw, "agent-7")
        assert in_session(gw, "agent-7") == home  # the session stays where its cache is
        lost = next(b for b in net.boxes if home == f"{b.name}/{MODEL}")
        t0, t0_wall = time.monotonic(), time.time()
        lost.kill()
        check_gone(gw, streams, lost.name, t0, t0_wall)
        assert "connection" in box_health(gw, lost.name)["cause"]  # refused or reset: not a timeout
        moved = in_session(gw, "agent-7")
        assert moved != home and moved.endswith(f"/{MODEL}")  # re-routed to the box that is left
        start_box(lost, tmp_path / "boxes", llama_box_config(net))
        wait_until(lambda: replicas(gw)[f"{lost.name}/{MODEL}"]["up"], 30, what="the returned box's replica up")
        assert box_health(gw, lost.name)["state"] == "up"
        assert f"box {lost.name} is up" in gw.log_text()
        finish(streams)


def test_a_box_whose_cable_is_pulled_leaves_within_5_s_and_comes_back_with_it(gateway, tmp_path):
    assert available() == ""
    with Network("bl", boxes=2) as net:
        _, gw = two_boxes(net, gateway, tmp_path)
        streams = streams_on_both(gw, net)
        lost = net.boxes[1]
        t0, t0_wall = time.monotonic(), time.time()
        lost.link_down()
        check_gone(gw, streams, lost.name, t0, t0_wall)
        assert "no answer within" in box_health(gw, lost.name)["cause"]  # no reset: the readings time out
        lost.link_up()
        wait_until(lambda: replicas(gw)[f"{lost.name}/{MODEL}"]["up"], 10, what="its replica back with the cable")
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200
        finish(streams)
