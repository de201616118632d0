"""Prefix affinity vs round robin over two llama-server replicas, same run.

Eight users hold five-turn chats (a long shared-per-conversation system prompt, growing history)
through two gateways over the same two replicas: one routes with prefix affinity (the default),
the other round robin. Every conversation is fresh, so no run profits from another's cache. Users read and type between
turns (a random think time, mean ``--think-s``), start staggered and ask for answers of varying
length, as people do: without that, identical closed-loop users march in lock-step and every
policy happens to send each user back to the same replica. Reports TTFT p50/p95, and the prompt
tokens llama-server had to process (not taken from its cache), in all and per turn.

    .venv/bin/python bench/affinity.py [--users 8] [--turns 5] [--rounds 2] [--think-s 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
from harness import ROOT, NotReady, Service, free_port, pct, serve, spawn

from passerelle.chunks import CHAT
from passerelle.runtimes import embedded

MODEL = "gemma-3-270m"
SYSTEM = ("You are the archivist of a coastal town. You answer questions about its lighthouses, its harbour, "
          "the ships that pass and the families who kept the lights for two centuries. ") * 6


async def turn(session: aiohttp.ClientSession, base: str, messages: list[dict],
               max_tokens: int) -> tuple[float, int, str]:
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "messages": messages,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, processed, text = None, 0, []
    async with session.post(base + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if ttft is None and CHAT.search(line):  # a content event (passerelle/chunks.py)
                ttft = time.perf_counter() - t0
            obj = orjson.loads(line[6:])
            for ch in obj.get("choices") or []:
                text.append((ch.get("delta") or {}).get("content") or "")
            if obj.get("timings"):
                processed = obj["timings"].get("prompt_n", 0)
    return ttft or 0.0, processed, "".join(text)


async def user(session: aiohttp.ClientSession, base: str, uid: str, turns: int, out: dict,
               rng: random.Random, think_s: float) -> None:
    await asyncio.sleep(rng.uniform(0, think_s))
    messages = [{"role": "system", "content": f"[{uid}] " + SYSTEM},
                {"role": "user", "content": f"I am visitor {uid}. Which lighthouse is the oldest?"}]
    for t in range(turns):
        if t:
            await asyncio.sleep(rng.expovariate(1 / think_s) if think_s > 0 else 0)
        ttft, processed, answer = await turn(session, base, messages, rng.randint(8, 20))
        out["ttft"].append(ttft)
        out["processed"] += processed
        out["per_turn"][t] += processed
        messages += [{"role": "assistant", "content": answer or "..."},
                     {"role": "user", "content": f"Tell me more about that, part {t + 2}."}]


async def run(base: str, users: int, turns: int, tag: str, seed: int, think_s: float) -> dict:
    """One round; the same ``seed`` gives both policies the same think times and answer lengths."""
    out: dict = {"ttft": [], "processed": 0, "per_turn": [0] * turns}
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(user(session, base, f"{tag}-{u}-{time.time_ns()}", turns, out,
                                    random.Random(seed * 1000 + u), think_s) for u in range(users)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="alternating affinity / round robin runs")
    ap.add_argument("--affinity-slack", type=float, default=None,
                    help="[routing] affinity_slack of the affinity gateway (default: passerelle's)")
    ap.add_argument("--think-s", type=float, default=2.0, help="mean pause between a user's turns")
    args = ap.parse_args()
    binary, model = embedded.find_or_build_llama_server(), embedded.ensure_gemma()
    work = Path(tempfile.mkdtemp(prefix="passerelle-affinity-"))
    procs: list[Service] = []
    replicas = []
    for i in range(2):
        port = free_port()
        procs.append(spawn(f"replica{i}", [str(binary), "-m", str(model), "--alias", MODEL, "--port", str(port),
                                           "-np", "2", "-c", "8192", "-t", "1", "--metrics", "--slots", "--no-webui"],
                           work, url=f"http://127.0.0.1:{port}"))
        replicas.append(procs[-1].url)
    gateways = {}
    slack = "" if args.affinity_slack is None else f"[routing]\naffinity_slack = {args.affinity_slack}\n"
    for name, routing in (("affinity", slack), ("round robin", '[routing]\npolicy = "round_robin"\n')):
        cfg = work / f"{name.replace(' ', '-')}.toml"
        cfg.write_text(routing + "[server]\naccess_log = false\n" + "".join(
            f'[[backends]]\nname = "r{i}"\nkind = "llama-server"\nurl = "{url}"\nmodels = ["{MODEL}"]\n'
            f'max_concurrency = 2\n' for i, url in enumerate(replicas)))
        procs.append(serve(work, cfg, name=name.replace(" ", "-"), src=ROOT))  # this checkout's passerelle
        gateways[name] = procs[-1].url
    results: dict[str, dict] = {name: {"ttft": [], "processed": 0, "per_turn": [0] * args.turns}
                                for name in gateways}
    try:
        for svc in procs:
            svc.wait_ready("/ready" if svc.url in gateways.values() else "/health", 120)
        for r in range(args.rounds):
            order = list(gateways.items()) if r % 2 == 0 else list(gateways.items())[::-1]
            for name, base in order:
                print(f"round {r + 1}: {name}", file=sys.stderr, flush=True)
                got = asyncio.run(run(base, args.users, args.turns, f"{name[:3]}{r}", r, args.think_s))
                results[name]["ttft"] += got["ttft"]
                results[name]["processed"] += got["processed"]
                results[name]["per_turn"] = [a + b for a, b in zip(results[name]["per_turn"], got["per_turn"],
                                                                    strict=True)]
    except NotReady as exc:
        raise SystemExit(str(exc)) from None
    finally:
        for svc in reversed(procs):
            svc.stop(60)
    print(f"\n{args.users} users x {args.turns}-turn chats on 2 llama-server replicas (Gemma 3 270M, 2 slots, "
          f"1 thread each), {args.rounds} alternating rounds, think time mean {args.think_s:g} s\n")
    print(f"{'routing':14}{'requests':>9}{'TTFT p50 ms':>13}{'TTFT p95 ms':>13}{'prompt tokens processed':>25}")
    for name, r in results.items():
        print(f"{name:14}{len(r['ttft']):>9}{pct(r['ttft'], 50) * 1000:13.0f}{pct(r['ttft'], 95) * 1000:13.0f}"
              f"{r['processed']:>25}")
    a, b = results["affinity"], results["round robin"]
    print(f"\nTTFT p50 affinity / round robin: {pct(a['ttft'], 50) / pct(b['ttft'], 50):.2f} (goal <= 0.70); "
          f"prompt tokens processed: {a['processed'] / max(b['processed'], 1):.2f}x")
    print("prompt tokens processed per turn (all users, all rounds):")
    for name, r in results.items():
        print(f"  {name:14}" + " ".join(f"{n:>7}" for n in r["per_turn"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
