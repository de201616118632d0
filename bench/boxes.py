"""One box, two replicas on two boxes, or the model split over two boxes with llama.cpp's RPC:
which way to serve a model, measured in one run.

The three layouts serve the same model side by side and take turns (each round runs every level
on every layout, the layouts' order rotating), so a busy machine weighs on them alike:

    one box    a passerelle and its llama-server on box A
    replicas   one passerelle over two boxes' passerelles (box A's and box B's), two [[backends]] URLs
    split      a head passerelle on box A whose llama-server puts --layers-on-member layers on the
               rpc-server box B's passerelle supervises (llama-server --rpc B:50052 -sm layer)

At 1, 4 and 16 users (closed loop, streaming, a fixed answer length) it reports the aggregate
generated tokens/s and TTFT p95, the peak memory of each member process (RSS; GPU memory where
the boxes report it), and one line of advice.

Here (default) the boxes are network namespaces on this machine (passerelle/testing/netns.py):
one CPU pretending to be several, so a split's absolute figures mean little; the command is the
one a team runs on its own boxes, giving the gateways' URLs instead:

    .venv/bin/python bench/boxes.py                      # namespaces, a few minutes
    .venv/bin/python bench/boxes.py --model qwen3-30b --one http://box-a:8080 \\
        --replicas http://gateway:8080 --split http://box-a:8081 \\
        --box http://box-a:8080 --box http://box-b:8080 --admin-key "$KEY"
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from passerelle.bench.stats import percentile  # noqa: E402
from passerelle.testing.split_boxes import (  # noqa: E402
    RPC_PORT,
    BoxGateway,
    box_config,
    replicas_config,
    split_config,
    start_gateway,
    worker_table,
)

LAYOUTS = ("one box", "replicas", "split")
PROMPT = ("You keep the lighthouse on a rocky island. A storm is coming and the supply boat is late. "
          "Write down, step by step, what you do tonight and why.")


@dataclass
class Level:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    errors: int = 0

    def merge(self, other: Level) -> None:
        self.ttft += other.ttft
        self.tokens += other.tokens
        self.wall_s += other.wall_s
        self.errors += other.errors


async def one_request(client: httpx.AsyncClient, url: str, model: str, max_tokens: int, tag: str,
                      out: Level) -> None:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.7,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"[{tag}] {PROMPT}"}]}
    t0 = time.perf_counter()
    first: float | None = None
    tokens = chunks = 0
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                out.errors += 1
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                obj = orjson.loads(line[6:])
                if "error" in obj:
                    out.errors += 1
                    return
                for ch in obj.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        chunks += 1
                        if first is None:
                            first = time.perf_counter() - t0
                usage = obj.get("usage") or {}
                tokens = int(usage.get("completion_tokens") or tokens)
    except httpx.HTTPError:
        out.errors += 1
        return
    if first is not None:
        out.ttft.append(first)
    out.tokens += tokens or chunks


async def level(url: str, model: str, users: int, requests: int, max_tokens: int, tag: str) -> Level:
    """``users`` closed-loop users sending ``requests`` streamed requests in all."""
    out = Level()
    each = max(1, math.ceil(requests / users))
    limits = httpx.Limits(max_connections=users + 4, max_keepalive_connections=users + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as client:
        async def user(u: int) -> None:
            for i in range(each):
                await one_request(client, url, model, max_tokens, f"{tag}-{u}-{i}-{time.time_ns()}", out)

        t0 = time.perf_counter()
        await asyncio.gather(*(user(u) for u in range(users)))
        out.wall_s = time.perf_counter() - t0
    return out


# -- memory --------------------------------------------------------------------------------------

def peak_rss_gib(pid: int) -> float | None:
    """The process's peak RSS (VmHWM) when it runs on this machine (the namespaces), else None."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(m.group(1)) / 2**20 if m else None


def members(box_urls: list[str], admin_key: str) -> list[dict[str, object]]:
    """Every runtime each box's passerelle supervises: name, kind, box, peak RSS, GPU memory."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    out: list[dict[str, object]] = []
    for url in box_urls:
        rows = httpx.get(url + "/admin/runtimes", headers=headers, timeout=10).json()["runtimes"]
        for r in rows:
            if r.get("state") != "ready":
                continue
            rss = peak_rss_gib(int(r["pid"])) if r.get("pid") else None
            out.append({"box": url, "name": r["name"], "kind": r["kind"],
                        "rss_gib": rss if rss is not None else r.get("rss_gib"), "gpu_gib": r.get("gpu_gib")})
    return out


# -- the namespaces ------------------------------------------------------------------------------

@dataclass
class Namespaces:
    """The three layouts on two namespaces and the root one."""

    one: BoxGateway
    box_b: BoxGateway
    split: BoxGateway
    replicas: BoxGateway
    gateways: list[BoxGateway]

    def stop(self) -> None:
        for g in reversed(self.gateways):
            g.stop()


def start_namespaces(net: object, folder: Path, args: argparse.Namespace) -> Namespaces:
    from passerelle.runtimes import embedded
    from passerelle.runtimes.supervisor import free_port
    from passerelle.testing.netns import Network

    assert isinstance(net, Network)
    build = embedded.llama_server_build(flavour="cpu")
    binary, rpc_server, model = build.binary, embedded.cached_rpc_server(build.spec), embedded.ensure_gemma()
    a, b = net.boxes
    kw = dict(alias=args.model, slots=args.slots, threads=args.threads, admin=net.subnet)
    one = start_gateway(box_config(a.address, binary, model, name="one", **kw), folder / "a", box=a)
    box_b = start_gateway(box_config(b.address, binary, model, name="two", **kw)
                          + worker_table(b.address, rpc_server=rpc_server, threads=args.threads), folder / "b", box=b)
    gateways = [one, box_b]
    try:
        box_b.wait("/ready")
        split = start_gateway(split_config(a.address, binary, model, [f"{b.address}:{RPC_PORT}"], name="split",
                                           layers_on_members=args.layers_on_member, port=8081, **kw),
                              folder / "a-split", box=a, port=8081)
        gateways.append(split)
        port = free_port()
        replicas = start_gateway(replicas_config([one.url, box_b.url], alias=args.model, slots=args.slots, port=port),
                                 folder / "root", port=port)
        gateways.append(replicas)
        for g in gateways:
            g.wait("/ready")
    except BaseException:
        for g in gateways:
            g.stop()
        raise
    return Namespaces(one=one, box_b=box_b, split=split, replicas=replicas, gateways=gateways)


# -- the run -------------------------------------------------------------------------------------

def advise(results: dict[str, dict[int, Level]], top: int) -> str:
    def rate(name: str) -> float:
        lv = results.get(name, {}).get(top)
        return lv.tokens / lv.wall_s if lv and lv.wall_s else 0.0

    one, reps, split = rate("one box"), rate("replicas"), rate("split")
    if not one:
        return "advice: no one-box figure; measure the model on one box first"
    parts = []
    if reps:
        parts.append(f"replicas {reps / one:.2f}x")
    if split:
        parts.append(f"split {split / one:.2f}x")
    figures = ", ".join(parts)
    if reps >= 1.15 * one and reps >= split:
        return (f"advice: serve this model as replicas ({figures} one box's tokens/s at {top} users); "
                "split it over boxes only when no box holds it alone")
    if split > 1.15 * one and split > reps:
        return f"advice: the split serves more than one box here ({figures} at {top} users): serve it split"
    return (f"advice: one box serves this model as well as two here ({figures} at {top} users): keep it on one box, "
            "add replicas when users queue, split only a model no box holds alone")


def run(urls: dict[str, str], args: argparse.Namespace, box_urls: list[str]) -> dict[str, object]:
    results: dict[str, dict[int, Level]] = {name: {} for name in urls}
    names = list(urls)
    for name, url in urls.items():  # warm each (the first request of a runtime pays its start-up)
        asyncio.run(level(url, args.model, 1, 1, 4, f"warm-{name}"))
    for rnd in range(args.rounds):
        for users in args.users:
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                got = asyncio.run(level(urls[name], args.model, users, max(args.requests, users), args.max_tokens,
                                        f"{name}-{rnd}-{users}"))
                results[name].setdefault(users, Level()).merge(got)
                print(f"  round {rnd + 1} {name:9} {users:>3} users: {got.tokens / got.wall_s:7.1f} tok/s "
                      f"({got.tokens} tokens in {got.wall_s:.1f} s, {got.errors} errors)", flush=True)
    mem = members(box_urls, args.admin_key) if box_urls else []
    return {"results": results, "members": mem}


# The runtimes each layout runs on, by name, in the namespaces (on real boxes every runtime of the
# boxes given with --box is listed under the table instead).
NAMESPACE_MEMBERS = {"one box": {"one"}, "replicas": {"one", "two"}, "split": {"split", "lend"}}


def member_lines(mem: list[dict[str, object]], wanted: set[str] | None = None) -> str:
    """The memory of the processes (those named ``wanted``, else all)."""
    rows = [m for m in mem if wanted is None or m["name"] in wanted]
    return ", ".join(f"{m['name']} ({m['kind']}) {_gib(m['rss_gib'])}" + (f" + GPU {_gib(m['gpu_gib'])}"
                                                                           if m.get("gpu_gib") else "")
                     for m in rows) or "-"


def _gib(x: object) -> str:
    return f"{float(x):.2f} GiB" if isinstance(x, (int, float)) else "-"


def table(out: dict[str, object], args: argparse.Namespace, *, real: bool) -> str:
    results: dict[str, dict[int, Level]] = out["results"]  # type: ignore[assignment]
    mem: list[dict[str, object]] = out["members"]  # type: ignore[assignment]
    head = "| layout | " + " | ".join(f"{u} user{'s' if u > 1 else ''}: tok/s, TTFT p95" for u in args.users)
    lines = [head + " | memory per member (peak RSS) |", "|" + "---|" * (len(args.users) + 2)]
    for name, levels in results.items():
        cells = []
        for u in args.users:
            lv = levels.get(u)
            if lv is None or not lv.wall_s:
                cells.append("-")
                continue
            p95 = percentile(sorted(lv.ttft), 95) if lv.ttft else float("nan")
            errors = f" ({lv.errors} err)" if lv.errors else ""
            cells.append(f"{lv.tokens / lv.wall_s:.1f}, {p95 * 1000:.0f} ms{errors}")
        mine = member_lines(mem, NAMESPACE_MEMBERS.get(name)) if not real else "below"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {mine} |")
    if real:
        lines += ["", "memory per runtime of the boxes: " + member_lines(mem)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", default="1,4,16", help="levels of concurrent users")
    ap.add_argument("--requests", type=int, default=8, help="requests per level and layout (at least one a user)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over every level and layout, alternating")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--slots", type=int, default=8, help="llama-server slots of each box (namespaces)")
    ap.add_argument("--threads", type=int, default=1, help="threads of each llama-server and rpc-server (namespaces)")
    ap.add_argument("--layers-on-member", type=int, default=9, help="layers the split puts on the member (of 18)")
    ap.add_argument("--one", help="real boxes: a gateway serving the model from one box")
    ap.add_argument("--replicas", help="real boxes: a gateway over replicas on two boxes")
    ap.add_argument("--split", help="real boxes: a gateway serving the model split over boxes (rpc)")
    ap.add_argument("--box", action="append", default=[], help="real boxes: each box's passerelle (memory)")
    ap.add_argument("--admin-key", default="", help="the boxes' [admin] key, for /admin/runtimes")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    args.users = [int(u) for u in args.users.split(",")]
    real = {name: url for name, url in (("one box", args.one), ("replicas", args.replicas), ("split", args.split))
            if url}
    t0 = time.monotonic()
    if real:
        print(f"boxes.py: real boxes {real}", flush=True)
        out = run({k: v.rstrip("/") for k, v in real.items()}, args, [b.rstrip("/") for b in args.box])
        where = "real boxes"
    else:
        from passerelle.testing.netns import Network, available

        why = available()
        if why:
            print(f"boxes.py: namespaces unavailable ({why}); give --one/--replicas/--split URLs", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory(prefix="passerelle-boxes-") as tmp, Network("bx", boxes=2) as net:
            print(f"boxes.py: starting the three layouts on namespaces {net.subnet}.0/24", flush=True)
            ns = start_namespaces(net, Path(tmp), args)
            try:
                urls = {"one box": ns.one.url, "replicas": ns.replicas.url, "split": ns.split.url}
                out = run(urls, args, [ns.one.url, ns.box_b.url, ns.split.url])
            finally:
                ns.stop()
        where = "network namespaces on one shared machine"
    text = table(out, args, real=bool(real))
    print(f"\n{args.model}, {args.max_tokens} tokens an answer, {args.rounds} rounds, {where} "
          f"({time.monotonic() - t0:.0f} s):\n{text}\n{advise(out['results'], max(args.users))}")  # type: ignore[arg-type]
    if args.out:
        results: dict[str, dict[int, Level]] = out["results"]  # type: ignore[assignment]
        args.out.write_text(orjson.dumps({
            "where": where, "model": args.model, "members": out["members"],
            "results": {n: {str(u): {"tokens": lv.tokens, "wall_s": lv.wall_s, "ttft": lv.ttft, "errors": lv.errors}
                            for u, lv in lv_by.items()} for n, lv_by in results.items()}},
            option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
