"""``passerelle bench`` and ``passerelle bench compare``: parse, run each target, write the report."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from passerelle.bench.options import add_common, positive_int
from passerelle.bench.workload import ENDPOINTS, TrafficClass, Workload


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
               flavours_main: Callable[[argparse.Namespace], int] | None = None) -> argparse.ArgumentParser:
    """Register ``bench`` (with its nested ``compare``, and ``flavours`` when the command line
    gives the function that finds the builds) on the ``passerelle`` command line."""
    bench = subparsers.add_parser(
        "bench", help="benchmark an OpenAI-compatible endpoint (TTFT, TPOT, ITL, throughput)",
        description="Measure an OpenAI-compatible endpoint under concurrent load and write results.json, "
                    "results.csv, report.md, report.html and plots. `bench compare` runs the same workload "
                    "against several targets and names the one that holds the most load within the SLOs.")
    bench.add_argument("--url", help="base URL, e.g. http://127.0.0.1:8080 (with or without /v1)")
    bench.add_argument("--name", help="the target's name in the report (default: HOST:PORT of the URL)")
    bench.add_argument("--runtime-pid", type=positive_int, metavar="PID",
                       help="the runtime's process for memory figures (default: the one listening on the URL's "
                            "port, when it runs here)")
    add_common(bench)
    bench.set_defaults(func=bench_main)
    sub = bench.add_subparsers(dest="bench_command", metavar="{compare,flavours}")
    compare = sub.add_parser("compare", help="run the same workload against several targets",
                             description="Run the same workload against each target, the targets taking "
                                         "turns level by level, and add a verdict.")
    compare.add_argument("--target", action="append", default=[], metavar="NAME=URL[,key=ENV][,model=ID][,pid=PID]",
                         help="a target to compare (repeat); key=ENV reads its API key from that environment "
                              "variable, model= the model to ask it for, pid= its runtime's process")
    compare.add_argument("--rounds", type=positive_int, metavar="N",
                         help="measure each level in N rounds, the targets taking turns (A B, B A, ...) so that "
                              "other load on the machine weighs on each alike (default 2 with several targets, "
                              "at most 8)")
    add_common(compare)
    compare.set_defaults(func=compare_main)
    if flavours_main is not None:
        from passerelle.bench.flavours import add_parser as add_flavours_parser

        add_flavours_parser(sub, add_common, flavours_main)
    return bench


def bench_main(args: argparse.Namespace) -> int:
    from urllib.parse import urlsplit

    from passerelle.bench.target import TargetSpec, normalize_url

    if not args.url:
        return _usage("bench: --url is required (or use `passerelle bench compare --target NAME=URL ...`)")
    try:
        url = normalize_url(args.url)
    except ValueError as exc:
        return _usage(f"bench: {exc}")
    return _run(args, [TargetSpec(args.name or urlsplit(args.url).netloc or args.url, url)], "bench")


def compare_main(args: argparse.Namespace) -> int:
    from passerelle.bench.target import parse_target

    if not args.target:
        return _usage("bench compare: give at least one --target NAME=URL")
    try:
        targets = [parse_target(t) for t in args.target]
        for t in targets:
            t.api_key(None)  # an unset key= variable is a usage error before anything runs
    except ValueError as exc:
        return _usage(f"bench compare: --target {exc}")
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        return _usage("bench compare: target names must differ")
    return _run(args, targets, "bench compare")


def _usage(message: str) -> int:
    print(f"passerelle: {message}", file=sys.stderr)
    return 2


# The options a report's command line repeats, in order; workload sizes always, others when set.
_ALWAYS = ("concurrency", "rate", "requests", "duration", "prompt_tokens", "max_tokens")
_WHEN_SET: dict[str, Any] = {
             "model": None, "poisson": False, "warmup": 1, "scenario": None, "trace": None, "trace_speed": 1.0,
             "find_max": False, "find_max_limit": 256, "processes": 1, "timeout": 300.0,
             "prompt_spread": 0, "max_tokens_spread": 0, "turns": 1, "endpoint": "chat", "ignore_eos": True,
             "usage": True, "calibrate": True, "extra_body": {}, "seed": None, "prefix_share": 0.0, "slo": None,
             "tie_margin": 0.05, "error_budget": None, "memory": True, "runtime_pid": None, "rounds": None}


def _command(args: argparse.Namespace, kind: str) -> str:
    """The command line that reproduces this run (the API key left out)."""
    import json

    parts = ["passerelle", *kind.split()]
    if kind == "bench":
        parts += ["--url", args.url] + (["--name", args.name] if args.name else [])
    for t in getattr(args, "target", []) or []:
        parts += ["--target", t]
    for key in (*_ALWAYS, *_WHEN_SET):
        value = getattr(args, key, None)
        if value is None or (key in _WHEN_SET and value == _WHEN_SET[key]):
            continue
        flag = "--" + key.replace("_", "-")
        if key == "endpoint":
            parts += [f"--{value}"] if value in ("chat", "completions") else ["--api", value]
        elif isinstance(value, bool):
            parts.append(flag if value else f"--no-{key.replace('_', '-')}")
        elif key in ("prefix_share", "tie_margin", "error_budget"):
            parts += [flag, f"{value:.4g}"]
        elif isinstance(value, list):
            parts += [flag, ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)]
        elif isinstance(value, dict):
            parts += [flag, json.dumps(value)]
        else:
            parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    parts += ["--out", str(args.out)]
    return shlex.join(parts)


def build_levels(args: argparse.Namespace, workload: Workload) -> tuple[list[Any], dict[str, Any]]:
    """The sweep's levels and the ``load`` section of results.json."""
    from passerelle.bench.measure import make_level
    from passerelle.bench.runner import Level
    from passerelle.bench.trace import describe, load_trace
    from passerelle.bench.workload import load_scenario

    if args.trace:
        entries = load_trace(args.trace)
        info = describe(entries, args.trace_speed)
        cls = TrafficClass(None, workload, concurrency=args.concurrency[0] if args.concurrency else None,
                           requests=len(entries), trace=entries, trace_speed=args.trace_speed)
        level = Level((cls,), duration=args.duration, concurrency=cls.concurrency, rate=info["mean_rate"])
        return [level], {"trace": str(args.trace), **{f"trace_{k}": v for k, v in info.items()},
                         "duration": args.duration, "warmup": args.warmup, "processes": args.processes,
                         "concurrency": args.concurrency}
    if args.scenario:
        scenario = load_scenario(args.scenario, workload)
        duration = args.duration or scenario.duration
        classes = scenario.classes
        if args.requests:
            classes = tuple(c if c.trace is not None else replace(c, requests=args.requests) for c in classes)
        level = Level(classes, duration=duration if not args.requests else None)
        return [level], {"scenario": str(args.scenario), "duration": level.duration,
                         "requests": args.requests or scenario.requests, "warmup": args.warmup,
                         "processes": args.processes,
                         "classes": [{"name": c.name, "concurrency": c.concurrency, "rate": c.rate,
                                      "poisson": c.poisson, "priority": c.priority, "tenant": c.tenant,
                                      "trace": describe(c.trace, c.trace_speed) if c.trace else None,
                                      "workload": c.workload.describe()} for c in classes]}
    rates: list[float | None] = list(args.rate) if args.rate else [None]
    concs: list[int | None] = list(args.concurrency) if args.concurrency else ([None] if args.rate else [1])
    levels = [make_level(workload, conc, rate, requests=args.requests, duration=args.duration, poisson=args.poisson)
              for rate in rates for conc in concs]
    return levels, {"concurrency": args.concurrency, "rate": args.rate, "poisson": args.poisson,
                    "requests": args.requests or (levels[0].classes[0].requests if len(levels) == 1 else None),
                    "duration": args.duration, "warmup": args.warmup, "processes": args.processes,
                    "find_max": {"limit": args.find_max_limit} if args.find_max else None}


def _check(args: argparse.Namespace, kind: str) -> str | None:
    """A usage error in the combination of options, or None."""
    if args.out is None:
        return f"{kind}: --out DIR is required"
    if args.endpoint not in ENDPOINTS:
        return f"{kind}: unknown endpoint {args.endpoint}"
    if args.scenario and args.trace:
        return f"{kind}: give --scenario or --trace, not both (a scenario class can hold a trace)"
    if args.trace and args.rate:
        return f"{kind}: --trace sets the arrivals; drop --rate"
    if args.trace_speed <= 0:
        return f"{kind}: --trace-speed must be > 0"
    if args.find_max:
        if not args.slo:
            return f"{kind}: --find-max searches the load where an SLO breaks: give --slo"
        if args.scenario or args.trace:
            return f"{kind}: --find-max varies --concurrency or --rate, not a scenario or a trace"
        if len(args.concurrency or []) > 1 or len(args.rate or []) > 1:
            return f"{kind}: --find-max starts from one --concurrency (or --rate) value"
    return None


def _run(args: argparse.Namespace, targets: list[Any], kind: str) -> int:
    import secrets

    from passerelle import __version__
    from passerelle.bench import report, runner, stats
    from passerelle.bench.measure import Plan, collect, measure_interleaved, measure_target
    from passerelle.bench.memory import GpuReader
    from passerelle.bench.progress import Progress
    from passerelle.bench.trace import TraceError
    from passerelle.bench.verdict import verdict
    from passerelle.bench.workload import ScenarioError

    problem = _check(args, kind)
    if problem:
        return _usage(problem)
    try:
        slos = stats.with_error_budget(stats.parse_slos(args.slo), args.error_budget)
    except ValueError as exc:
        return _usage(f"{kind}: {exc}")
    # Fresh prompts every run unless a seed asks for the same ones (reproducing a run exactly).
    nonce = secrets.token_hex(4) if args.seed is None else ""
    workload = Workload(endpoint=args.endpoint, prompt_tokens=args.prompt_tokens, prompt_spread=args.prompt_spread,
                        max_tokens=args.max_tokens, max_tokens_spread=args.max_tokens_spread, turns=args.turns,
                        ignore_eos=args.ignore_eos, include_usage=args.usage, seed=args.seed or 0,
                        prefix_share=args.prefix_share, extra_body=args.extra_body)
    try:
        levels, load = build_levels(args, workload)
    except (ScenarioError, TraceError) as exc:
        return _usage(str(exc))
    plan = Plan(workload, tuple(levels), runner.RunOptions(warmup=max(args.warmup, 0), timeout=args.timeout,
                                                           processes=args.processes),
                tuple(slos), model=args.model, api_key=args.api_key, calibrate=args.calibrate, memory=args.memory,
                runtime_pid=getattr(args, "runtime_pid", None), find_max=args.find_max,
                find_max_limit=args.find_max_limit, requests=args.requests, duration=args.duration,
                poisson=args.poisson, gpu=GpuReader() if args.memory else None)
    created = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_start = _loadavg()
    runs: list[dict[str, Any]] = []
    described: list[dict[str, Any]] = []
    samples: dict[tuple[str, str], dict[str, list[float]]] = {}
    request_rows: list[dict[str, Any]] = []
    notes: list[str] = []
    failed = 0
    rounds = _rounds(args, targets, levels)
    try:
        with Progress(args.progress, summarize=stats.level_line) as progress:
            if rounds > 1:
                outcomes = measure_interleaved(plan, targets, progress, nonce, rounds)
            else:
                outcomes = [measure_target(plan, t_no, spec, progress, nonce) for t_no, spec in enumerate(targets)]
            for spec, outcome in zip(targets, outcomes, strict=True):
                failed += outcome.failed
                described.append(outcome.described)
                notes.extend(outcome.notes)
                runs.extend(outcome.runs)
                for res in outcome.results:
                    collect(spec.name, res, samples, request_rows)
    except KeyboardInterrupt:
        print("passerelle: bench interrupted; nothing written", file=sys.stderr)
        return 130
    if failed == len(targets):
        for note in notes:
            print(f"passerelle: {note}", file=sys.stderr)
        print(f"passerelle: {kind}: no target could be measured", file=sys.stderr)
        return 1
    models = {t["name"]: t.get("model") for t in described}
    results_doc: dict[str, Any] = {
        "runs": runs,
        "verdict": verdict(runs, slos, models, tie_margin=args.tie_margin),
        "schema": "passerelle-bench/1",
        "created": created,
        "command": _command(args, kind),
        "passerelle_version": __version__,
        "machine": {**report.machine_info(), "load_average_start": load_start, "load_average_end": _loadavg()},
        "targets": described,
        "workload": {**{k: v for k, v in workload.describe().items()
                        if k not in ("tokens_per_word", "prompt_overhead", "nonce")},
                     "seed": args.seed, "nonce": nonce or None},
        "load": {**load, "rounds": rounds},
        "notes": notes,
    }
    paths = report.write_all(results_doc, samples, request_rows, args.out)
    print(f"{results_doc['verdict']['reason']}.")
    for run in runs:
        for warning in ("cache_warning", "tail_warning"):
            if run.get(warning):
                print(f"warning: {run['target']} {_label(run)}: {run[warning]}.", file=sys.stderr)
    print(f"wrote {', '.join(p.name for p in paths)} to {args.out}")
    return 0 if failed == 0 else 1


def _rounds(args: argparse.Namespace, targets: list[Any], levels: list[Any]) -> int:
    """Rounds per level: taking turns only makes sense with several targets and a fixed load."""
    from passerelle.bench.measure import MAX_ROUNDS

    if len(targets) < 2 or args.find_max or any(c.trace is not None for lvl in levels for c in lvl.classes):
        return 1  # a search adapts per target; a trace keeps its shape in one piece
    wanted = getattr(args, "rounds", None) or 2
    sizes: list[int] = [c.requests for lvl in levels for c in lvl.classes if c.requests is not None]
    return max(1, min(wanted, MAX_ROUNDS, *(sizes or [wanted])))


def _label(run: dict[str, Any]) -> str:
    from passerelle.bench.verdict import label

    return label(run) + (f" class {run['class']}" if run.get("class") else "")


def _loadavg() -> float | None:
    """The 1-minute load average: a busy machine skews latencies, so the report says how busy."""
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None
