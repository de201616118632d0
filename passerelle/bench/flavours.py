"""``passerelle bench flavours`` (``bench backends`` before): the same GGUF on each built llama-server
flavour, one verdict.

Each flavour (``passerelle setup --flavour …`` built it) is started in turn with the same slots and
context, checked for its greedy answer to a fixed question, then measured under the same load with
the bench's own machinery (``measure.measure_target``: calibration, the levels, the memory monitor)
while the machine's power is metered (``energy.py``). The result: the usual report (results.json,
report.md, plots) per prompt depth, and ``backends.md`` / ``backends.json`` / ``backends.png`` (the
names and the ``passerelle-bench-backends/1`` schema are kept for what reads them): TTFT
p95 at the top load, tokens/s, memory at rest and at peak, energy per token, errors, crashes,
whether greedy answers match, the environment (flavour, CMake flags, runtime version, driver and
kernel, model file and its sha256) and a verdict in one sentence.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from passerelle.bench import flavours_report
from passerelle.bench.target import TargetSpec

GREEDY_PROMPT = "What is the capital of France?"
READY_TIMEOUT_S = 900.0  # a software Vulkan device compiles its pipelines at load: minutes
MODEL_ALIAS = "bench-model"


@dataclass(frozen=True)
class Flavour:
    """One build to compare: its name, what starts it (``{port}`` filled in), and its build record."""

    name: str
    command: tuple[str, ...]
    env: tuple[str, ...] = ()  # NAME=VALUE added to the environment
    info: dict[str, Any] = field(default_factory=dict, hash=False)
    driver: str = "CPU (no GPU driver)"  # the device and driver it runs on, as the machine reports them


class Server:
    """A flavour's runtime, started on a free port, its output in ``log``."""

    def __init__(self, flavour: Flavour, log: Path) -> None:
        self.flavour = flavour
        self.log = log
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, **dict(e.split("=", 1) for e in flavour.env))
        argv = [a.replace("{port}", str(self.port)) for a in flavour.command]
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as f:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f, env=env)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.flavour.name} exited with status {self.proc.returncode} while loading "
                                   f"(log: {self.log})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.flavour.name} not ready within {timeout_s:.0f} s (log: {self.log})")
            time.sleep(0.25)  # polling a condition until its deadline

    @property
    def crashed(self) -> int | None:
        """The exit status of a runtime that stopped by itself (None: still running)."""
        return self.proc.poll()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def greedy_answer(url: str, model: str | None, *, max_tokens: int = 24, timeout_s: float = 600.0) -> str:
    """The flavour's answer to a fixed question at temperature 0 (greedy decoding)."""
    body = {"messages": [{"role": "user", "content": GREEDY_PROMPT}], "temperature": 0, "top_k": 1,
            "max_tokens": max_tokens, "seed": 1}
    if model:
        body["model"] = model
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        doc = json.loads(resp.read(1 << 20))
    return str(doc["choices"][0]["message"].get("content") or "")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def environment(fl: Flavour, model: Path, model_sha: str) -> dict[str, Any]:
    """What the report names of a flavour's build and of the machine it ran on."""
    info = fl.info
    kind = info.get("kind") or "cpu"
    return {"flavour": fl.name, "kind": kind, "cmake_flags": info.get("cmake_flags") or info.get("flags"),
            "runtime_version": " / ".join(info.get("llama_server_version") or []) or None,
            "llama_cpp_python": info.get("llama_cpp_python"),
            "vulkan_layer_settings_guard": info.get("vulkan_layer_settings_guard"),
            "driver": fl.driver, "kernel": f"{platform.system()} {platform.release()}",
            "launch_env": list(fl.env), "model_file": str(model), "model_sha256": model_sha}


Levels = Callable[[argparse.Namespace, Any], tuple[list[Any], dict[str, Any]]]


def run(args: argparse.Namespace, flavours: list[Flavour], model: Path, build_levels: Levels,
        command: str = "") -> dict[str, Any]:
    """Start, check and measure each flavour at each depth; returns the report document (backends.json).

    ``build_levels`` is the bench's own (``bench.cli.build_levels``): the sweep the options ask for."""
    from passerelle import __version__
    from passerelle.bench import report, runner, stats
    from passerelle.bench.energy import EnergyMeter
    from passerelle.bench.measure import Plan, collect, measure_target
    from passerelle.bench.memory import GpuReader
    from passerelle.bench.progress import Progress
    from passerelle.bench.verdict import verdict
    from passerelle.bench.workload import Workload

    out_dir: Path = args.out
    slos = stats.parse_slos(args.slo)
    model_sha = sha256(model)
    meter = EnergyMeter()
    doc: dict[str, Any] = {"schema": "passerelle-bench-backends/1", "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "model_file": str(model), "model_sha256": model_sha, "slots": args.slots,
                           "ctx_per_slot": args.ctx_per_slot, "energy_sources": meter.sources,
                           "flavours": {}, "depths": []}
    depths = args.context_depth or [args.prompt_tokens]
    results: dict[int, dict[str, Any]] = {d: {"runs": [], "samples": {}, "rows": [], "targets": []} for d in depths}
    for fl in flavours:
        entry: dict[str, Any] = {"environment": environment(fl, model, model_sha), "crashed": None,
                                 "not_measured": None, "energy_j": {}, "output_tokens": {}}
        doc["flavours"][fl.name] = entry
        server = Server(fl, out_dir / "logs" / f"{fl.name}.log")
        try:
            server.wait_ready(args.ready_timeout)
            try:
                entry["greedy_answer"] = greedy_answer(server.url, None, timeout_s=args.timeout)
            except (OSError, ValueError, KeyError, IndexError) as exc:  # counted as such; the load still runs
                entry["greedy_answer"], entry["greedy_error"] = None, str(exc)
            for depth in depths:
                workload = Workload(endpoint=args.endpoint, prompt_tokens=depth, max_tokens=args.max_tokens,
                                    ignore_eos=args.ignore_eos, include_usage=args.usage, seed=args.seed or 0)
                levels, load = build_levels(replace_args(args, prompt_tokens=depth), workload)
                results[depth].setdefault("workload", {k: v for k, v in workload.describe().items()
                                                       if k not in ("tokens_per_word", "prompt_overhead", "nonce")})
                results[depth].setdefault("load", load)
                options = runner.RunOptions(warmup=max(args.warmup, 0), timeout=args.timeout)
                plan = Plan(workload, tuple(levels), options, tuple(slos), api_key=args.api_key,
                            calibrate=args.calibrate, memory=args.memory, find_max=args.find_max,
                            find_max_limit=args.find_max_limit, requests=args.requests, duration=args.duration,
                            poisson=args.poisson, gpu=GpuReader() if args.memory else None)
                meter.start()
                with Progress(args.progress) as progress:
                    spec = TargetSpec(fl.name, server.url, pid=server.proc.pid)
                    outcome = measure_target(plan, 0, spec, progress, f"{fl.name}-{depth}")
                joules = meter.stop()
                bucket = results[depth]
                bucket["runs"].extend(outcome.runs)
                bucket["targets"].append({**outcome.described, "notes": outcome.notes, "failed": outcome.failed})
                for res in outcome.results:
                    collect(fl.name, res, bucket["samples"], bucket["rows"])
                if outcome.failed:
                    entry.setdefault("failed_at", {})[str(depth)] = "; ".join(outcome.notes)
                tokens = sum(r["output_tokens"] for r in outcome.runs if r["class"] in (None, "all"))
                entry["output_tokens"][str(depth)] = tokens
                entry["energy_j"][str(depth)] = None if joules is None else round(joules, 3)
                if server.crashed is not None:
                    break
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            entry["not_measured"] = str(exc)
        finally:
            entry["crashed"] = server.crashed
            server.stop()
    for depth in depths:
        bucket = results[depth]
        models = {t["name"]: t.get("model") for t in bucket["targets"]}
        v = verdict(bucket["runs"], slos, models, tie_margin=args.tie_margin)
        sub = out_dir if len(depths) == 1 else out_dir / f"depth-{depth}"
        if bucket["runs"]:
            report.write_all({"runs": bucket["runs"], "verdict": v, "schema": "passerelle-bench/1",
                              "created": doc["created"], "command": command,
                              "passerelle_version": __version__, "machine": report.machine_info(),
                              "targets": bucket["targets"], "workload": bucket["workload"],
                              "load": {**bucket["load"], "rounds": 1},
                              "notes": [n for t in bucket["targets"] for n in t["notes"]]},
                             bucket["samples"], bucket["rows"], sub)
        doc["depths"].append({"prompt_tokens": depth, "verdict": v, "report": str(sub),
                              "rows": flavours_report.rows(bucket["runs"], bucket["targets"], doc["flavours"], depth)})
    doc["answers_match"] = flavours_report.answers_match(doc["flavours"])
    doc["verdict"] = flavours_report.sentence(doc)
    return doc


def command_line(args: argparse.Namespace, base: str) -> str:
    """The command that reproduces this run: ``bench``'s own rendering (``base``), plus this command's options."""
    import shlex

    extra = ["--flavours", args.flavours] if args.flavours else []
    if args.context_depth:
        extra += ["--context-depth", ",".join(str(d) for d in args.context_depth)]
    if args.model_file:
        extra += ["--model-file", str(args.model_file)]
    extra += ["--slots", str(args.slots), "--ctx-per-slot", str(args.ctx_per_slot)]
    return base + " " + shlex.join(extra)


def replace_args(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def sized(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the slots (the most clients) and context per slot (the deepest prompt, the
    answer and 256 tokens of template, rounded up to 256) every flavour gets, unless given."""
    depths = args.context_depth or [args.prompt_tokens]
    slots = args.slots or max(args.concurrency or [1])
    ctx = args.ctx_per_slot or (-(-(max(depths) + args.max_tokens + 256) // 256) * 256)
    return replace_args(args, slots=slots, ctx_per_slot=ctx)


def finish(doc: dict[str, Any], out: Path) -> int:
    """Write the report, print the verdict and the table; 1 when a flavour crashed or was not measured."""
    paths = flavours_report.write(doc, out)
    print(doc["verdict"])
    print(flavours_report.table(doc))
    print(f"wrote {', '.join(p.name for p in paths)} to {out}")
    failed = [n for n, f in doc["flavours"].items() if f["not_measured"] or f["crashed"] is not None]
    return 1 if failed else 0


def add_parser(sub: Any, add_common: Any, func: Callable[[argparse.Namespace], int]) -> None:
    p = sub.add_parser("flavours", aliases=["backends"],  # (its old name)
                       help="the same GGUF on each built llama-server flavour, the same load, one verdict",
                       description="Start each llama-server build (cpu, vulkan, rocm, cuda: `passerelle setup "
                                   "--flavour …`) in turn with the same GGUF, slots and context; check its greedy "
                                   "answer; measure it under the same multi-user load; report TTFT p95, tokens/s, "
                                   "memory, energy per token, errors and crashes side by side, with a verdict.")
    p.add_argument("--flavours", metavar="A,B", help="the builds to compare (default: every cached build)")
    p.add_argument("--model-file", metavar="GGUF", help="the model (default: the embedded default model)")
    p.add_argument("--slots", type=int, default=0, help="llama-server -np (default: the highest --concurrency)")
    p.add_argument("--ctx-per-slot", type=int, default=0,
                   help="context per slot (default: the deepest prompt + max tokens + 256, rounded up)")
    p.add_argument("--threads", type=int, default=0, help="llama-server -t (default: its own)")
    p.add_argument("--context-depth", type=_depths, metavar="P[,P...]",
                   help="run the load at each prompt depth in tokens, e.g. 128,2048,8192 (default: --prompt-tokens)")
    p.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S, metavar="S",
                   help=f"seconds a build may take to load the model (default {READY_TIMEOUT_S:.0f})")
    add_common(p)
    p.set_defaults(func=func)


def _depths(text: str) -> list[int]:
    from passerelle.bench.options import int_list

    return sorted(set(int_list(text)))

