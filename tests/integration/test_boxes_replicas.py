"""Replicas on two boxes behind one gateway: each box a network namespace with its own passerelle
supervising its runtime, the team's gateway in the root namespace reading them ([[boxes]]).

The fair-share test uses the fake runtime: its exact timing (every request the same length) makes
the tenants' shares a count of requests, which a real model's varying answers would blur."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import orjson

from passerelle.testing.netns import Network, available
from tests.integration.boxes_support import PORT, boxes_config, fake_box_config, start_box
from tests.waiting import wait_until


def cli(env: dict[str, str], *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "passerelle", *args], env={**os.environ, **env}, capture_output=True,
                          text=True, check=True, timeout=60).stdout


def test_one_gateway_shares_two_boxes_fairly_by_the_tenants_weights(gateway, tmp_path):
    assert available() == ""
    env = {"PASSERELLE_STATE": str(tmp_path / "state")}
    heavy = cli(env, "keys", "create", "--tenant", "heavy", "--weight", "3").strip()
    light = cli(env, "keys", "create", "--tenant", "light", "--weight", "1").strip()
    with Network("bf", boxes=2) as net:
        for box in net.boxes:
            start_box(box, tmp_path / "boxes", fake_box_config(net, slots=2, ttft_ms=60, itl_ms=15))
        gw = gateway(boxes_config(net), env=env)
        runtimes = httpx.get(gw.url + "/admin/runtimes", timeout=10).json()
        remote = {r["name"]: r for r in runtimes["runtimes"] if r.get("remote")}
        assert set(remote) == {f"{b.name}/fake-model" for b in net.boxes}
        assert all(r["capacity"] == 2 and r["up"] for r in remote.values())  # each box's slots, not more
        placement = runtimes["boxes"]["placements"]
        assert [(p["model"], p["mode"], p["fits"]) for p in placement] == [("fake-model", "replicas", True)]

        done: list[tuple[str, float]] = []
        stop = threading.Event()
        errors: list[str] = []

        def client(tenant: str, key: str) -> None:
            with httpx.Client(timeout=60) as http:
                while not stop.is_set():
                    r = http.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "fake-model", "max_tokens": 8,
                                        "messages": [{"role": "user", "content": "hello"}]})
                    if r.status_code != 200:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                    else:
                        done.append((tenant, time.monotonic()))

        threads = [threading.Thread(target=client, args=(t, k)) for t, k in (("heavy", heavy), ("light", light))
                   for _ in range(6)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        wait_until(lambda: len(done) >= 180 or errors, 120, what="180 requests served")
        t_end = time.monotonic()
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors[:5]
        # both tenants have requests waiting the whole time (6 clients each, 4 slots in all): from
        # the second second to the stop, each is served in proportion to its weight
        window = [tenant for tenant, at in done if t0 + 2 <= at <= t_end]
        assert len(window) > 100, len(window)
        share = window.count("heavy") / len(window)
        assert abs(share - 0.75) <= 0.075, (share, len(window))
        used = {line["backend"] for line in gw.access_log() if line["cause"] == "ok"}
        assert used == {f"{b.name}/fake-model" for b in net.boxes}


def test_a_model_a_box_loads_on_demand_is_placed_there_through_its_admin_api(gateway, tmp_path):
    assert available() == ""
    with Network("bp", boxes=2) as net:
        a, b = net.boxes
        start_box(a, tmp_path / "boxes", fake_box_config(net))
        # b's runtime is not started by b itself: the team's gateway starts it, a replica first
        start_box(b, tmp_path / "boxes", fake_box_config(net, on_demand=True))
        gw = gateway(boxes_config(net))

        def replicas_up() -> set[str]:
            rows = httpx.get(gw.url + "/admin/runtimes", timeout=10).json()["runtimes"]
            return {r["name"] for r in rows if r.get("remote") and r["up"] and r["remote_state"] == "loaded"}

        wait_until(lambda: replicas_up() == {f"{a.name}/fake-model", f"{b.name}/fake-model"}, 60,
                   what="the model loaded on both boxes")
        assert f"box {b.name}: starting fake" in gw.log_text()
        # the dashboard's figures and /health say which box each replica is on, and each box's state
        stats = httpx.get(gw.url + "/admin/stats", timeout=10).json()
        assert {(x["name"], x["box"]) for x in stats["backends"]} == {(f"{n}/fake-model", n) for n in (a.name, b.name)}
        assert [x["state"] for x in stats["boxes"]["boxes"]] == ["up", "up"]
        health = httpx.get(gw.url + "/health", timeout=10).json()
        assert [(x["name"], x["state"], x["replicas_up"]) for x in health["boxes"]] == [(a.name, "up", 1),
                                                                                          (b.name, "up", 1)]
        listing = subprocess.run([sys.executable, "-m", "passerelle", "runtime", "list", "--url", gw.url],
                                 capture_output=True, text=True, timeout=60)
        assert listing.returncode == 0, listing.stderr
        assert f"box {a.name}" in listing.stdout and "placement:" in listing.stdout
        assert "fake-model" in listing.stdout and "replicas" in listing.stdout
        # a client of box a itself takes one of its two slots: the gateway offers one there
        mine: dict[str, object] = {}
        direct = threading.Thread(target=stream_whole, args=(f"http://{a.address}:{PORT}", mine, "a box user"))
        direct.start()

        def capacity() -> int:
            rows = httpx.get(gw.url + "/admin/runtimes", timeout=10).json()["runtimes"]
            return next(r["capacity"] for r in rows if r["name"] == f"{a.name}/fake-model")

        wait_until(lambda: capacity() == 1, 10, what="box a's slot taken by its own user counted out")
        direct.join(60)
        assert mine == {"tokens": 120, "done": True}, mine
        wait_until(lambda: capacity() == 2, 10, what="box a's two slots offered again")
        reload_removes_a_box_whose_stream_ends_whole_and_adds_it_back(gw, a.name, b.name)


def stream_whole(url: str, out: dict[str, object], prompt: str) -> None:
    """A 120-token stream (2.4 s on the fake runtime); ``out``: its tokens and whether it ended
    with [DONE]."""
    tokens, done = 0, False
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
            "model": "fake-model", "stream": True, "max_tokens": 120,
            "messages": [{"role": "user", "content": prompt}]}) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and (choices := orjson.loads(line[6:]).get("choices")):
                tokens += bool(choices[0].get("delta", {}).get("content"))
            out.update(tokens=tokens, done=done)


def reload_removes_a_box_whose_stream_ends_whole_and_adds_it_back(gw, a: str, b: str) -> None:
    """A reload applies [[boxes]] by name: ``b`` removed while a stream runs there (the stream
    ends whole, then its replica goes; ``a`` untouched), then added back (read at once)."""
    cfg = gw.extra["config"]
    full = cfg.read_text()
    head, *blocks = full.split("[[boxes]]")
    only_a = head + "".join("[[boxes]]" + x for x in blocks if f'name = "{a}"' in x)

    def rows() -> dict[str, dict]:
        return {r["name"]: r for r in httpx.get(gw.url + "/admin/runtimes", timeout=10).json()["runtimes"]
                if r.get("remote")}

    outs: list[dict[str, object]] = [{}, {}]
    # (each its own conversation: the same opening would follow its affinity to one box)
    threads = [threading.Thread(target=stream_whole, args=(gw.url, o, f"a long one, {i}"))
               for i, o in enumerate(outs)]
    for t in threads:
        t.start()
    wait_until(lambda: all(r["in_flight"] == 1 for r in rows().values()), 30, what="a stream on each box")
    cfg.write_text(only_a)
    plan = httpx.post(gw.url + "/admin/reload", timeout=60).json()
    assert plan["boxes"]["removed"] == [b] and plan["boxes"]["kept"] == [a] and plan["needs_restart"] == []
    assert rows()[f"{b}/fake-model"]["in_flight"] == 1  # draining: still listed while its stream runs
    for t in threads:
        t.join(60)
    assert all(o == {"tokens": 120, "done": True} for o in outs), outs  # both whole, the removed box's too
    wait_until(lambda: set(rows()) == {f"{a}/fake-model"}, 10, what=f"{b}'s replica gone once drained")
    assert f"box {b} removed from the configuration" in gw.log_text()
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=60,
                   json={"model": "fake-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and gw.log_for(r.headers["x-request-id"])["backend"] == f"{a}/fake-model"
    cfg.write_text(full)
    plan = httpx.post(gw.url + "/admin/reload", timeout=60).json()
    assert plan["boxes"]["added"] == [b]
    wait_until(lambda: {n for n, r in rows().items() if r["up"]} == {f"{a}/fake-model", f"{b}/fake-model"}, 10,
               what=f"{b}'s replica back at once")


def test_a_request_queued_when_a_box_dies_is_served_by_the_other_box(gateway, tmp_path):
    assert available() == ""
    with Network("bz", boxes=2) as net:
        for box in net.boxes:
            start_box(box, tmp_path / "boxes", fake_box_config(net, slots=1, ttft_ms=20, itl_ms=50))
        gw = gateway(boxes_config(net))

        def in_flight() -> dict[str, int]:
            rows = httpx.get(gw.url + "/admin/runtimes", timeout=10).json()["runtimes"]
            return {r["name"]: r["in_flight"] for r in rows if r.get("remote")}

        def ask(max_tokens: int, out: list[httpx.Response]) -> threading.Thread:
            def run() -> None:
                out.append(httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={
                    "model": "fake-model", "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": f"a conversation of its own, {max_tokens}"}]}))
            t = threading.Thread(target=run)
            t.start()
            return t

        long_out: list[httpx.Response] = []
        long_t = ask(160, long_out)  # 8 s on its box
        held = wait_until(lambda: [n for n, k in in_flight().items() if k == 1], 30, what="the long request running")
        lost = next(b for b in net.boxes if held == [f"{b.name}/fake-model"])
        short_out: list[httpx.Response] = []
        short_t = ask(40, short_out)  # 2 s, on the other box
        wait_until(lambda: all(k == 1 for k in in_flight().values()), 30, what="both boxes busy")
        queued_out: list[httpx.Response] = []
        queued_t = ask(4, queued_out)  # no slot free: it waits in the gateway's queue
        wait_until(lambda: httpx.get(gw.url + "/admin/stats", timeout=10).json()["classes"]["standard"]["waiting"],
                   10, what="a request queued")
        lost.kill()
        for t in (queued_t, short_t, long_t):
            t.join(60)
        assert short_out[0].status_code == 200 and queued_out[0].status_code == 200, queued_out[0].text
        lines = {line["request_id"]: line for line in gw.access_log()}
        served = lines[queued_out[0].headers["x-request-id"]]
        assert served["backend"] != held[0] and served["cause"] == "ok", served
        # the long answer, not streamed, had sent nothing to its client yet: it was asked again of
        # the box that is left, and its client got it whole
        assert long_out[0].status_code == 200 and long_out[0].json()["usage"]["completion_tokens"] == 160
        assert lines[long_out[0].headers["x-request-id"]]["backend"] != held[0]
