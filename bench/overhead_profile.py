"""bench/overhead.py --profile: py-spy on passerelle under load, and where its CPU goes.

At each of ``--profile-levels`` streams (after a warm-up) py-spy samples the gateway process while
the load runs; every sample is charged to a region of a request's life (accounting, the upstream
request, the relay loop, the client send, the event loop in C, ...), and the table says what share
of the gateway's samples each region took, with the top frames by self and inclusive time.
Writes ``profile.json`` and the raw stacks (``profile-N.txt``) to ``--out``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from harness import ROOT, cpu_s, fake_and_passerelle, loadavg, machine, pct, write_json
from loadgen import run_async, run_load

# Where a py-spy sample's time goes. A sample is charged by the region of the request's life it is
# in (the outer frames: accounting, the upstream request, the relay loop), then by what runs inside
# it; C code is charged to the Python frame that called it (with --native its own frames show too).
GC = "garbage collector (cyclic GC passes, wherever they trigger)"
LOOP = "event loop in C (uvloop: epoll, socket reads, callback dispatch)"
SEND = "ASGI send to the client (uvicorn send -> transport.write -> write syscall)"
SCAN = "relay.py: SSE split + byte scan (SSEScanner.feed, _scan, _scan_grammar)"
RELAY = "relay.py: relay loop (StreamRelay.relay: await/resume, per-chunk timeout reschedule)"
UP_READ = "upstream read (http1.py protocol, httptools parser, Response.readany)"
UP_REQ = "upstream request (Backend.post: upstream/client.py pool, connect, write, response headers)"
UVICORN = "uvicorn + httptools request side (HTTP parse, ASGI receive, task start, keep-alive)"
LOG = "access log (record_fields, logging, stderr write)"
METRICS = "metrics (prometheus_client, observe_many)"
DASH = "dashboard window + usage store (livestats, usage)"
LIFECYCLE = "gateway lifecycle (app, gateway.handle, parse, scheduler, routing, request record)"
ASYNCIO = "asyncio machinery (tasks, futures, timeouts) outside the above"
OTHER = "other"
# Frames that only run the loop: a sample whose innermost Python frame is one of these was in C.
OUTER = ("asyncio/runners.py", "uvloop/__init__.py", "uvicorn/server.py", "uvicorn/main.py", "uvicorn/_compat.py")
SYSCALLS = ("write", "writev", "send", "sendmsg", "read", "recv", "recvfrom", "epoll_wait", "epoll_pwait")


def categorise(frames: list[str]) -> str | None:
    """The category of one sample (its frames outermost first); None for an idle helper thread."""
    text = ";".join(frames)
    py = [f for f in frames if ".py" in f]
    if "concurrent/futures/thread.py" in text and "usage.py" not in text:
        return None  # the thread pool waiting for work (py-spy --native counts it as active)
    if "gc_collect" in text:
        return GC
    if not py or any(o in py[-1] for o in OUTER):
        return LOOP
    text = ";".join(py)

    def has(*fragments: str) -> bool:
        return any(f in text for f in fragments)

    if has("RequestResponseCycle.send"):
        return SEND
    if has("Gateway.account", "accesslog.py"):
        if has("accesslog.py", "/logging/"):
            return LOG
        if has("prometheus_client", "passerelle/observe/metrics.py"):
            return METRICS
        if has("livestats.py", "usage.py"):
            return DASH
        return LIFECYCLE
    if has("Backend.post", "passerelle/upstream/client.py"):
        return UP_REQ
    if has("StreamRelay.run", "StreamRelay.relay"):
        if has("SSEScanner.feed", "StreamRelay._scan"):
            return SCAN
        if has("passerelle/upstream/http1.py"):
            return UP_READ
        return RELAY
    # Outside those regions: by the innermost Python frame (uvicorn frames sit at the bottom of
    # every request task, so the whole stack would say "uvicorn").
    inner = py[-1]
    for category, fragments in ((UP_READ, ("passerelle/upstream/http1.py",)), (UVICORN, ("uvicorn/", "httptools")),
                                (METRICS, ("prometheus_client", "passerelle/observe/metrics.py")),
                                (LOG, ("/logging/",)), (DASH, ("livestats.py", "usage.py", "sqlite3")),
                                (LIFECYCLE, ("passerelle/",)), (ASYNCIO, ("asyncio/",))):
        if any(f in inner for f in fragments):
            return category
    return OTHER


def parse_raw(path: Path) -> tuple[Counter[str], Counter[str], Counter[str], Counter[str], int]:
    """(samples by category, self samples by function, inclusive samples by function, samples in
    a system call (with --native), total) from py-spy's raw output."""
    cats: Counter[str] = Counter()
    self_fn: Counter[str] = Counter()
    incl_fn: Counter[str] = Counter()
    syscalls: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not stack_text or not count_text.isdigit():
            continue
        n = int(count_text)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack_text.split(";")]
        cat = categorise(frames)
        if cat is None:
            continue
        total += n
        cats[cat] += n
        self_fn[short(frames[-1])] += n
        for f in set(frames):
            incl_fn[short(f)] += n
        leaf = frames[-1].split(" (", 1)[0]
        if leaf in SYSCALLS and "libc" in frames[-1]:
            syscalls[leaf] += n
    return cats, self_fn, incl_fn, syscalls, total


def short(frame: str) -> str:
    m = re.match(r"(.*) \((.*)\)$", frame)
    if not m:
        return frame
    fn, path = m.groups()
    for marker in ("site-packages/", "lib/python3.11/", "/work/main/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{fn}"


def profile(args: argparse.Namespace, work: Path, out: Path) -> dict[str, Any]:
    pyspy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if pyspy is None:
        raise SystemExit("py-spy not found: .venv/bin/pip install py-spy (it is in the dev extras)")
    levels = [int(x) for x in args.profile_levels.split(",")]
    duration = (args.ttft_ms + (args.tokens - 1) * args.itl_ms) / 1000
    res: dict[str, Any] = {"benchmark": "overhead-profile", "machine": machine(), "levels": []}
    with fake_and_passerelle(work, args.ttft_ms, args.itl_ms, args.tokens, args.passerelle_toml,
                             src=args.src) as (_, gw):
        run_async(run_load(gw.url, 8, 32, args.tokens, stagger_s=duration, timeout=args.timeout))
        for conc in levels:
            raw = out / f"profile-{conc}.txt"
            n = max(args.profile_requests, 8 * conc)
            cmd = [pyspy, "record", "--pid", str(gw.proc.pid), "--rate", str(args.profile_rate), "--format", "raw",
                   "--output", str(raw)]
            if args.native:
                cmd.append("--native")
            else:
                cmd.append("--nonblocking")
            spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.0)  # py-spy attaches
            c0, la0 = cpu_s(gw.pids), loadavg()[0]
            r = run_async(run_load(gw.url, conc, n, args.tokens, stagger_s=duration, timeout=args.timeout))
            cpu = cpu_s(gw.pids) - c0
            spy.send_signal(signal.SIGINT)
            _, err = spy.communicate(timeout=60)
            if not raw.exists():
                raise SystemExit(f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")
            cats, self_fn, incl_fn, syscalls, total = parse_raw(raw)
            if not total:
                raise SystemExit(f"py-spy recorded no samples of the gateway; see {raw}")
            lvl = {"concurrency": conc, "requests": r.requests, "gateway_cpu_s": round(cpu, 2),
                   "gateway_cpu_pct_of_core": round(100 * cpu / r.wall_s, 1), "wall_s": round(r.wall_s, 2),
                   "loadavg": la0, "tokens_per_s": round(r.tokens_per_s), "samples": total,
                   "ttft_ms_p50": round(pct(r.ttft_ms, 50), 2), "ttft_ms_p99": round(pct(r.ttft_ms, 99), 2),
                   "categories_pct": {k: round(100 * v / total, 1) for k, v in cats.most_common()},
                   "self_top_pct": {k: round(100 * v / total, 1) for k, v in self_fn.most_common(25)},
                   "inclusive_top_pct": {k: round(100 * v / total, 1) for k, v in incl_fn.most_common(60)},
                   "syscalls_pct": {k: round(100 * v / total, 1) for k, v in syscalls.most_common()},
                   "native": args.native,
                   "raw": raw.name}
            res["levels"].append(lvl)
            print(f"\n{conc} streams: {r.requests} requests in {r.wall_s:.1f} s, gateway CPU {cpu:.1f} s "
                  f"({lvl['gateway_cpu_pct_of_core']} % of a core), {total} samples; TTFT p50 "
                  f"{lvl['ttft_ms_p50']} ms p99 {lvl['ttft_ms_p99']} ms")
            print("| where | % of gateway CPU samples |\n|---|---:|")
            for k, v in lvl["categories_pct"].items():
                print(f"| {k} | {v} |")
            if syscalls:
                print("in system calls: "
                      + ", ".join(f"{k} {100 * v / total:.1f} %" for k, v in syscalls.most_common()))
            print("top self (leaf) frames:")
            for k, v in list(lvl["self_top_pct"].items())[:15]:
                print(f"  {v:5.1f} %  {k}")
    write_json(out / "profile.json", res)
    print(f"wrote {out / 'profile.json'} and the raw py-spy stacks (profile-N.txt)")
    return res

