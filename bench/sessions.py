"""Agent sessions with long contexts, direct to llama-server and through passerelle, in one run.

N sessions (more than the runtime's slots) each hold a long context of their own (a system prompt
unique to the session, a growing history) and take several turns, as coding agents do. Two ways:
**in turn** (one request at a time: turn 1 of every session, then turn 2 of every session, so each
session comes back after the others have used the slots) and **concurrent** (every session at
once, each sending its next turn as soon as its answer ends). Each way runs against llama-server
directly and through passerelle in front of the same llama-server (alternating which goes first;
every session's text is fresh, so no run profits from another's cache).

Reported per target and way: prompt tokens computed again (llama-server's ``timings.prompt_n``:
not taken from its cache) against all prompt tokens sent (reuse = the rest), and the TTFT of later
turns (turn 2 onwards) p50 / p95; then the ratios passerelle / direct.

    .venv/bin/python bench/sessions.py [--sessions 3] [--slots 2] [--turns 3] [--context 400]
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
WORDS = ["harbour", "lighthouse", "keeper", "ledger", "season", "storm", "beacon", "pier", "tide", "lantern",
         "rope", "anchor", "gull", "channel", "reef", "signal", "fog", "bell", "cargo", "ferry"]


def context(tag: str, tokens: int) -> str:
    """About ``tokens`` tokens of text unique to ``tag`` (a word is about one token here)."""
    rng = random.Random(tag)
    words = [rng.choice(WORDS) for _ in range(tokens)]
    return f"Session {tag}. Project notes: " + " ".join(words)


async def turn(http: aiohttp.ClientSession, base: str, sid: str, messages: list[dict]) -> tuple[float, int, int, str]:
    """(TTFT s, prompt tokens computed, prompt tokens sent, answer)."""
    body = {"model": MODEL, "stream": True, "max_tokens": 8, "temperature": 0, "messages": messages,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, computed, sent, text = None, 0, 0, []
    async with http.post(base + "/v1/chat/completions", json=body, headers={"x-session-id": sid}) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if ttft is None and CHAT.search(line):
                ttft = time.perf_counter() - t0
            obj = orjson.loads(line[6:])
            for ch in obj.get("choices") or []:
                text.append((ch.get("delta") or {}).get("content") or "")
            if isinstance(obj.get("timings"), dict):
                computed = obj["timings"].get("prompt_n", computed)
            if isinstance(obj.get("usage"), dict):
                sent = obj["usage"].get("prompt_tokens", sent)
    return ttft if ttft is not None else time.perf_counter() - t0, computed, sent, "".join(text)


class Session:
    def __init__(self, tag: str, tokens: int) -> None:
        self.sid = tag
        self.messages = [{"role": "system", "content": context(tag, tokens)},
                         {"role": "user", "content": "Summarise the notes in one line."}]
        self.turns = 0

    async def step(self, http: aiohttp.ClientSession, base: str, out: dict) -> None:
        ttft, computed, sent, answer = await turn(http, base, self.sid, self.messages)
        out["computed"] += computed
        out["sent"] += sent
        if self.turns:
            out["later_ttft"].append(ttft)
        self.turns += 1
        self.messages += [{"role": "assistant", "content": answer or "..."},
                          {"role": "user", "content": f"And the next point, part {self.turns + 1}?"}]


async def run(base: str, way: str, sessions: int, turns: int, tokens: int, tag: str) -> dict:
    out: dict = {"computed": 0, "sent": 0, "later_ttft": []}
    group = [Session(f"{tag}-{s}-{time.time_ns()}", tokens) for s in range(sessions)]
    # llama-server closes its connection after each stream: a new one per request
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800),
                                     connector=aiohttp.TCPConnector(force_close=True)) as http:
        if way == "in turn":
            for _ in range(turns):
                for s in group:
                    await s.step(http, base, out)
        else:
            async def agent(s: Session) -> None:
                for _ in range(turns):
                    await s.step(http, base, out)
            await asyncio.gather(*(agent(s) for s in group))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--context", type=int, default=400, help="tokens of each session's own context")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    binary, model = embedded.find_or_build_llama_server(), embedded.ensure_default_model()
    work = Path(tempfile.mkdtemp(prefix="passerelle-sessions-"))
    port = free_port()
    ctx = args.slots * max(2048, args.context * 2 + 64 * args.turns)
    runtime = spawn("llama-server", [str(binary), "-m", str(model), "--alias", MODEL, "--port", str(port),
                                     "-np", str(args.slots), "-c", str(ctx), "-t", str(args.threads),
                                     "--metrics", "--slots", "--no-webui"], work, url=f"http://127.0.0.1:{port}")
    cfg = work / "gateway.toml"
    cfg.write_text(f'[server]\naccess_log = false\n[[backends]]\nname = "llama"\nkind = "llama-server"\n'
                   f'url = "{runtime.url}"\nmodels = ["{MODEL}"]\nmax_concurrency = {args.slots}\n')
    gateway = serve(work, cfg, name="passerelle", src=ROOT)
    procs: list[Service] = [runtime, gateway]
    targets = {"direct": runtime.url, "passerelle": gateway.url}
    results: dict[tuple[str, str], dict] = {}
    try:
        runtime.wait_ready("/health", 180)
        gateway.wait_ready("/ready", 120)
        for i, way in enumerate(("in turn", "concurrent")):
            order = list(targets.items()) if i % 2 == 0 else list(targets.items())[::-1]
            for name, base in order:
                print(f"{way}: {name}", file=sys.stderr, flush=True)
                results[(way, name)] = asyncio.run(run(base, way, args.sessions, args.turns, args.context,
                                                       f"{name[:3]}{i}"))
    except NotReady as exc:
        raise SystemExit(str(exc)) from None
    finally:
        for svc in reversed(procs):
            svc.stop(60)
    print(f"\n{args.sessions} sessions x {args.turns} turns, ~{args.context}-token contexts, on llama-server "
          f"(Gemma 3 270M, {args.slots} slots, {args.threads} thread(s))\n")
    print(f"{'way':12}{'target':12}{'prompt sent':>12}{'computed':>10}{'reused':>8}"
          f"{'later TTFT p50 ms':>19}{'p95 ms':>9}")
    for (way, name), r in results.items():
        reused = 1 - r["computed"] / max(r["sent"], 1)
        print(f"{way:12}{name:12}{r['sent']:>12}{r['computed']:>10}{reused:>8.0%}"
              f"{pct(r['later_ttft'], 50) * 1000:>19.0f}{pct(r['later_ttft'], 95) * 1000:>9.0f}")
    print("\npasserelle / direct:")
    for way in ("in turn", "concurrent"):
        d, p = results[(way, "direct")], results[(way, "passerelle")]
        print(f"  {way:12} computed {p['computed'] / max(d['computed'], 1):.2f}x, later TTFT p50 "
              f"{pct(p['later_ttft'], 50) / pct(d['later_ttft'], 50):.2f}x, p95 "
              f"{pct(p['later_ttft'], 95) / pct(d['later_ttft'], 95):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
