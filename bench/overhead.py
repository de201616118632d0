"""What a gateway adds: the same streams straight to a runtime, through passerelle, and through
the peers it is compared with (Envoy, vllm-router, SMG, the LiteLLM proxy).

One run starts ``passerelle fake-backend`` (TTFT 50 ms, ITL 10 ms, 32 tokens, no slot limit),
passerelle in front of it (default settings: metrics and access log on; the fake as an ``openai``
backend with ``max_concurrency`` 1024, so nothing queues) and each peer in ``--targets`` in front
of the same fake, all side by side. A peer is installed on first use into a virtualenv of its own
(bench/venvs.py; never a project dependency) and started as routers.py says (Envoy with no route
timeout and a long stream idle timeout, vllm-router and SMG with ``--policy round_robin``, SMG
with ``--backend openai``); one that fails to install or start is reported and the rest runs.
``--targets auto`` (the default) is passerelle, the routers already installed, and LiteLLM. At
each concurrency it runs rounds that alternate the targets, each round in a rotated order, so
that drift of a shared machine hits all of them alike.

Figures per concurrency and target: TTFT p50/p95/p99 and what the gateway adds to direct's;
aggregate tokens/s as a fraction of direct's; the gateway's CPU seconds per 1,000 requests
(utime + stime from /proc of the gateway's process tree, all threads of each process, before and
after each round: the same for a Python gateway and a Rust or C++ one) and its RSS. Latencies
and rates are medians over the rounds, and "added" is taken round by round against the direct
round that ran next to it, so that one disturbed round on a shared machine moves nothing.
Before each round the script waits until the servers are idle (a proxy may still be streaming
answers its clients gave up on), and after ``--round-cap-s`` a round takes no more measured
requests (LiteLLM at hundreds of streams would otherwise need many minutes).

``--waves N``: after the streams, synchronized waves: N keep-alive connections, and per wave N
requests written back to back in one pass of the client (a barrier: none goes before all are
idle), the next wave once all have ended; ``--wave-count`` waves per target, in rounds that
alternate the targets as above. What each gateway adds to TTFT at p50 and p99 is what "64
requests arrive at once" costs it; the spread of each wave's writes is reported too.

The client is a lean HTTP/1.1 client on uvloop and httptools (one keep-alive connection per
simulated user, the request written in one call): TTFT runs from that write to the first content
event. Users start staggered over one request's duration (otherwise identical requests march in
lock-step waves), the first request of each connection is a warm-up, and users keep sending until
the last measured request has ended, so the load stays at the concurrency for the whole window.
The generator's ceiling (the fake with no TTFT and 1 ms ITL, direct) is measured first, and each
round records the generator's own CPU, so a run shows whether the generator could keep up.

    .venv/bin/python bench/overhead.py                              # 1, 64, 256 streams; ~5-7 min
    .venv/bin/python bench/overhead.py --concurrency 1,64 --requests-per-level 200 --rounds 2
    .venv/bin/python bench/overhead.py --concurrency 64,256 --waves 64 \
        --targets passerelle,envoy,vllm-router,smg,litellm           # the table of issue 30; ~10 min
    .venv/bin/python bench/overhead.py --concurrency '' --waves 64 --targets passerelle,smg   # waves only
    .venv/bin/python bench/overhead.py --soak 10                   # 64 streams through passerelle
    .venv/bin/python bench/overhead.py --profile [--native]         # py-spy on passerelle at 64, 256
    .venv/bin/python bench/overhead.py --targets passerelle --also-src ../other-checkout   # A/B two versions
    .venv/bin/python bench/overhead.py --targets passerelle,vllm-router --also-src OLD --waves 64  # A/B + a peer
    .venv/bin/python bench/overhead.py --targets passerelle,vllm-router --gateway-processes 2 --waves 64
        # two passerelle processes side by side, the load spread over them: a bound on what several
        # acceptor processes in front of one scheduler could give
    .venv/bin/python bench/overhead.py --targets passerelle,passerelle-granian --waves 64
        # passerelle's app served by granian (a Rust HTTP server) instead of uvicorn
    .venv/bin/python bench/overhead.py --no-litellm --also-toml $'[server]\naccess_log = false'
    .venv/bin/python bench/overhead.py --no-litellm --concurrency 64 --tools \
        --also-toml $'[[models]]\nname = "fake-model"\ntool_calls = "hermes"'   # tool-call repair's cost
    .venv/bin/python bench/overhead.py --no-litellm --upstream [openai] --concurrency 64   # capacity
        # from the runtime: `passerelle serve --upstream URL` (no max_concurrency) in front of a fake
        # that runs 64 streams at once (reported by its /props; with "openai": learned); add
        # --fake-openai-only for a runtime with no /props at all, --also-src OLD to compare

Writes ``results.json`` (``soak.json``, ``profile.json``) and the printed tables (``report.md``)
to ``--out`` (default bench/out/overhead). Figures, not a pass/fail test.

This file is the comparison and the command line. What every bench/ script shares (services,
machine, load, percentiles) is in harness.py, the load client (streams and waves) in loadgen.py,
the peers in routers.py; the figures and the report are in overhead_report.py, the ``--soak``
and ``--profile`` modes in overhead_soak.py and overhead_profile.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import (
    ROOT,
    NotReady,
    Service,
    cpu_pressure,
    cpu_s,
    loadavg,
    pct,
    report_head,
    rss_bytes,
    settle,
    start_fake,
    start_passerelle,
    write_json,
)
from loadgen import Failed, Round, run_async, run_load, run_waves
from overhead_profile import profile
from overhead_report import GROUP, Cell, report
from overhead_soak import soak
from routers import PEERS, ROUTERS, Peer, install
from venvs import ROOT as VENVS

import passerelle
from passerelle import __version__


# --- the comparison ------------------------------------------------------------------------------
@dataclasses.dataclass
class Group:
    """Several passerelle processes measured as one target (``--gateway-processes N``): the load generator
    spreads its connections over their URLs (connection i to the i mod N-th, as ``SO_REUSEPORT``
    would), and their CPU and RSS are summed. Each has its own scheduler, so this is the most that
    several acceptor processes in front of one scheduler could give: that design would add a round
    trip to the scheduler per request, which this leaves out."""

    members: list[Service]

    @property
    def url(self) -> str:
        return ",".join(m.url for m in self.members)

    @property
    def pids(self) -> list[int]:
        return [p for m in self.members for p in m.pids]


def measure_ceiling(work: Path, tokens: int, concurrency: int, requests: int) -> dict[str, Any]:
    """Direct against a fake with no TTFT and 1 ms ITL: as many events as generator and fake manage."""
    fake = start_fake(work, 0, 1, tokens, tag="fake-ceiling")
    try:
        f0 = cpu_s(fake.pids)
        r = run_async(run_load(fake.url, concurrency, requests, tokens, stagger_s=0.05, timeout=60))
        fake_cpu = cpu_s(fake.pids) - f0
    finally:
        fake.stop()
    return {"concurrency": concurrency, "fake_ttft_ms": 0, "fake_itl_ms": 1, "tokens": tokens,
            "requests_per_s": round(r.requests / r.wall_s, 1), "tokens_per_s": round(r.tokens_per_s, 1),
            "generator_cpu_pct": round(100 * r.gen_cpu_s / r.wall_s, 1),
            "fake_cpu_pct": round(100 * fake_cpu / r.wall_s, 1), "errors": dict(r.errors)}


def per_level(spec: str, levels: list[int]) -> dict[int, int]:
    if spec == "auto":
        return {c: max(60, 16 * c) for c in levels}
    values = [int(x) for x in spec.split(",")]
    if len(values) == 1:
        values *= len(levels)
    if len(values) != len(levels):
        raise SystemExit("--requests-per-level: one number, or one per concurrency level")
    return dict(zip(levels, values, strict=True))


def choose_targets(spec: str, no_litellm: bool, root: Path) -> list[str]:
    """The gateways to measure besides direct, in the report's order. ``auto``: passerelle, each
    lean router whose virtualenv is already installed, and LiteLLM (installed on first use)."""
    if spec == "auto":
        names = ["passerelle", *(r for r in ROUTERS if PEERS[r].installed(root)), "litellm"]
    else:
        names = [n.strip() for n in spec.split(",") if n.strip()]
        unknown = [n for n in names if n != "passerelle" and n not in PEERS]
        if unknown:
            raise SystemExit(f"--targets: unknown {', '.join(unknown)} (known: passerelle, {', '.join(PEERS)})")
    order = ["passerelle", *PEERS]
    return sorted(dict.fromkeys(n for n in names if not (no_litellm and n == "litellm")), key=order.index)


def start_peers(args: argparse.Namespace, names: list[str], work: Path, backend_url: str,
                results: dict[str, Any], services: list[Service]) -> dict[str, Service]:
    """Install and start these peers side by side, then wait until each is ready. One that does not
    install or start is left out, and ``results["failed"]`` says why. Each one started is in
    ``services`` at once (the caller stops them all, however the run ends)."""
    started: dict[str, tuple[Peer, Service]] = {}
    for name in names:
        peer = PEERS[name]
        if name == "litellm":
            peer = dataclasses.replace(peer, spec=args.litellm_spec)
        try:
            venv = install(peer, args.venvs)
            results["versions"][name] = peer.version(venv)
            extra = args.litellm_args.split() if name == "litellm" else []
            started[name] = (peer, peer.start(venv, work, backend_url, extra))
            services.append(started[name][1])
        except (OSError, subprocess.SubprocessError) as exc:
            results["failed"][name] = f"could not install or start: {exc} (see {args.venvs / name}.install.log)"
            print(f"WARNING: {name}: {results['failed'][name]}; going on without it", flush=True)
    for name, (peer, svc) in list(started.items()):
        try:
            svc.wait_ready(peer.ready_path, peer.ready_s)
        except NotReady as exc:
            results["failed"][name] = f"did not start: {exc}"
            print(f"WARNING: {exc}; going on without {name}", flush=True)
            svc.stop()
            services.remove(svc)
            del started[name]
    return {name: svc for name, (_, svc) in started.items()}


def alternate(targets: list[str], rounds: int, services: list[Service], procs: dict[str, Service | Group],
              load: Callable[[str], Round], label: str) -> dict[str, Cell]:
    """``rounds`` rounds, each running every target once in a rotated order (drift of a shared
    machine hits all alike), each after the servers are idle; the target's process tree's CPU
    (utime + stime from /proc, all threads) and RSS taken around its load."""
    cells = {name: Cell() for name in targets}
    for rnd in range(rounds):
        order = targets[rnd % len(targets):] + targets[: rnd % len(targets)]
        for name in order:
            pids = procs[name].pids if name in procs else []
            settle([p for svc in services for p in svc.pids])
            c0 = cpu_s(pids)
            try:
                r = load(name)
            except Failed as exc:
                r = Round()
                r.errors[str(exc)] += 1
            cpu, rss = cpu_s(pids) - c0, rss_bytes(pids)
            cells[name].add(r, cpu, rss)
            print(f"  {label}  round {rnd + 1}/{rounds}  {name:<12} {len(r.ttft_ms):>5} req  "
                  f"TTFT p50 {pct(r.ttft_ms, 50):7.2f} ms  p99 {pct(r.ttft_ms, 99):7.2f} ms  "
                  f"{r.tokens_per_s:9,.0f} tok/s  gen CPU {100 * r.gen_cpu_s / max(r.wall_s, 1e-9):3.0f} %"
                  + (f"  gw CPU {cpu:5.2f} s" if pids else "")
                  + (f"  write spread max {max(r.spread_ms):.2f} ms" if r.spread_ms else "")
                  + (f"  errors {dict(r.errors)}" if r.errors else ""), flush=True)
    return cells


def compare(args: argparse.Namespace, work: Path, out: Path) -> dict[str, Any]:
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    sizes = [int(x) for x in args.waves.split(",") if x.strip()]
    if not levels and not sizes:
        raise SystemExit("nothing to measure: give --concurrency or --waves")
    counts = per_level(args.requests_per_level, levels) if levels else {}
    duration = (args.ttft_ms + (args.tokens - 1) * args.itl_ms) / 1000
    extra = {"tools": [TOOL]} if args.tools else None
    variant = bool(args.also_src or args.also_env or args.also_toml)
    gateways = choose_targets(args.targets, args.no_litellm, args.venvs)
    peers = [n for n in gateways if n in PEERS]
    results: dict[str, Any] = {
        **report_head("overhead"),
        "fake": {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms, "tokens": args.tokens,
                 "slots": (args.fake_slots or max(levels + sizes)) if args.upstream else "unlimited",
                 "openai_only": args.fake_openai_only},
        "passerelle": (f"serve --upstream ({args.upstream})" if args.upstream
                       else "a configuration, max_concurrency 1024"),
        "versions": {"passerelle": passerelle_version(args.src)} if "passerelle" in gateways else {}, "failed": {},
        "rounds": args.rounds, "requests_per_level": counts, "levels": [], "waves": [], "loadavg": []}
    if "litellm" in peers:
        results["litellm_args"] = args.litellm_args
    if args.ceiling and levels:
        print("generator ceiling: direct to a fake with TTFT 0, ITL 1 ms ...", flush=True)
        results["generator_ceiling"] = c = measure_ceiling(work, args.tokens, max(levels), max(counts.values()))
        print(f"  {c['tokens_per_s']:,.0f} tokens/s, {c['requests_per_s']:,.0f} requests/s at {c['concurrency']} "
              f"streams; generator CPU {c['generator_cpu_pct']} %, fake CPU {c['fake_cpu_pct']} %", flush=True)
    services: list[Service] = []
    try:
        fake = start_fake(work, args.ttft_ms, args.itl_ms, args.tokens,
                          slots=(args.fake_slots or max(levels + sizes)) if args.upstream else 0,
                          extra=["--openai-only"] if args.fake_openai_only else [])
        services.append(fake)
        procs: dict[str, Service | Group] = {}
        ours: dict[str, Service] = {}
        if "passerelle" in gateways:
            ours["passerelle"] = start_passerelle(work, fake.url, args.passerelle_toml, src=args.src,
                                                  upstream=args.upstream)
            services.append(ours["passerelle"])
            if variant:
                ours["passerelle-b"] = start_passerelle(
                    work, fake.url, args.also_toml, name="passerelle-b", src=args.also_src or args.src,
                    env=dict(kv.split("=", 1) for kv in args.also_env), upstream=args.upstream)
                services.append(ours["passerelle-b"])
                results["variant_b"] = {"src": str(args.also_src or args.src or ROOT), "env": args.also_env,
                                        "toml": args.also_toml}
                results["versions"]["passerelle-b"] = passerelle_version(args.also_src or args.src)
            for i in range(args.gateway_processes):
                ours[f"passerelle-p{i}"] = start_passerelle(work, fake.url, args.passerelle_toml,
                                                            name=f"passerelle-p{i}", src=args.src,
                                                            upstream=args.upstream)
                services.append(ours[f"passerelle-p{i}"])
        for svc in ours.values():
            svc.wait_ready("/ready", 60)
        procs.update((name, ours[name]) for name in ("passerelle", "passerelle-b") if name in ours)
        group = [svc for name, svc in ours.items() if name.startswith("passerelle-p")]
        if group:
            procs[GROUP] = Group(group)
            results["processes"] = len(group)
        procs.update(start_peers(args, peers, work, fake.url, results, services))
        targets = ["direct", *(n for n in ("passerelle", "passerelle-b", GROUP, *PEERS) if n in procs)]
        results["targets"] = targets
        urls = {"direct": fake.url, **{name: svc.url for name, svc in procs.items()}}
        print("fake " + fake.url + "".join(f", {n} {u}" for n, u in urls.items() if n != "direct")
              + "; warming up", flush=True)
        for name in targets:  # first requests pay for lazy imports and connection set-up: not counted
            run_async(run_load(urls[name], 8, 32, args.tokens, stagger_s=duration, timeout=args.timeout,
                               extra=extra))
        for conc in levels:
            per_round = max(1, counts[conc] // args.rounds)
            results["loadavg"].append({"concurrency": conc, "before": loadavg(), "cpu_pressure_before": cpu_pressure()})
            cells = alternate(targets, args.rounds, services, procs, lambda name, conc=conc, n=per_round: run_async(
                run_load(urls[name], conc, n, args.tokens, stagger_s=duration, timeout=args.timeout,
                         cap_s=args.round_cap_s or None, extra=extra)), f"{conc:>4} streams")
            direct = cells["direct"]
            results["levels"].append({
                "concurrency": conc, "ideal_tokens_per_s": round(conc * args.tokens / duration, 1),
                "targets": {n: cells[n].summary(direct, n != "direct") for n in targets}})
            results["loadavg"][-1].update(after=loadavg(), cpu_pressure_after=cpu_pressure())
        for size in sizes:
            per_round = max(1, args.wave_count // args.rounds)
            results["loadavg"].append({"waves": size, "before": loadavg(), "cpu_pressure_before": cpu_pressure()})
            cells = alternate(targets, args.rounds, services, procs, lambda name, size=size, n=per_round: run_async(
                run_waves(urls[name], size, n, args.tokens, timeout=args.timeout, gap_s=args.wave_gap_s,
                          cap_s=args.round_cap_s or None, extra=extra)), f"waves of {size:>4}")
            direct = cells["direct"]
            results["waves"].append({"size": size, "waves_per_round": per_round,
                                     "targets": {n: cells[n].summary(direct, n != "direct") for n in targets}})
            results["loadavg"][-1].update(after=loadavg(), cpu_pressure_after=cpu_pressure())
    finally:
        for svc in reversed(services):
            svc.stop()
    results["loadavg_end"] = loadavg()
    results["cpu_pressure_end"] = cpu_pressure()
    text = report(results, results.get("targets", ["direct"]))
    print("\n" + text)
    write_json(out / "results.json", results)
    (out / "report.md").write_text(text + "\n")
    print(f"\nwrote {out / 'results.json'} and {out / 'report.md'}")
    return results


def passerelle_version(src: Path | None) -> str:
    """passerelle's version and the commit of the tree it runs from (``src``, else the installed one)."""
    tree = src or Path(passerelle.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return __version__ + (f" ({commit})" if commit else "")


# --- command line --------------------------------------------------------------------------------
# --tools: the tool an agent's turn offers (a coding agent offers a dozen like it)
TOOL = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project and return its text.",
    "parameters": {"type": "object", "required": ["path"], "properties": {
        "path": {"type": "string", "description": "the file, relative to the project's root"},
        "offset": {"type": "integer", "description": "the first line to read"},
        "limit": {"type": "integer", "description": "how many lines"}}}}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--concurrency", default="1,64,256",
                   help="concurrent streams per level (default 1,64,256; '' for waves only)")
    p.add_argument("--requests-per-level", default="auto", metavar="N[,N...]",
                   help="measured requests per target and level, over all rounds: one number for all levels, "
                        "one per level, or auto = max(60, 16 x streams) (default)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per level; each runs every target once (3)")
    p.add_argument("--round-cap-s", type=float, default=15.0,
                   help="stop taking measured requests after this long in a round (a slow target, LiteLLM at "
                        "hundreds of streams, then gets fewer; 0: no cap; default 15)")
    p.add_argument("--targets", default="auto", metavar="NAME[,NAME...]",
                   help="the gateways measured against direct, of passerelle, " + ", ".join(PEERS) + "; each peer "
                        "is installed into its own virtualenv on first use (auto, the default: passerelle, the "
                        "routers already installed, and LiteLLM)")
    p.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out of the targets")
    p.add_argument("--waves", default="", metavar="N[,N...]",
                   help="after the streams: synchronized waves of N requests released at the same instant "
                        "(e.g. 64), --wave-count waves per target, rounds alternating the targets")
    p.add_argument("--wave-count", type=int, default=30, help="waves per target and size, over all rounds (30)")
    p.add_argument("--wave-gap-s", type=float, default=0.2, help="pause after a wave has ended (0.2 s)")
    p.add_argument("--litellm-args", default="", help="extra arguments for the litellm proxy, e.g. '--num_workers 2'")
    p.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                   help="skip the generator-ceiling measurement")
    p.add_argument("--venvs", type=Path, default=VENVS,
                   help="where the peers' virtualenvs are created on first use (default %(default)s)")
    p.add_argument("--litellm-spec", default=PEERS["litellm"].spec,
                   help="what pip installs for LiteLLM (default %(default)s)")
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--tokens", type=int, default=32, help="output tokens per request (max_tokens)")
    p.add_argument("--tools", action="store_true",
                   help="every request offers a tool (an agent's turn): with --also-toml '[[models]] ... tool_calls = "
                        "\"hermes\"', tool-call repair on against off")
    p.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--soak", type=float, metavar="MINUTES",
                   help="instead: this long at --soak-concurrency streams through passerelle, RSS sampled")
    p.add_argument("--soak-concurrency", type=int, default=64)
    p.add_argument("--soak-warmup", type=float, default=60.0, help="seconds before the first RSS sample (60)")
    p.add_argument("--soak-interval", type=float, default=10.0, help="seconds between RSS samples (10)")
    p.add_argument("--profile", action="store_true",
                   help="instead: py-spy on passerelle (no LiteLLM) at --profile-levels, where its CPU goes")
    p.add_argument("--profile-levels", default="64,256")
    p.add_argument("--profile-requests", type=int, default=0, help="per level (default 8 x streams)")
    p.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second (250)")
    p.add_argument("--native", action="store_true", help="py-spy --native (C frames too; pauses the process)")
    p.add_argument("--passerelle-toml", default="", metavar="TOML",
                   help="extra configuration for passerelle, e.g. $'[server]\\naccess_log = false'")
    p.add_argument("--upstream", nargs="?", const="detect", default="", metavar="KIND",
                   help="passerelle as `serve --upstream URL` with no max_concurrency, in front of a fake that "
                        "runs as many streams at once as the highest level and queues the rest (its capacity "
                        "comes from the runtime: reported, or learned with KIND=openai)")
    p.add_argument("--fake-slots", type=int, default=0, metavar="N",
                   help="with --upstream: the fake runs N streams at once (default: the highest level)")
    p.add_argument("--fake-openai-only", action="store_true",
                   help="the fake serves only the OpenAI routes (no /props, /slots, /metrics): a runtime that "
                        "does not say how many requests it runs at once")
    p.add_argument("--src", type=Path, help="run passerelle from this source tree (default: the installed one)")
    p.add_argument("--also-src", type=Path, metavar="DIR",
                   help="A/B: also run passerelle from this source tree, as target passerelle-b")
    p.add_argument("--also-env", action="append", default=[], metavar="K=V",
                   help="A/B: passerelle-b's extra environment (repeatable)")
    p.add_argument("--also-toml", default="", metavar="TOML", help="A/B: passerelle-b's extra configuration")
    p.add_argument("--gateway-processes", type=int, default=0, metavar="N",
                   help="also N passerelle processes side by side, the load spread over them (target "
                        f"{GROUP}): each has its own scheduler, so this bounds what several acceptor processes "
                        "in front of one scheduler could give (0: not measured)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "overhead", help="results folder")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    print(f"load average {' '.join(map(str, loadavg()))} on {os.cpu_count()} cores", flush=True)
    try:
        if args.soak:
            soak(args, work, args.out)
        elif args.profile:
            profile(args, work, args.out)
        else:
            compare(args, work, args.out)
    except NotReady as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
