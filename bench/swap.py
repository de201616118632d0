"""Two models, one memory budget: passerelle's swap decision against "evict on every miss".

Two on-demand llama-servers of two different models under a budget that holds one at a time:
"chat" is Gemma 3 270M (about 0.35 GiB measured), "coder" the small random-weight Llama made
locally (``passerelle/testing/tiny_llama_gguf.py``, about 0.30 GiB). Two groups of users work at
once: chat users ask a question, read the answer and think a few seconds before the next one;
coders send bursts of short completions, pause, and come back. The same workload runs through two
gateways, one after the other in the same run: passerelle's ``fair`` swap policy (collated demands,
minimum residency, priority and fair share) and the ``naive`` policy (the oldest waiting request's
model is loaded at once, whatever is running: what simpler model swappers do).

Each group is a tenant (the ``user`` field), so fair share applies between the two groups.
Reported per policy: requests served and failed, TTFT p50/p95 per model (request sent to the first
content chunk, so it includes any wait for a swap), swaps per minute, mean drain and load time.

    .venv/bin/python bench/swap.py [--duration 75] [--min-resident 8] [--chat-users 3] [--coders 2]
                                   [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
from harness import ROOT, NotReady, pct, serve

from passerelle.chunks import CHAT  # a content event: a token, not the empty delta some chunks carry
from passerelle.runtimes import embedded
from passerelle.testing.tiny_llama_gguf import ensure_tiny_llama

# Gemma 3 270M (0.35 GiB measured, 0.53 estimated) fits, the tiny Llama (0.30, 0.40) fits, both do not
BUDGET_GIB = 0.55


class Workload:
    """Both user groups against one gateway; TTFTs per model, failures, requests served."""

    def __init__(self, base: str, session: aiohttp.ClientSession, seed: int) -> None:
        self.base, self.session = base, session
        self.rng = random.Random(seed)
        self.ttft: dict[str, list[float]] = {"chat": [], "coder": []}
        self.served: dict[str, int] = {"chat": 0, "coder": 0}
        self.failed: dict[str, int] = {"chat": 0, "coder": 0}

    async def one(self, model: str, prompt: str, max_tokens: int) -> None:
        # each group is a tenant (the OpenAI "user" field, as without keys): fair share between them
        body = {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "user": f"{model}-users",
                "messages": [{"role": "user", "content": prompt}]}
        t0 = time.perf_counter()
        first = None
        try:
            async with self.session.post(self.base + "/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    await resp.read()
                    self.failed[model] += 1
                    return
                async for line in resp.content:
                    if first is None and CHAT.search(line):
                        first = time.perf_counter() - t0
        except aiohttp.ClientError:
            self.failed[model] += 1
            return
        if first is None:
            self.failed[model] += 1
            return
        self.ttft[model].append(first)
        self.served[model] += 1

    async def chat_user(self, user: int, stop: float) -> None:
        turn = 0
        while time.perf_counter() < stop:
            await self.one("chat", f"user {user} turn {turn} {time.time_ns()}: explain tides.", 24)
            turn += 1
            await asyncio.sleep(self.rng.uniform(1.0, 4.0))  # reading and thinking

    async def coder(self, user: int, stop: float) -> None:
        burst = 0
        await asyncio.sleep(self.rng.uniform(0.0, 3.0))
        while time.perf_counter() < stop:
            for i in range(self.rng.randint(2, 4)):  # completions while typing
                await self.one("coder", f"coder {user} burst {burst}.{i} {time.time_ns()}: def parse(", 12)
            burst += 1
            await asyncio.sleep(self.rng.uniform(3.0, 8.0))  # editing


async def drive(base: str, seconds: float, chat_users: int, coders: int, seed: int) -> tuple[Workload, float]:
    # a fresh connection per request: llama-server drops reused keep-alive connections, and the
    # gateway's are what is measured here
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        w = Workload(base, session, seed)
        t0 = time.perf_counter()
        stop = t0 + seconds
        await asyncio.gather(*(w.chat_user(i, stop) for i in range(chat_users)),
                             *(w.coder(i, stop) for i in range(coders)))
        return w, time.perf_counter() - t0


def runtime(name: str, binary: Path, model: Path) -> str:
    return (f'[[backends]]\nname = "{name}"\nkind = "llama-server"\non_demand = true\nmodels = ["{name}"]\n'
            f'max_concurrency = 2\nlaunch = ["{binary}", "-m", "{model}", "--alias", "{name}", "--port", "{{port}}",'
            f' "-np", "2", "-c", "4096", "--metrics", "--slots", "--no-webui", "-t", "1"]\n')


def run_policy(policy: str, args: argparse.Namespace, work: Path, binary: Path, models: dict[str, Path]) -> dict:
    cfg = work / f"{policy}.toml"
    cfg.write_text(f'[runtimes]\nmax_loaded_gib = {BUDGET_GIB}\nswap_policy = "{policy}"\n'
                   f'min_resident_s = {args.min_resident}\ndrain_timeout_s = 60\n'
                   '[server]\naccess_log = false\n'
                   + runtime("chat", binary, models["chat"]) + runtime("coder", binary, models["coder"]))
    gw = serve(work, cfg, name=policy, src=ROOT)  # this checkout's passerelle; its log: POLICY.log
    base = gw.url
    try:
        gw.wait_ready("/ready", 120)
        print(f"running: {policy} ({args.duration:g} s)", file=sys.stderr, flush=True)
        w, elapsed = asyncio.run(drive(base, args.duration, args.chat_users, args.coders, args.seed))
        with urllib.request.urlopen(base + "/admin/runtimes", timeout=10) as resp:
            state = json.loads(resp.read())
    except NotReady as exc:
        raise SystemExit(str(exc)) from None
    finally:
        gw.stop(60)  # (it stops the runtimes it launched first)
    swaps = state["swaps"]
    events = swaps["recent"]  # the last 10, for the mean costs
    return {
        "policy": policy, "seconds": round(elapsed, 1),
        "served": w.served, "failed": w.failed,
        "ttft_s": {m: {"n": len(xs), "p50": round(pct(xs, 50), 2), "p95": round(pct(xs, 95), 2)} if xs else None
                   for m, xs in w.ttft.items()},
        "swaps": swaps["swaps"], "swaps_per_min": round(swaps["swaps"] / (elapsed / 60), 2),
        "by_reason": swaps["by_reason"],
        "mean_drain_s": round(sum(e["drain_s"] for e in events) / len(events), 2) if events else None,
        "mean_load_s": round(sum(e["load_s"] or 0 for e in events) / len(events), 2) if events else None,
        "measured_gib": {r["name"]: r["measured_gib"] for r in state["runtimes"]},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=75.0, help="seconds of workload per policy")
    ap.add_argument("--min-resident", type=float, default=8.0, help="[runtimes] min_resident_s of the fair policy")
    ap.add_argument("--chat-users", type=int, default=3)
    ap.add_argument("--coders", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--policies", default="fair,naive")
    ap.add_argument("--out", type=Path, help="also write results.json here")
    args = ap.parse_args()
    binary = embedded.find_or_build_llama_server()
    models = {"chat": embedded.ensure_gemma(), "coder": ensure_tiny_llama()}
    work = Path(tempfile.mkdtemp(prefix="passerelle-swap-"))
    results = [run_policy(p, args, work, binary, models) for p in args.policies.split(",")]
    print(f"\nTwo on-demand llama-servers (chat: Gemma 3 270M, coder: the tiny Llama; 2 slots each) under a "
          f"{BUDGET_GIB} GiB budget: one "
          f"loaded at a time.\n{args.chat_users} chat users (24 tokens, think 1-4 s) and {args.coders} coders "
          f"(bursts of 2-4 x 12 tokens, pause 3-8 s), {args.duration:g} s per policy; "
          f"fair: min_resident_s = {args.min_resident:g}.\n")
    print(f"{'policy':8}{'served':>8}{'failed':>8}{'chat p50':>10}{'chat p95':>10}{'coder p50':>11}"
          f"{'coder p95':>11}{'swaps':>7}{'/min':>7}{'drain':>8}{'load':>7}")
    for r in results:
        t = r["ttft_s"]

        def f(m: str, k: str, t=t) -> str:
            return f"{t[m][k]:.2f} s" if t[m] else "-"

        drain = f"{r['mean_drain_s']:.2f}" if r["mean_drain_s"] is not None else "-"
        load = f"{r['mean_load_s']:.2f}" if r["mean_load_s"] is not None else "-"
        print(f"{r['policy']:8}{sum(r['served'].values()):>8}{sum(r['failed'].values()):>8}{f('chat', 'p50'):>10}"
              f"{f('chat', 'p95'):>10}{f('coder', 'p50'):>11}{f('coder', 'p95'):>11}{r['swaps']:>7}"
              f"{r['swaps_per_min']:>7.1f}{drain:>8}{load:>7}")
    print("\nTTFT: request sent to its first content chunk, waits for swaps included. drain / load: mean "
          "seconds of the last 10 swaps.")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = vars(args) | {"out": str(args.out), "budget_gib": BUDGET_GIB}
        (args.out / "results.json").write_text(json.dumps({"runs": results, "args": meta}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
