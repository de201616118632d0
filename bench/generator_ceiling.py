"""The load generator's ceiling: `passerelle bench` against `passerelle fake-backend` with zero delays.

With no server time at all, requests/s and content chunks/s are bounded by the generator (and by
the fake, which runs on the same machine). The CPU each side used says which one was the limit:
the side near 100 % of a core (or of its cores, with several processes) is the bottleneck.

    .venv/bin/python bench/generator_ceiling.py --concurrency 1,16,64,256 --tokens 64 --processes 1,2

Prints a markdown table (and writes JSON with --json FILE). A figure, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import cpu_s, machine, own_cpu_s

from passerelle.bench.processes import run_levels
from passerelle.bench.progress import Progress
from passerelle.bench.runner import Level, RunOptions
from passerelle.bench.target import Target
from passerelle.bench.workload import TrafficClass, Workload
from passerelle.testing.fake_runtime import start_fake_backend


def measure(url: str, fake_pid: int, concurrency: int, tokens: int, processes: int, duration: float) -> dict:
    workload = Workload(prompt_tokens=16, max_tokens=tokens, tokens_per_word=1.0, prompt_overhead=9)
    level = Level((TrafficClass(None, workload, concurrency=concurrency),), duration=duration,
                  concurrency=concurrency)
    target = Target("fake", url, model="fake-model")
    # the generator's CPU includes its worker processes' (with --processes > 1)
    fake0, gen0, t0 = cpu_s([fake_pid]), own_cpu_s(children=True), time.perf_counter()
    result = run_levels(target, [level], RunOptions(warmup=concurrency, processes=processes), Progress(False))[0]
    wall = time.perf_counter() - t0
    fake_cpu, gen_cpu = cpu_s([fake_pid]) - fake0, own_cpu_s(children=True) - gen0
    ok = [r for r in result.results if r.ok]
    chunks = sum(r.chunks for r in ok)
    return {
        "concurrency": concurrency, "tokens": tokens, "processes": processes,
        "requests_ok": len(ok), "errors": len(result.results) - len(ok),
        "requests_per_s": round(len(ok) / result.wall_s, 1),
        "chunks_per_s": round(chunks / result.wall_s),
        # CPU over the whole call (warm-up and process start included): a bound, not exact shares
        "generator_cpu_pct": round(100 * gen_cpu / wall), "fake_cpu_pct": round(100 * fake_cpu / wall),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--tokens", default="64", help="output tokens per request, comma list")
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per point")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    with start_fake_backend(ttft_ms=0, itl_ms=0) as fake:
        for procs in (int(x) for x in args.processes.split(",")):
            for tokens in (int(x) for x in args.tokens.split(",")):
                for conc in (int(x) for x in args.concurrency.split(",")):
                    if conc < procs:
                        continue
                    row = measure(fake.url, fake.process.pid, conc, tokens, procs, args.duration)
                    rows.append(row)
                    print(row, file=sys.stderr, flush=True)
    m = machine()
    print(f"\nMachine: {m['cpu']}, {m['cores']} cores; Python {m['python']}; fake-backend with "
          f"zero delays on the same machine; {args.duration:g} s per point.\n")
    print("| processes | concurrency | tokens/request | requests/s | content chunks/s | errors | "
          "generator CPU | fake CPU |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['processes']} | {r['concurrency']} | {r['tokens']} | {r['requests_per_s']:,.0f} | "
              f"{r['chunks_per_s']:,} | {r['errors']} | {r['generator_cpu_pct']} % | {r['fake_cpu_pct']} % |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
