"""``passerelle bench`` and ``passerelle bench compare``: parse, run each target, write the report."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from passerelle.bench.workload import ENDPOINTS, TrafficClass, Workload, parse_duration

DEFAULT_MIN_REQUESTS = 16


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers like 1,5,10") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers like 1,5,10")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers like 0.5,2") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive numbers like 0.5,2")
    return values


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def _duration(text: str) -> float:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def _json_object(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model id to request (default: the first of GET /v1/models)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=_int_list, metavar="N[,N...]",
                      help="closed loop: requests kept in flight, one level each (default 1); with "
                           "--rate: the cap on requests in flight")
    load.add_argument("--rate", type=_float_list, metavar="R[,R...]",
                      help="open loop: requests per second, one level each")
    load.add_argument("--poisson", action="store_true", help="Poisson arrivals for --rate (default: constant)")
    size = load.add_mutually_exclusive_group()
    size.add_argument("--requests", type=_positive_int, metavar="N",
                      help=f"requests per level (default: max({DEFAULT_MIN_REQUESTS}, 4 × concurrency) "
                           "or 10 s worth of --rate)")
    size.add_argument("--duration", type=_duration, metavar="S", help="seconds per level, e.g. 60s or 2m")
    load.add_argument("--warmup", type=int, default=1, metavar="N",
                      help="warm-up requests before each level, not counted (default 1)")
    load.add_argument("--scenario", type=Path, metavar="FILE", help="TOML file mixing traffic classes")
    load.add_argument("--processes", type=_positive_int, default=1, metavar="N",
                      help="load generator processes (default 1; one event loop each)")
    load.add_argument("--timeout", type=_duration, default=300.0, metavar="S",
                      help="per-request timeout (default 300s)")
    work = p.add_argument_group("workload")
    work.add_argument("--prompt-tokens", type=_positive_int, default=128, metavar="P",
                      help="prompt length in tokens (default 128)")
    work.add_argument("--prompt-spread", type=int, default=0, metavar="S",
                      help="prompt lengths uniform in P ± S (default 0)")
    work.add_argument("--max-tokens", type=_positive_int, default=64, metavar="T",
                      help="output tokens per request (default 64)")
    work.add_argument("--max-tokens-spread", type=int, default=0, metavar="S",
                      help="max_tokens uniform in T ± S (default 0)")
    work.add_argument("--turns", type=_positive_int, default=1, metavar="K",
                      help="chat turns per conversation; the history grows a shared prefix (default 1)")
    endpoint = work.add_mutually_exclusive_group()
    endpoint.add_argument("--chat", dest="endpoint", action="store_const", const="chat",
                          help="POST /v1/chat/completions (default)")
    endpoint.add_argument("--completions", dest="endpoint", action="store_const", const="completions",
                          help="POST /v1/completions")
    endpoint.add_argument("--api", dest="endpoint", choices=list(ENDPOINTS),
                          help="the API to load: chat (default), completions, responses (OpenAI Responses, "
                               "POST /v1/responses) or messages (Anthropic Messages, POST /v1/messages)")
    work.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="send ignore_eos so every answer has exactly max_tokens tokens (default on)")
    work.add_argument("--usage", action=argparse.BooleanOptionalAction, default=True,
                      help="ask for stream_options.include_usage (default on)")
    work.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                      help="measure the target's tokens per word to size prompts (default on)")
    work.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                      help='fields added to every request, e.g. \'{"temperature": 0}\'')
    work.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals (default 0)")
    out = p.add_argument_group("output")
    out.add_argument("--slo", metavar="SPEC",
                     help="targets, e.g. ttft_p95=2s,tpot_p95=100ms,e2e_p99=30s,error_rate=1%%")
    out.add_argument("--out", type=Path, metavar="DIR", help="output directory (required)")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="live progress bar (default: when stderr is a terminal)")
    p.set_defaults(endpoint="chat")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` (with its nested ``compare``) on the ``passerelle`` command line."""
    bench = subparsers.add_parser(
        "bench", help="benchmark an OpenAI-compatible endpoint (TTFT, TPOT, ITL, throughput)",
        description="Measure an OpenAI-compatible endpoint under concurrent load and write results.json, "
                    "results.csv, report.md, report.html and plots. `bench compare` runs the same workload "
                    "against several targets and names the one that holds the most load within the SLOs.")
    bench.add_argument("--url", help="base URL, e.g. http://127.0.0.1:8080 (with or without /v1)")
    bench.add_argument("--name", help="the target's name in the report (default: HOST:PORT of the URL)")
    _add_common(bench)
    bench.set_defaults(func=bench_main)
    sub = bench.add_subparsers(dest="bench_command", metavar="{compare}")
    compare = sub.add_parser("compare", help="run the same workload against several targets",
                             description="Run the same workload against each target in turn and add a verdict.")
    compare.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                         help="a target to compare (repeat)")
    _add_common(compare)
    compare.set_defaults(func=compare_main)
    return bench


def bench_main(args: argparse.Namespace) -> int:
    if not args.url:
        return _usage("bench: --url is required (or use `passerelle bench compare --target NAME=URL ...`)")
    from urllib.parse import urlsplit

    return _run(args, [(args.name or urlsplit(args.url).netloc or args.url, args.url)], "bench")


def compare_main(args: argparse.Namespace) -> int:
    from passerelle.bench.target import parse_target

    if not args.target:
        return _usage("bench compare: give at least one --target NAME=URL")
    try:
        targets = [parse_target(t) for t in args.target]
    except ValueError as exc:
        return _usage(f"bench compare: --target {exc}")
    names = [n for n, _ in targets]
    if len(set(names)) != len(names):
        return _usage("bench compare: target names must differ")
    return _run(args, targets, "bench compare")


def _usage(message: str) -> int:
    print(f"passerelle: {message}", file=sys.stderr)
    return 2


# The options a report's command line repeats, in order; workload sizes always, others when set.
_ALWAYS = ("concurrency", "rate", "requests", "duration", "prompt_tokens", "max_tokens")
_WHEN_SET = {"model": None, "poisson": False, "warmup": 1, "scenario": None, "processes": 1, "timeout": 300.0,
             "prompt_spread": 0, "max_tokens_spread": 0, "turns": 1, "endpoint": "chat", "ignore_eos": True,
             "usage": True, "calibrate": True, "extra_body": {}, "seed": 0, "slo": None}


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
    from passerelle.bench.runner import Level
    from passerelle.bench.workload import load_scenario

    if args.scenario:
        scenario = load_scenario(args.scenario, workload)
        duration = args.duration or scenario.duration
        classes = scenario.classes
        if args.requests:
            classes = tuple(replace(c, requests=args.requests) for c in classes)
        level = Level(classes, duration=duration if not args.requests else None)
        return [level], {"scenario": str(args.scenario), "duration": level.duration,
                         "requests": args.requests or scenario.requests, "warmup": args.warmup,
                         "processes": args.processes,
                         "classes": [{"name": c.name, "concurrency": c.concurrency, "rate": c.rate,
                                      "poisson": c.poisson, "priority": c.priority, "tenant": c.tenant,
                                      "workload": c.workload.describe()} for c in classes]}
    levels = []
    rates: list[float | None] = list(args.rate) if args.rate else [None]
    concs: list[int | None] = list(args.concurrency) if args.concurrency else ([None] if args.rate else [1])
    for rate in rates:
        for conc in concs:
            if args.duration:
                n = None
            elif args.requests:
                n = args.requests
            elif rate is not None:
                n = max(DEFAULT_MIN_REQUESTS, round(10 * rate))
            else:
                n = max(DEFAULT_MIN_REQUESTS, 4 * (conc or 1))
            cls = TrafficClass(None, workload, concurrency=conc, rate=rate, poisson=args.poisson, requests=n)
            levels.append(Level((cls,), duration=args.duration, concurrency=conc, rate=rate))
    return levels, {"concurrency": args.concurrency, "rate": args.rate, "poisson": args.poisson,
                    "requests": args.requests or (levels[0].classes[0].requests if len(levels) == 1 else None),
                    "duration": args.duration, "warmup": args.warmup, "processes": args.processes}


def _run(args: argparse.Namespace, targets: list[tuple[str, str]], kind: str) -> int:
    from passerelle import __version__
    from passerelle.bench import report, runner, stats
    from passerelle.bench.progress import Progress
    from passerelle.bench.target import normalize_url
    from passerelle.bench.workload import ScenarioError

    if args.out is None:
        return _usage(f"{kind}: --out DIR is required")
    if args.endpoint not in ENDPOINTS:
        return _usage(f"{kind}: unknown endpoint {args.endpoint}")
    try:
        slos = stats.parse_slos(args.slo)
        urls = [(name, normalize_url(url)) for name, url in targets]
    except ValueError as exc:
        return _usage(f"{kind}: {exc}")
    workload = Workload(endpoint=args.endpoint, prompt_tokens=args.prompt_tokens, prompt_spread=args.prompt_spread,
                        max_tokens=args.max_tokens, max_tokens_spread=args.max_tokens_spread, turns=args.turns,
                        ignore_eos=args.ignore_eos, include_usage=args.usage, seed=args.seed,
                        extra_body=args.extra_body)
    try:
        levels, load = build_levels(args, workload)
    except ScenarioError as exc:
        return _usage(str(exc))
    options = runner.RunOptions(warmup=max(args.warmup, 0), timeout=args.timeout, processes=args.processes)
    created = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_start = _loadavg()
    runs: list[dict[str, Any]] = []
    described: list[dict[str, Any]] = []
    samples: dict[tuple[str, str], dict[str, list[float]]] = {}
    request_rows: list[dict[str, Any]] = []
    notes: list[str] = []
    try:
        with Progress(args.progress) as progress:
            failed = _measure_all(args, urls, workload, levels, options, slos, progress, runs, described, samples,
                                  request_rows, notes)
    except KeyboardInterrupt:
        print("passerelle: bench interrupted; nothing written", file=sys.stderr)
        return 130
    if failed == len(urls):
        print(f"passerelle: {kind}: no target could be measured", file=sys.stderr)
        return 1
    models = {t["name"]: t["model"] for t in described}
    results_doc = {
        "runs": runs,
        "verdict": stats.verdict(runs, slos, models),
        "schema": "passerelle-bench/1",
        "created": created,
        "command": _command(args, kind),
        "passerelle_version": __version__,
        "machine": {**report.machine_info(), "load_average_start": load_start, "load_average_end": _loadavg()},
        "targets": described,
        "workload": {k: v for k, v in workload.describe().items()
                     if k not in ("tokens_per_word", "prompt_overhead")},
        "load": load,
        "notes": notes,
    }
    paths = report.write_all(results_doc, samples, request_rows, args.out)
    print(f"{results_doc['verdict']['reason']}.")
    print(f"wrote {', '.join(p.name for p in paths)} to {args.out}")
    return 0 if failed == 0 else 1


def _loadavg() -> float | None:
    """The 1-minute load average: a busy machine skews latencies, so the report says how busy."""
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _measure_all(args: argparse.Namespace, urls: list[tuple[str, str]], workload: Workload, levels: list[Any],
                 options: Any, slos: list[Any], progress: Any, runs: list[dict[str, Any]],
                 described: list[dict[str, Any]], samples: dict[tuple[str, str], dict[str, list[float]]],
                 request_rows: list[dict[str, Any]], notes: list[str]) -> int:
    """Run the levels against each target in turn, filling the lists; returns how many failed."""
    from passerelle.bench import processes, runner, stats
    from passerelle.bench.target import Target

    failed = 0
    for t_no, (name, url) in enumerate(urls):
        target = Target(name, url, model=args.model, api_key=args.api_key)
        try:
            target, tuned, note = runner.prepare(target, workload, calibrate_prompts=args.calibrate)
            notes.append(f"{name}: {note}.")
            calibration = {"tokens_per_word": tuned.tokens_per_word, "overhead_tokens": tuned.prompt_overhead}
            mine = [_retune(level, workload, tuned) for level in levels]
            results = processes.run_levels(target, mine, replace(options, index_base=t_no * 1_000_000_000), progress)
        except (runner.BenchError, RuntimeError, OSError) as exc:
            failed += 1
            notes.append(f"{name}: not measured — {exc}")
            progress.note(f"passerelle bench: {name}: {exc}")
            described.append(target.describe())
            continue
        described.append({**target.describe(), "prompt_calibration": calibration})
        for res in results:
            runs.extend(stats.level_records(name, res, slos))
            _collect(name, res, samples, request_rows)
    return failed


def _retune(level: Any, base: Workload, tuned: Workload) -> Any:
    """Give every class the target's measured tokens-per-word, keeping its own lengths."""
    classes = tuple(replace(c, workload=replace(c.workload, tokens_per_word=tuned.tokens_per_word,
                                                prompt_overhead=tuned.prompt_overhead)) for c in level.classes)
    return replace(level, classes=classes)


def _collect(name: str, res: Any, samples: dict[tuple[str, str], dict[str, list[float]]],
             rows: list[dict[str, Any]]) -> None:
    level = res.level
    by_class = len(level.classes) > 1 or level.classes[0].name is not None
    t0 = res.started
    for r in res.results:
        label = (r.cls or "all") if by_class else level.label
        s = samples.setdefault((name, label), {"ttft": [], "e2e": []})
        if r.ok:
            if r.ttft is not None:
                s["ttft"].append(r.ttft * 1000)
            if r.e2e is not None:
                s["e2e"].append(r.e2e * 1000)
        tpot = r.tpot
        rows.append({"target": name, "class": r.cls, "concurrency": level.concurrency, "rate": level.rate,
                     "ok": r.ok, "error": r.error, "t_send_s": round(r.t_send - t0, 6),
                     "ttft_ms": round(r.ttft * 1000, 3) if r.ttft is not None else None,
                     "tpot_ms": round(tpot * 1000, 3) if tpot is not None else None,
                     "e2e_ms": round(r.e2e * 1000, 3) if r.e2e is not None else None,
                     "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens, "chunks": r.chunks})
