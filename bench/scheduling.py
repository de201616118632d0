"""Priority and fair share in front of a real llama-server, measured side by side in one run.

1. Interactive TTFT p95 alone, then under a batch flood (3x the slots, long outputs), one
   interactive request about every second: straight to llama-server (its FIFO) vs through passerelle.
2. Two backlogged batch tenants of equal weight, one with 4x the concurrency of the other:
   each one's share of generated tokens through passerelle (and straight, for reference), counted
   over the steady part of the phase (not the start, when whoever came first holds every slot).
3. Aggregate tokens/s under the flood, through passerelle vs direct.

Every prompt is fresh, so that no run profits from llama-server's prompt cache. The slot kept free
of batch work for interactive requests costs batch throughput; ``--also-batch-share 1.0`` runs the
flood through a second gateway without that reservation too, so the trade-off shows in one run.
A reference phase sends only slots - 1 batch streams straight to llama-server: the interactive
request always finds a free slot, as through passerelle, so its TTFT there is the runtime's own
slowdown under the remaining batch work, which no gateway in front of it can remove.

    .venv/bin/python bench/scheduling.py [--slots 4] [--phase-s 40] [--only alone,flood,fair]
                                         [--also-batch-share 1.0] [--toml ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from harness import free_port, pct, wait_http

from passerelle.chunks import CHAT  # a content event: a token, not the empty delta some chunks carry
from passerelle.runtimes import embedded

MODEL = "gemma-3-270m"


class Load:
    def __init__(self, base: str, session: aiohttp.ClientSession) -> None:
        self.base = base
        self.session = session
        self.token_times: dict[str, list[float]] = {}  # arrival of each content event, per tenant
        self.ttfts: list[float] = []
        self.errors = 0
        self.t0 = 0.0

    def steady(self, skip_s: float, seconds: float) -> dict[str, int]:
        """Content events (tokens) streamed per tenant in the steady part of the phase: after
        ``skip_s`` (the start, when whoever came first holds every slot) and before the end (after
        which no request starts and the queued ones drain, a tail whose length depends on the
        queue, not on the rate)."""
        lo, hi = self.t0 + skip_s, self.t0 + seconds
        return {t: sum(1 for x in xs if lo <= x < hi) for t, xs in self.token_times.items()}

    def shares(self, skip_s: float, seconds: float) -> dict[str, float]:
        counts = self.steady(skip_s, seconds)
        total = sum(counts.values()) or 1
        return {t: n / total for t, n in counts.items()}

    async def one(self, *, tenant: str, cls: str, max_tokens: int, record_ttft: bool = False) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "user": tenant,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"{tenant} {time.time_ns()}: tell a long story."}]}
        t0 = time.perf_counter()
        first = None
        times = self.token_times.setdefault(tenant, [])
        try:
            async with self.session.post(self.base + "/v1/chat/completions", json=body,
                                         headers={"X-Priority": cls}) as resp:
                if resp.status != 200:
                    self.errors += 1
                    await resp.read()
                    return
                async for line in resp.content:
                    if CHAT.search(line):
                        now = time.perf_counter()
                        times.append(now)
                        if first is None:
                            first = now - t0
        except aiohttp.ClientError:
            self.errors += 1
            return
        if record_ttft and first is not None:
            self.ttfts.append(first)

    async def closed_loop(self, stop: float, *, tenant: str, cls: str, max_tokens: int) -> None:
        while time.perf_counter() < stop:
            await self.one(tenant=tenant, cls=cls, max_tokens=max_tokens)

    async def interactive(self, stop: float, every_s: float = 1.0) -> None:
        tasks = []
        while time.perf_counter() < stop:
            tasks.append(asyncio.create_task(self.one(tenant="chat-user", cls="interactive", max_tokens=16,
                                                      record_ttft=True)))
            await asyncio.sleep(every_s)
        await asyncio.gather(*tasks)


async def phase(base: str, seconds: float, *, flood: int = 0, fair: tuple[int, int] | None = None,
                interactive: bool = True) -> tuple[Load, float]:
    connector = aiohttp.TCPConnector(force_close=True, limit=0)  # llama-server drops reused connections
    async with aiohttp.ClientSession(connector=connector) as session:
        load = Load(base, session)
        t0 = load.t0 = time.perf_counter()
        stop = t0 + seconds
        jobs = [load.closed_loop(stop, tenant="bulk", cls="batch", max_tokens=64) for _ in range(flood)]
        if fair:
            jobs += [load.closed_loop(stop, tenant="tenant-a", cls="batch", max_tokens=64) for _ in range(fair[0])]
            jobs += [load.closed_loop(stop, tenant="tenant-b", cls="batch", max_tokens=64) for _ in range(fair[1])]
        if interactive:
            jobs.append(load.interactive(stop))
        await asyncio.gather(*jobs)
        return load, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=40.0)
    ap.add_argument("--only", default="", help="comma-separated phases to run: alone, flood, fair (default: all)")
    ap.add_argument("--toml", default="", help="extra gateway configuration, e.g. $'[scheduler]\\nhold_s = 0'")
    ap.add_argument("--also-batch-share", type=float, action="append", default=[],
                    help="also run the flood through a gateway whose batch class may hold this share of the "
                         "slots (the default is 0.75): the latency / throughput trade-off, same run")
    args = ap.parse_args()
    binary, model = embedded.find_or_build_llama_server(), embedded.ensure_default_model()
    lport = free_port()
    work = Path(tempfile.mkdtemp(prefix="passerelle-sched-"))
    llama = subprocess.Popen([str(binary), "-m", str(model), "--alias", MODEL, "--port", str(lport),
                              "-np", str(args.slots), "-c", str(args.slots * 2048), "--metrics", "--slots",
                              "--no-webui"], stdout=open(work / "llama.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    gateways: list[subprocess.Popen] = []

    def start_gateway(tag: str, extra: str) -> str:
        port = free_port()
        cfg = work / f"{tag}.toml"
        cfg.write_text(args.toml + "\n" + extra + '\n[auth]\nanonymous_max_priority = "interactive"\n'
                       f'[server]\naccess_log = false\n'
                       f'[[backends]]\nname = "b"\nkind = "llama-server"\nurl = "http://127.0.0.1:{lport}"\n'
                       f'models = ["{MODEL}"]\nmax_concurrency = {args.slots}\n')
        gateways.append(subprocess.Popen(
            [sys.executable, "-m", "passerelle", "serve", "--config", str(cfg), "--port", str(port)],
            stdout=open(work / f"{tag}.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PASSERELLE_STATE": str(work / tag)}))
        return f"http://127.0.0.1:{port}"

    direct, gateway = f"http://127.0.0.1:{lport}", start_gateway("gateway", "")
    variants = {f"flood share {s:g}": start_gateway(f"share-{s:g}", f'[[classes]]\nname = "batch"\nrank = 2\n'
                                                                    f'max_queue = 4096\nslot_share = {s}\n')
                for s in args.also_batch_share}
    flood = 3 * args.slots
    results: dict[str, tuple[Load, float]] = {}
    try:
        wait_http(direct + "/health")
        for url in (gateway, *variants.values()):
            wait_http(url + "/ready")
        asyncio.run(phase(direct, 5, interactive=True))  # warm-up
        only = set(args.only.split(",")) if args.only else {"alone", "flood", "fair"}
        for name, base, kw in [
            ("alone direct", direct, {}),
            ("alone gateway", gateway, {}),
            ("flood direct", direct, {"flood": flood}),
            (f"flood direct {args.slots - 1}", direct, {"flood": args.slots - 1}),
            ("flood gateway", gateway, {"flood": flood}),
            *((name, url, {"flood": flood}) for name, url in variants.items()),
            ("fair direct", direct, {"fair": (8, 2), "interactive": False}),
            ("fair gateway", gateway, {"fair": (8, 2), "interactive": False}),
        ]:
            if name.split()[0] not in only:
                continue
            print(f"running: {name} ({args.phase_s:g} s)", file=sys.stderr, flush=True)
            results[name] = asyncio.run(phase(base, args.phase_s, **kw))
        with urllib.request.urlopen(gateway + "/admin/stats", timeout=5) as resp:
            holds = json.loads(resp.read()).get("slot_holds")
    finally:
        for gw in gateways:
            gw.send_signal(signal.SIGTERM)
        for gw in gateways:
            gw.wait(60)
        llama.terminate()
        llama.wait(30)

    def p95(name: str) -> float:
        return pct(results[name][0].ttfts, 95) * 1000

    skip = min(10.0, args.phase_s / 4)

    def report(name: str) -> bool:
        return name in results

    print(f"\nGemma 3 270M on llama-server, {args.slots} slots; batch flood = {flood} closed-loop streams of 64 "
          f"tokens; interactive = 1 request/s, 16 tokens; {args.phase_s:g} s per phase; fresh prompts.\n")
    print("1. Interactive TTFT (ms)")
    print(f"   {'':16}{'n':>4}{'p50':>9}{'p95':>9}")
    reference = f"flood direct {args.slots - 1}"
    for name in ("alone direct", "alone gateway", "flood direct", reference, "flood gateway", *variants):
        if report(name):
            xs = results[name][0].ttfts
            print(f"   {name:16}{len(xs):>4}{pct(xs, 50) * 1000:9.0f}{pct(xs, 95) * 1000:9.0f}")
    if report("alone direct") and report("flood direct"):
        print(f"   flood/alone p95: direct {p95('flood direct') / p95('alone direct'):.2f}x, "
              f"through passerelle {p95('flood gateway') / p95('alone gateway'):.2f}x (goal <= 2x)"
              + "".join(f", {n} {p95(n) / p95('alone gateway'):.2f}x" for n in variants if report(n)))
        print(f"   {reference}: only {args.slots - 1} batch streams straight to llama-server, so one slot is "
              f"always free for the\n   interactive request, as passerelle keeps it: "
              f"{p95(reference) / p95('alone direct'):.2f}x, the runtime's own slowdown, the least a gateway can give")
    if report("fair direct"):
        print("\n2. Share of generated tokens, tenant-a (8 streams) vs tenant-b (2 streams), equal weight")
        print(f"   (tokens streamed between {skip:g} s and {args.phase_s:g} s into the phase)")
        for name in ("fair direct", "fair gateway"):
            shares = results[name][0].shares(skip, args.phase_s)
            print(f"   {name:16} a {shares.get('tenant-a', 0):6.1%}   b {shares.get('tenant-b', 0):6.1%}"
                  f"   (goal through passerelle: 50% +/- 10%)")
        print(f"   freed slots held for a returning tenant: {holds}")
    if report("flood direct"):
        print(f"\n3. Aggregate tokens/s under the flood (streamed between {skip:g} s and {args.phase_s:g} s)")
        rates = {n: sum(results[n][0].steady(skip, args.phase_s).values()) / (args.phase_s - skip)
                 for n in ("flood direct", "flood gateway", *variants) if report(n)}
        print(f"   direct {rates['flood direct']:.1f}   through passerelle {rates['flood gateway']:.1f}   "
              f"ratio {rates['flood gateway'] / rates['flood direct']:.3f} (goal >= 0.95)")
        for n in variants:
            if n in rates:
                print(f"   {n}: {rates[n]:.1f}, ratio {rates[n] / rates['flood direct']:.3f}")
    errors = {n: r[0].errors for n, r in results.items() if r[0].errors}
    print(f"\nerrors: {errors or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
