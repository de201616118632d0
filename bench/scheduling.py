"""Priority, preemption and fair share in front of a real llama-server, side by side in one run.

1. Interactive TTFT p50/p95 alone, then under a batch flood (3x the slots, long outputs), one
   interactive request about every second: straight to llama-server (its FIFO); through passerelle
   without preemption (batch may hold 3 of 4 slots, the default then); through passerelle with
   preemption at its defaults (batch may hold every slot; an interactive request that waited
   50 ms suspends a batch stream, which resumes later as a continuation).
2. Two backlogged batch tenants of equal weight, one with 4x the concurrency of the other:
   each one's share of generated tokens through passerelle (and straight, for reference), counted
   over the steady part of the phase (not the start, when whoever came first holds every slot).
3. Tokens/s under the flood (all of them, and the batch tenant's alone) against direct FIFO;
   with preemption, suspensions per minute and the prompt tokens llama-server computed again per
   resume (the rest of a continuation's prompt comes from the slot's cache).

Every prompt is fresh, so that no run profits from llama-server's prompt cache. A reference phase
sends only slots - 1 batch streams straight to llama-server: the interactive request always finds
a free slot, so its TTFT there is the runtime's own slowdown under the remaining batch work, which
no gateway in front of it can remove. ``--also-batch-share S`` adds a gateway without preemption
whose batch class may hold that share of the slots.

    .venv/bin/python bench/scheduling.py [--slots 4] [--phase-s 40] [--only alone,flood,fair]
                                         [--also-batch-share 1.0] [--toml ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
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

    def rate(self, skip_s: float, seconds: float, tenant: str | None = None) -> float:
        """Tokens/s in the steady part of the phase: all tenants', or one's."""
        counts = self.steady(skip_s, seconds)
        n = counts.get(tenant, 0) if tenant else sum(counts.values())
        return n / (seconds - skip_s)

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
                            if record_ttft:
                                self.ttfts.append(first)
        except aiohttp.ClientError:
            self.errors += 1

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
                interactive: bool = True, every_s: float = 1.0) -> tuple[Load, float]:
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
            jobs.append(load.interactive(stop, every_s))
        # At the end the clients leave (what is still streaming or queued is cut): only the phase's
        # window is measured, and a drain of queued 64-token requests on a slow CPU takes minutes.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*jobs), timeout=seconds + 0.5)
        return load, time.perf_counter() - t0


def settle(llama: str, timeout: float = 30.0) -> None:
    """Until llama-server is idle (the last phase's cut requests have left their slots)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(llama + "/slots", timeout=5) as resp:
            if not any(s.get("is_processing") for s in json.loads(resp.read())):
                return
        time.sleep(0.2)


def admin_stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/admin/stats", timeout=5) as resp:
        return json.loads(resp.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=40.0)
    ap.add_argument("--only", default="", help="comma-separated phases to run: alone, flood, fair (default: all)")
    ap.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                    help="one more llama-server argument (repeatable), e.g. --llama-arg=-t --llama-arg=2")
    ap.add_argument("--interactive-every", type=float, default=1.0, metavar="S",
                    help="an interactive request every S seconds (default 1)")
    ap.add_argument("--keep", action="store_true", help="keep the access logs and the work folder (printed)")
    ap.add_argument("--toml", default="", help="extra gateway configuration, e.g. $'[scheduler]\\nhold_s = 0'")
    ap.add_argument("--also-batch-share", type=float, action="append", default=[],
                    help="also run the flood through a gateway whose batch class may hold this share of the "
                         "slots (the default is 0.75): the latency / throughput trade-off, same run")
    args = ap.parse_args()
    binary, model = embedded.find_or_build_llama_server(), embedded.ensure_gemma()
    lport = free_port()
    work = Path(tempfile.mkdtemp(prefix="passerelle-sched-"))
    llama = subprocess.Popen([str(binary), "-m", str(model), "--alias", MODEL, "--port", str(lport),
                              "-np", str(args.slots), "-c", str(args.slots * 2048), "--metrics", "--slots",
                              # --swa-full, as the embedded runtime: a continuation reuses its cache
                              "--no-webui", "--swa-full", *args.llama_arg],
                             stdout=open(work / "llama.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    gateways: list[subprocess.Popen] = []

    def start_gateway(tag: str, extra: str) -> str:
        port = free_port()
        cfg = work / f"{tag}.toml"
        # no max_concurrency: llama-server reports its slots (/props total_slots)
        cfg.write_text(args.toml + "\n" + extra + '\n[auth]\nanonymous_max_priority = "interactive"\n'
                       f'[server]\naccess_log = {"true" if args.keep else "false"}\n'
                       f'[[backends]]\nname = "b"\nkind = "llama-server"\nurl = "http://127.0.0.1:{lport}"\n'
                       f'models = ["{MODEL}"]\n')
        gateways.append(subprocess.Popen(
            [sys.executable, "-m", "passerelle", "serve", "--config", str(cfg), "--port", str(port)],
            stdout=open(work / f"{tag}.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PASSERELLE_STATE": str(work / tag)}))
        return f"http://127.0.0.1:{port}"

    no_preempt = "[scheduler]\npreemption = false\n"
    direct, gateway = f"http://127.0.0.1:{lport}", start_gateway("gateway", "")  # the defaults: preemption on
    shared = start_gateway("share", no_preempt)  # preemption off: batch holds 0.75 of the slots
    variants = {f"flood share {s:g}": start_gateway(f"share-{s:g}", no_preempt + f'[[classes]]\nname = "batch"\n'
                                                                    f'rank = 2\nmax_queue = 4096\nslot_share = {s}\n')
                for s in args.also_batch_share}
    flood = 3 * args.slots
    results: dict[str, tuple[Load, float]] = {}
    try:
        wait_http(direct + "/health")
        for url in (gateway, shared, *variants.values()):
            wait_http(url + "/ready")
        asyncio.run(phase(direct, 5, interactive=True))  # warm-up
        only = set(args.only.split(",")) if args.only else {"alone", "flood", "fair"}
        preempt: dict[str, dict[str, float]] = {}
        for name, base, kw in [
            ("alone direct", direct, {}),
            ("alone gateway", gateway, {}),
            ("flood direct", direct, {"flood": flood}),
            (f"flood direct {args.slots - 1}", direct, {"flood": args.slots - 1}),
            ("flood share 0.75", shared, {"flood": flood}),
            ("flood preemption", gateway, {"flood": flood}),
            *((name, url, {"flood": flood}) for name, url in variants.items()),
            ("fair direct", direct, {"fair": (8, 2), "interactive": False}),
            ("fair gateway", gateway, {"fair": (8, 2), "interactive": False}),
        ]:
            if name.split()[0] not in only:
                continue
            print(f"running: {name} ({args.phase_s:g} s)", file=sys.stderr, flush=True)
            settle(direct)
            before = admin_stats(gateway)["preemption"] if base == gateway else None
            results[name] = asyncio.run(phase(base, args.phase_s, every_s=args.interactive_every, **kw))
            if before is not None:
                after = admin_stats(gateway)["preemption"]
                preempt[name] = {k: after[k] - before[k] for k in after if isinstance(after[k], int | float)
                                 and not isinstance(after[k], bool)}
        holds = admin_stats(gateway).get("slot_holds")
    finally:
        for gw in gateways:
            gw.send_signal(signal.SIGTERM)
        for gw in gateways:
            gw.wait(60)
        llama.terminate()
        llama.wait(30)

    def p95(name: str) -> float:
        xs = results[name][0].ttfts
        return pct(xs, 95) * 1000 if xs else math.nan

    floods = ["flood share 0.75", "flood preemption", *variants]

    skip = min(10.0, args.phase_s / 4)

    def report(name: str) -> bool:
        return name in results

    print(f"\nGemma 3 270M on llama-server, {args.slots} slots; batch flood = {flood} closed-loop streams of 64 "
          f"tokens; interactive = a request every {args.interactive_every:g} s, 16 tokens; {args.phase_s:g} s per "
          f"phase; fresh prompts.\n")
    print("1. Interactive TTFT (ms)")
    print(f"   {'':20}{'n':>4}{'p50':>9}{'p95':>9}{'p95/alone':>11}{'p95/ref':>9}")
    reference = f"flood direct {args.slots - 1}"
    for name in ("alone direct", "alone gateway", "flood direct", reference, *floods):
        if report(name):
            xs = results[name][0].ttfts or [math.nan]  # (none in the phase: a runtime far too slow)
            alone = "alone direct" if "direct" in name or "alone" in name else "alone gateway"
            rel = f"{p95(name) / p95(alone):10.2f}x" if report(alone) and "alone" not in name else " " * 11
            ref = f"{p95(name) / p95(reference):8.2f}x" if report(reference) and name.startswith("flood") else ""
            print(f"   {name:20}{len(xs):>4}{pct(xs, 50) * 1000:9.0f}{pct(xs, 95) * 1000:9.0f}{rel}{ref}")
    if report(reference):
        print(f"   {reference}: only {args.slots - 1} batch streams straight to llama-server, so one slot is "
              f"always free for the\n   interactive request: the runtime's own slowdown, the least a gateway can "
              f"give (goal with preemption: p95 <= 1.2x this)")
    if report("fair direct"):
        print("\n2. Share of generated tokens, tenant-a (8 streams) vs tenant-b (2 streams), equal weight")
        print(f"   (tokens streamed between {skip:g} s and {args.phase_s:g} s into the phase)")
        for name in ("fair direct", "fair gateway"):
            shares = results[name][0].shares(skip, args.phase_s)
            print(f"   {name:16} a {shares.get('tenant-a', 0):6.1%}   b {shares.get('tenant-b', 0):6.1%}"
                  f"   (goal through passerelle: 50% +/- 10%)")
        print(f"   freed slots held for a returning tenant: {holds}")
    if report("flood direct"):
        print(f"\n3. Tokens/s under the flood (streamed between {skip:g} s and {args.phase_s:g} s), vs direct FIFO")
        print(f"   {'':20}{'all':>8}{'ratio':>8}{'batch':>8}{'ratio':>8}")
        base_all = results["flood direct"][0].rate(skip, args.phase_s)
        base_batch = results["flood direct"][0].rate(skip, args.phase_s, "bulk")
        for n in ("flood direct", *floods):
            if report(n):
                load = results[n][0]
                a, b = load.rate(skip, args.phase_s), load.rate(skip, args.phase_s, "bulk")
                print(f"   {n:20}{a:8.1f}{a / base_all:8.3f}{b:8.1f}{b / base_batch:8.3f}")
        print("   (goal with preemption: batch >= 0.97 of direct FIFO)")
        if "flood preemption" in preempt:
            p = preempt["flood preemption"]
            resumes = max(p.get("resumed_streams", 0), 1)
            print(f"   preemption: {p.get('suspended', 0)} suspensions ({p.get('suspended', 0) * 60 / args.phase_s:.1f}"
                  f" a minute), {p.get('resumed', 0)} resumes; prompt tokens computed again per resumed stream "
                  f"{p.get('resume_prompt_tokens_processed', 0) / resumes:.1f} (from cache: "
                  f"{p.get('resume_prompt_tokens_cached', 0) / resumes:.1f})")
    errors = {n: r[0].errors for n, r in results.items() if r[0].errors}
    print(f"\nerrors: {errors or 'none'}")
    if args.keep:
        print(f"logs (access logs, llama-server's): {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
