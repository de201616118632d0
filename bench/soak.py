"""A soak with faults: many streams for a long while through passerelle, with a runtime and clients
that misbehave now and then, and a reload every few minutes. Does anything leak or get lost?

    .venv/bin/python bench/soak.py --minutes 30            # the issue's soak (64 streams, 30 min)
    .venv/bin/python bench/soak.py --minutes 2 --streams 16 # a quick look

One ``passerelle fake-backend`` (TTFT 50 ms, 10 ms between tokens, 32 tokens; ``--fault
reset-mid-chunk --fault-rate 0.01``: 1 % of answers are cut by a TCP reset in the middle of a
chunk) behind one passerelle process (default settings, ``[timeouts] client_write_s`` 5 s). The
load is ``--streams`` closed-loop users on uvloop, each sending one streaming chat request after
another on a keep-alive connection; of their requests

* 1 % hang up after the first token (``client_disconnect``),
* 1 % stop reading after the response head, on a socket with a 4 KiB receive buffer, and wait for
  the gateway to cut them (``client_timeout``); they ask for a long answer at a fast pace (15 MB,
  ``"fake_itl_ms"``), which fills every buffer on the way,
* the rest read their answer to the end (``ok``, or ``upstream_error`` for the runtime's resets).

Every ``--reload-every`` seconds (300) the configuration changes the backend (its
``max_concurrency``) and the gateway gets SIGHUP: the backend is replaced under the same name and
the old one drains while requests keep coming.

At the end (the load stopped, the gateway idle) it reports, and ``soak.json`` keeps:

* in flight: ``/admin/stats`` running and ``passerelle_requests_running`` back to 0;
* RSS and file descriptors of the gateway sampled every ``--interval`` s after ``--warmup`` s:
  first, last, min, max and spread, and the idle figures before and after the load;
* requests sent = access-log lines = usage rows (SQLite), by cause: no request ends without
  one, and every request id a client saw has its line.

Figures, not a pass/fail test. Results go to ``--out`` (default bench/out/soak).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import select
import signal
import socket
import sqlite3
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import MODEL, ROOT, report_head, rss_bytes, serve, start_fake, write_json
from loadgen import run_async

from passerelle.chunks import CHAT  # a content event: a token (the role chunk's "content":"" is not one)

MiB = 1 << 20


@dataclass
class Tally:
    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)  # what the client saw
    ids: set[str] = field(default_factory=set)  # X-Request-Id of every response head seen
    kind_of: dict[str, str] = field(default_factory=dict)  # request id -> what its client did
    no_head: int = 0  # requests whose response head never came (the connection failed first)
    never_cut: int = 0  # non-reading clients the gateway did not cut within the wait


def request_bytes(max_tokens: int, **extra: Any) -> bytes:
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": max_tokens, **extra,
                       "messages": [{"role": "user", "content": "Tell me about the river and its mills."}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


class Reader:
    """One HTTP/1.1 response read with httptools: head, then body events."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: dict[bytes, bytes] = {}
        self.body = bytearray()
        self.head_done = False
        self.done = False
        self.keep_alive = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_message_complete(self) -> None:
        self.done = True
        self.keep_alive = self.parser.should_keep_alive()


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _connect(host: str, port: int, rcvbuf: int | None = None) -> Conn:
    if rcvbuf is None:
        return await asyncio.open_connection(host, port)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    return await asyncio.open_connection(sock=sock)


def _cut(sock: socket.socket) -> bool:
    """Has the peer closed or reset this connection? (Without reading what waits in the buffer.)"""
    p = select.poll()
    p.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, ev in p.poll(0))


async def user(host: str, port: int, stop_at: float, tally: Tally, rng: random.Random, args: argparse.Namespace,
               wait_cut_s: float) -> None:
    normal = request_bytes(args.tokens)
    # 15 MB at 20,000 tokens/s (the fake's per-request pace): more than every buffer on the way
    # holds (the gateway's kernel send buffer grows to a few MiB), within a second or two
    long = request_bytes(100_000, fake_itl_ms=0.05)
    conn: Conn | None = None
    while time.monotonic() < stop_at:
        roll = rng.random()
        kind = "left" if roll < args.disconnect_rate else \
            "stopped reading" if roll < args.disconnect_rate + args.stop_reading_rate else "read"
        tally.sent += 1
        if kind == "stopped reading":
            r, w = await _connect(host, port, rcvbuf=4096)
            try:
                w.write(long)
                head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 30)
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"x-request-id:"):
                        rid = line.split(b":", 1)[1].strip().decode()
                        tally.ids.add(rid)
                        tally.kind_of[rid] = kind
                if not head.startswith(b"HTTP/1.1 200"):
                    tally.outcomes[f"stopped reading: refused ({head[9:12].decode()})"] += 1
                    continue
                sock = w.get_extra_info("socket")
                w.transport.pause_reading()  # nothing more is read
                deadline = time.monotonic() + wait_cut_s
                while not _cut(sock) and time.monotonic() < deadline:
                    await asyncio.sleep(0.25)
                # (not cut: its request ended first, e.g. the runtime reset it and the client got an
                # error event it did not read; the gateway's cause for it says which)
                tally.outcomes["stopped reading: cut by the gateway" if _cut(sock) else "stopped reading: not cut"] += 1
                if not _cut(sock):
                    tally.never_cut += 1
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                tally.no_head += 1
                tally.outcomes[f"stopped reading: {exc.__class__.__name__}"] += 1
            finally:
                w.transport.abort()
            continue
        if conn is not None and _cut(conn[1].get_extra_info("socket")):
            conn[1].transport.abort()  # the gateway closed it while idle (keep-alive timeout): not a lost request
            conn = None
        if conn is None:
            conn = await _connect(host, port)
        r, w = conn
        reader = Reader()
        try:
            w.write(normal)
            while not reader.done:
                data = await asyncio.wait_for(r.read(65536), 60)
                if not data:
                    raise ConnectionResetError("the gateway closed the connection")
                reader.parser.feed_data(data)
                if reader.head_done and b"x-request-id" in reader.headers:
                    rid = reader.headers[b"x-request-id"].decode()
                    tally.ids.add(rid)
                    tally.kind_of[rid] = kind
                if kind == "left" and CHAT.search(reader.body):
                    break
            if kind == "left" and not reader.done:
                w.transport.abort()
                conn = None
                tally.outcomes["left after the first token"] += 1
                continue
            text = bytes(reader.body)
            ok = b"data: [DONE]" in text
            tally.outcomes[f"{kind}: " + ("[DONE]" if ok else "error event" if b'"error"' in text else "other")] += 1
            if not reader.keep_alive:
                w.transport.abort()
                conn = None
        except (OSError, httptools.HttpParserError, TimeoutError) as exc:
            if not reader.head_done:
                tally.no_head += 1
            tally.outcomes[f"{kind}: {exc.__class__.__name__}"] += 1
            w.transport.abort()
            conn = None
    if conn is not None:
        conn[1].transport.abort()


# -- the gateway's side ------------------------------------------------------------------------
def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def in_flight(url: str) -> tuple[int, float]:
    stats = get_json(url + "/admin/stats")
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    gauge = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("passerelle_requests_running{"))
    return stats["running"], gauge


def rss_fds(pid: int) -> tuple[float, int]:
    return rss_bytes([pid]) / MiB, len(os.listdir(f"/proc/{pid}/fd"))


def threads_and_heap(pid: int) -> tuple[int, float, float]:
    """Threads, and resident MiB of the main heap vs the other anonymous mappings (thread arenas,
    mmapped buffers): where RSS sits, when it moves."""
    threads = len(os.listdir(f"/proc/{pid}/task"))
    heap = anon = 0
    name = ""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            first = line.split(maxsplit=5)
            if first and "-" in first[0] and len(first) >= 5:
                name = first[5] if len(first) > 5 else ""
            elif line.startswith("Rss:"):
                kb = int(line.split()[1])
                if name == "[heap]":
                    heap += kb
                elif not name:
                    anon += kb
    return threads, heap / 1024, anon / 1024


def config_text(fake_url: str, db: Path, capacity: int) -> str:
    return f"""
[timeouts]
client_write_s = 5

[auth]
db = "{db}"

[[backends]]
name = "fake"
kind = "openai"
url = "{fake_url}"
models = ["{MODEL}"]
max_concurrency = {capacity}
"""


def spread(xs: list[float]) -> dict[str, Any]:
    lo, hi = min(xs), max(xs)
    return {"samples": len(xs), "first": xs[0], "last": xs[-1], "min": lo, "max": hi,
            "spread_pct": round(100 * (hi - lo) / lo, 2), "growth_pct": round(100 * (xs[-1] - xs[0]) / xs[0], 2)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)
    for old in work.glob("*"):
        if old.is_file():
            old.unlink()
    head = report_head("soak-with-faults")
    # Both processes run this checkout's passerelle (the work folder is their current directory).
    fake = start_fake(work, args.ttft_ms, args.itl_ms, args.tokens, src=ROOT,
                      extra=["--fault", "reset-mid-chunk", "--fault-rate", str(args.reset_rate), "--seed", "1"])
    db = work / "passerelle.db"
    cfg = work / "gateway.toml"
    capacity = 1024
    cfg.write_text(config_text(fake.url, db, capacity))
    gw = serve(work, cfg, src=ROOT, env=dict(kv.split("=", 1) for kv in args.gateway_env))
    gport = int(gw.url.rsplit(":", 1)[1])
    tally = Tally()
    samples: list[dict[str, float]] = []
    reloads: list[float] = []
    try:
        gw.wait_ready("/ready", 60)
        pid = gw.proc.pid
        idle_before = rss_fds(pid)
        total_s = args.minutes * 60
        print(f"soak: {args.streams} streams for {args.minutes:g} min through passerelle (pid {pid}); "
              f"resets {args.reset_rate:.0%}, disconnects {args.disconnect_rate:.0%}, non-reading "
              f"{args.stop_reading_rate:.0%}, a reload every {args.reload_every:g} s", flush=True)

        async def main() -> None:
            nonlocal capacity
            t0 = time.monotonic()
            stop_at = t0 + total_s
            rngs = [random.Random(1000 + i) for i in range(args.streams)]
            users = [asyncio.create_task(user("127.0.0.1", gport, stop_at, tally, rngs[i], args, wait_cut_s=120))
                     for i in range(args.streams)]
            next_sample, next_reload = t0 + args.warmup, t0 + args.reload_every
            while time.monotonic() < stop_at:
                await asyncio.sleep(0.5)
                now = time.monotonic()
                if now >= next_reload and now < stop_at - 5:
                    capacity = 2047 - capacity  # 1024 <-> 1023: the backend is replaced under its name
                    cfg.write_text(config_text(fake.url, db, capacity))
                    os.kill(pid, signal.SIGHUP)
                    reloads.append(round(now - t0, 1))
                    print(f"  t={now - t0:6.0f} s  reload (max_concurrency {capacity})", flush=True)
                    next_reload += args.reload_every
                if now >= next_sample:
                    rss, nfd = rss_fds(pid)
                    threads, heap, anon = threads_and_heap(pid)
                    samples.append({"t_s": round(now - t0, 1), "rss_mib": round(rss, 2), "fds": nfd,
                                    "sent": tally.sent, "threads": threads, "heap_mib": round(heap, 1),
                                    "other_anon_mib": round(anon, 1)})
                    print(f"  t={now - t0:6.0f} s  RSS {rss:6.1f} MiB (heap {heap:5.1f}, other anonymous {anon:5.1f}, "
                          f"{threads} threads)  fds {nfd:4d}  requests sent {tally.sent}", flush=True)
                    next_sample += args.interval
            await asyncio.gather(*users)

        run_async(main())
        # The load has stopped: everything must come back.
        deadline = time.monotonic() + 60
        while in_flight(gw.url) != (0, 0.0) and time.monotonic() < deadline:
            time.sleep(0.2)
        settled = in_flight(gw.url)
        time.sleep(6)  # the upstream pool's idle connections close after 4 s (their sweeper, not a guess)
        idle_after = rss_fds(pid)
        time.sleep(1.5)  # usage rows are written every 0.5 s
        with urllib.request.urlopen(gw.url + "/health", timeout=10):
            pass  # (the access log is flushed on the loop's next pass)
        injected = get_json(fake.url + "/fake/stats")
    finally:
        gw.stop()
        fake.stop()
    lines = [json.loads(ln) for ln in gw.log.read_text().splitlines() if ln.startswith("{") and '"request_id"' in ln]
    causes = Counter(ln["cause"] for ln in lines)
    by_kind: dict[str, Counter[str]] = {}
    errors: Counter[str] = Counter()
    for ln in lines:  # what the gateway recorded, by what the client did
        kind = tally.kind_of.get(ln["request_id"], "no response head")
        by_kind.setdefault(kind, Counter())[ln["cause"]] += 1
        if ln["cause"] != "ok":
            errors[f"{kind} / {ln['cause']}: {ln.get('error', '')[:70]}"] += 1
    logged = {ln["request_id"] for ln in lines}
    with contextlib.closing(sqlite3.connect(db)) as conn:
        usage_rows = conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0]
        usage_causes = dict(conn.execute("SELECT cause, COUNT(*) FROM usage GROUP BY cause").fetchall())
    res: dict[str, Any] = {
        **head, "minutes": args.minutes, "streams": args.streams,
        "rates": {"upstream_reset": args.reset_rate, "client_disconnect": args.disconnect_rate,
                  "client_stops_reading": args.stop_reading_rate},
        "reloads_at_s": reloads, "requests_sent": tally.sent, "runtime_resets_injected": injected["faults"],
        "client_outcomes": dict(tally.outcomes),
        "access_log_lines": len(lines), "causes": dict(causes),
        "causes_by_client_behaviour": {k: dict(v) for k, v in by_kind.items()}, "errors": dict(errors),
        "usage_rows": usage_rows,
        "usage_by_cause": usage_causes, "ids_seen_by_clients": len(tally.ids),
        "ids_without_a_log_line": len(tally.ids - logged), "requests_without_a_head": tally.no_head,
        "non_reading_never_cut": tally.never_cut,
        "in_flight_after": {"admin_stats_running": settled[0], "requests_running_gauge": settled[1]},
        "idle_before": {"rss_mib": round(idle_before[0], 2), "fds": idle_before[1]},
        "idle_after": {"rss_mib": round(idle_after[0], 2), "fds": idle_after[1]},
        "under_load": {"rss_mib": spread([s["rss_mib"] for s in samples]) if len(samples) > 1 else None,
                       "fds": spread([float(s["fds"]) for s in samples]) if len(samples) > 1 else None},
        # The dashboard's window ([metrics] window_s, 300 s) holds one-second slots of figures: RSS grows
        # until it is full. Growth after that is what a leak would look like.
        "after_window": {"rss_mib": spread(late) if len(late := [s["rss_mib"] for s in samples
                                                                if s["t_s"] >= args.window_s + 10]) > 1 else None},
        "samples": samples,
    }
    write_json(out / "soak.json", res)
    print()
    print(f"requests sent {tally.sent}; access-log lines {len(lines)}; usage rows {usage_rows}; "
          f"resets injected by the runtime {injected['faults']}")
    print(f"causes: {dict(causes)}")
    for kind, counts in sorted(by_kind.items()):
        print(f"  clients that {kind}: {dict(counts)}")
    for what, n in errors.most_common():
        print(f"    {n:6d}  {what}")
    print(f"client outcomes: {dict(tally.outcomes)}")
    print(f"request ids seen by clients without a log line: {len(tally.ids - logged)}; "
          f"requests without a response head: {tally.no_head}; non-reading clients not cut: {tally.never_cut}")
    print(f"in flight after the load: /admin/stats {settled[0]}, passerelle_requests_running {settled[1]:g}")
    print(f"idle before: RSS {idle_before[0]:.1f} MiB, {idle_before[1]} fds; idle after: RSS {idle_after[0]:.1f} "
          f"MiB, {idle_after[1]} fds")
    if res["under_load"]["rss_mib"]:
        r, f = res["under_load"]["rss_mib"], res["under_load"]["fds"]
        print(f"under load ({r['samples']} samples after {args.warmup:g} s): RSS {r['first']:.1f} -> {r['last']:.1f} "
              f"MiB (min {r['min']:.1f}, max {r['max']:.1f}, spread {r['spread_pct']} %); fds {f['first']:.0f} -> "
              f"{f['last']:.0f} (min {f['min']:.0f}, max {f['max']:.0f}, spread {f['spread_pct']} %)")
    if res["after_window"]["rss_mib"]:
        r = res["after_window"]["rss_mib"]
        print(f"after the dashboard window filled ({r['samples']} samples from {args.window_s + 10:g} s): RSS "
              f"{r['first']:.1f} -> {r['last']:.1f} MiB (min {r['min']:.1f}, max {r['max']:.1f}, spread "
              f"{r['spread_pct']} %)")
    print(f"wrote {out / 'soak.json'}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (default 30)")
    p.add_argument("--streams", type=int, default=64, help="concurrent users (default 64)")
    p.add_argument("--reset-rate", type=float, default=0.01, help="answers the runtime cuts with a reset (0.01)")
    p.add_argument("--disconnect-rate", type=float, default=0.01, help="requests whose client leaves (0.01)")
    p.add_argument("--stop-reading-rate", type=float, default=0.01, help="requests whose client stops reading (0.01)")
    p.add_argument("--reload-every", type=float, default=300.0, help="seconds between reloads (300)")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before the first sample (60)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples (10)")
    p.add_argument("--window-s", type=float, default=300.0, help="the gateway's [metrics] window_s (300)")
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--tokens", type=int, default=32, help="output tokens of an ordinary request (32)")
    p.add_argument("--gateway-env", action="append", default=[], metavar="K=V",
                   help="extra environment of the gateway process, e.g. MALLOC_MMAP_THRESHOLD_=65536 (repeatable)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "soak"))
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
