"""Clients written to abuse the gateway (passerelle/testing/hostile_clients.py), against a real
gateway subprocess in front of the fake runtime. Each test checks that the abuse is cut short with
the documented answer (docs/limits.md), that a well-behaved client was served meanwhile, and that
the gateway's file descriptors come back exactly to their baseline and its memory close to it."""

from __future__ import annotations

import resource

import httpx
import orjson
import pytest

from passerelle.testing import hostile_clients as hc
from tests.conftest import upstream_config, wait_until

MODEL = "fake-model"
RSS_SLACK_KIB = 16 * 1024  # the allocator keeps some of what was freed; an unbounded buffer is far more
LIMITS = """
[server]
head_timeout_s = 1
body_timeout_s = 1
keep_alive_s = 1
"""


class Rig:
    def __init__(self, gw, fake, headers: dict[str, str] | None = None) -> None:
        self.gw, self.fake, self.headers = gw, fake, headers
        self.addr = ("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))
        self.probe = hc.Probe(gw.proc.pid, {int(fake.url.rsplit(":", 1)[1])})
        client = hc.WellBehaved(self.addr, MODEL, headers=headers)
        for _ in range(3):  # warm up: first allocations, the upstream pool
            assert client.once(), client.served.last_error
        self.base = self.probe.sample()

    def client(self) -> hc.WellBehaved:
        return hc.WellBehaved(self.addr, MODEL, headers=self.headers)

    def served(self, client: hc.WellBehaved) -> None:
        s = client.served
        assert s.ok >= 1 and s.failed == 0, f"well-behaved client: {s}"

    def back_to_baseline(self, timeout: float = 10.0) -> None:
        self.probe.wait_fds(self.base.fds, timeout)
        wait_until(lambda: self.probe.rss_kib() <= self.base.rss_kib + RSS_SLACK_KIB, timeout,
                   what=f"gateway RSS back within {RSS_SLACK_KIB // 1024} MiB of {self.base.rss_kib // 1024} MiB")


@pytest.fixture
def rig(gateway, fake_backend):
    def start(extra: str = LIMITS, *, headers: dict[str, str] | None = None, **fake_opts) -> Rig:
        fake = fake_backend(**{"ttft_ms": 5, "itl_ms": 1, **fake_opts})
        gw = gateway(upstream_config(fake.url, model=MODEL, kind="openai", slots=fake_opts.get("slots", 64))
                     + extra)
        return Rig(gw, fake, headers)

    return start


def test_idle_sockets_are_closed_after_keep_alive_s(rig):
    r = rig()
    with r.client() as client:
        socks = hc.open_idle(r.addr, 300)
        assert len(socks) == 300
        closed, got = hc.wait_all_closed(socks, 10)
        hc.close_all(socks)
    assert closed == 300 and not any(got)  # closed without a word: nothing was asked
    r.served(client)
    r.back_to_baseline()


def test_slowloris_heads_get_408_and_are_closed(rig):
    r = rig()
    with r.client() as client:
        socks, trickle = hc.slow_heads(r.addr, 50, interval=0.2)
        closed, got = hc.wait_all_closed(socks, 10)
        trickle.stop()
        hc.close_all(socks)
    assert closed == 50 and all(hc.status_of(g) == 408 for g in got)
    assert orjson.loads(hc.body_of(got[0]))["error"]["code"] == "request_timeout"
    r.served(client)
    r.back_to_baseline()


def test_slowloris_bodies_get_408_and_their_memory_comes_back(rig):
    r = rig()
    with r.client() as client, hc.PeakRss(r.probe) as peak:
        socks = hc.slow_bodies(r.addr, 20, declared=8 * 1024 * 1024 - 1, sent=4 * 1024 * 1024)
        closed, got = hc.wait_all_closed(socks, 10)
        hc.close_all(socks)
    assert closed == 20 and all(hc.status_of(g) == 408 for g in got)
    assert peak.peak_kib < r.base.rss_kib + 20 * 4 * 1024 + 64 * 1024  # what they sent, never more
    r.served(client)
    r.back_to_baseline()
    lines = [line for line in r.gw.access_log() if line["status"] == 408]
    assert len(lines) == 20 and {line["cause"] for line in lines} == {"invalid_request"}


def test_bodies_without_a_key_are_refused_before_they_are_read(rig, gateway, tmp_path):
    from passerelle.tenants.keys import KeyStore

    _, secret = KeyStore(tmp_path / "keys.db").create("good")
    r = rig(LIMITS + f'[auth]\ndb = "{tmp_path / "keys.db"}"\n', headers={"Authorization": f"Bearer {secret}"})
    with r.client() as client:
        # under [auth] failed_attempts_per_minute (20 per address): the well-behaved client shares it
        socks = hc.slow_bodies(r.addr, 15, declared=8 * 1024 * 1024 - 1, sent=0)
        _, got = hc.wait_all_closed(socks, 3)
        hc.close_all(socks)
    assert all(hc.status_of(g) == 401 for g in got), [g[:60] for g in got]
    r.served(client)
    r.back_to_baseline()


def test_a_huge_header_is_refused_at_the_cap_and_never_held(rig):
    r = rig()
    with r.client() as client, hc.PeakRss(r.probe) as peak:
        status, took = hc.huge_header(r.addr, 64 * 1024 * 1024, timeout=30)
        assert hc.many_headers(r.addr, 2000) == 431
    assert status == 431 and took < 5, (status, took)
    assert peak.peak_kib < r.base.rss_kib + RSS_SLACK_KIB, peak.peak_kib
    r.served(client)
    r.back_to_baseline()


def test_many_tenants_from_user_leave_no_state_behind(rig):
    r = rig()
    log_before = r.gw.log_path.stat().st_size
    with r.client() as client:
        for i in range(100):
            raw = hc.post(r.addr, hc.CHAT, hc.chat_body(MODEL, user=f"{i:04d}" + "u" * (1024 * 1024)))
            assert hc.status_of(raw) == 200
    scrape = httpx.get(r.gw.url + "/metrics", timeout=30).content
    assert len(scrape) < 256 * 1024 and b'tenant="other"' in scrape and b"uuuu" not in scrape
    lines = [line for line in r.gw.access_log() if line["tenant"].startswith("00")]
    assert len(lines) == 100 and {len(line["tenant"]) for line in lines} == {64}
    assert r.gw.log_path.stat().st_size - log_before < 1024 * 1024  # 100 lines, not 100 MiB
    r.served(client)
    r.back_to_baseline()


def test_clients_that_never_read_give_their_slots_and_their_keys_concurrency_back(rig, tmp_path):
    # The regression: the error event was written to a client that did not read, blocked on flow
    # control, and the slot and the key's concurrency were never given back; two such clients on a
    # 2-slot backend and a well-behaved request got 429 queue_timeout 20 s later.
    from passerelle.tenants.keys import KeyStore

    store = KeyStore(tmp_path / "keys.db")
    _, good = store.create("good")
    hostile_key, bad = store.create("hostile", max_concurrency=2)
    write_s = 2.0  # [timeouts] client_write_s and between_tokens_s below
    r = rig(LIMITS + f'[timeouts]\nbetween_tokens_s = {write_s}\nclient_write_s = {write_s}\n'
            f'[auth]\ndb = "{tmp_path / "keys.db"}"\n', headers={"Authorization": f"Bearer {good}"},
            slots=2, itl_ms=0)  # a fast runtime: the kernel's buffers fill in a moment
    body = hc.chat_body(MODEL, stream=True, max_tokens=200_000)
    pid = r.gw.proc.pid
    with r.client() as client:
        socks = [hc.stream_without_reading(r.addr, body, {"Authorization": f"Bearer {bad}"}) for _ in range(2)]
        try:
            ids = [hc.request_id(s.recv(2048)) for s in socks]  # the head and a little; nothing more is read
            hc.wait_stalled(pid, socks, 10)
            # From here the gateway's writes wait: each client is cut at most one watchdog pass (1 s)
            # after client_write_s; the slack is for a loaded machine, far below what a leak takes.
            within = write_s + 1.0 + 1.5
            wait_until(lambda: all(hc.unsent_to(pid, s) == -1 for s in socks), within,
                       what="both clients that do not read cut")
            stats = wait_until(lambda: (st := httpx.get(r.gw.url + "/admin/stats", timeout=5).json())["running"] == 0
                               and st, within, what="the slots back")
            [row] = [k for k in stats["keys"] if k["id"] == hostile_key.id]
            assert row["running"] == 0 and row["queued"] == 0  # the key's concurrency is back
            for s in socks:  # dropped with a reset: the client knows its answer was cut
                with pytest.raises(ConnectionResetError):
                    while s.recv(1 << 20):
                        pass
        finally:
            hc.close_all(socks)
        # a request on that key is served again
        again = hc.WellBehaved(r.addr, MODEL, headers={"Authorization": f"Bearer {bad}"})
        assert again.once() and again.once(), again.served.last_error
    r.served(client)  # beside them, on the same two slots
    lines = r.gw.access_log()
    for rid in ids:
        assert [line["cause"] for line in lines if line["request_id"] == rid] == ["client_timeout"]
    r.back_to_baseline()


def test_a_connection_flood_past_the_limit_under_a_low_fd_limit(rig):
    r = rig("[server]\nmax_connections = 128\nkeep_alive_s = 60\n")  # only the limit makes room
    resource.prlimit(r.gw.proc.pid, resource.RLIMIT_NOFILE, (256, 256))
    socks = hc.open_idle(r.addr, 300)
    try:
        assert len(socks) == 300
        # the gateway closes the longest-idle connections to make room: never more than the limit
        wait_until(lambda: r.probe.fds() <= r.base.fds + 128 + 1, 10, what="connections within the limit")
        with r.client() as client:
            wait_until(lambda: client.served.ok >= 3, 15, what="the well-behaved client served during the flood")
    finally:
        hc.close_all(socks)
    r.served(client)
    r.back_to_baseline()

