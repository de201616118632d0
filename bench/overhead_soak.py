"""bench/overhead.py --soak: many streams through passerelle for minutes, its RSS sampled.

``--soak-concurrency`` users keep sending streaming requests to passerelle (in front of the fake
runtime, as in the comparison) for ``--soak`` minutes; after ``--soak-warmup`` seconds the gateway's
RSS is sampled every ``--soak-interval`` seconds. The dashboard keeps its window's requests in
memory by design, so RSS is judged twice: after warm-up, and once the window has filled (growth
after that is what a leak would look like). Writes ``soak.json`` to ``--out``. (bench/soak.py is the
soak with faults: misbehaving runtime and clients, reloads, and every request accounted for.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from harness import cpu_s, fake_and_passerelle, loadavg, machine, rss_bytes, write_json
from loadgen import Round, run_async, run_load


def dashboard_window(extra_toml: str) -> float:
    """passerelle's [metrics] window_s: from --passerelle-toml, else its default."""
    import tomllib

    from passerelle.config import MetricsConfig

    with contextlib.suppress(tomllib.TOMLDecodeError, TypeError, ValueError):
        return float(tomllib.loads(extra_toml).get("metrics", {}).get("window_s", MetricsConfig.window_s))
    return float(MetricsConfig.window_s)


def soak(args: argparse.Namespace, work: Path, out: Path) -> dict[str, Any]:
    duration = (args.ttft_ms + (args.tokens - 1) * args.itl_ms) / 1000
    total_s = args.soak * 60
    samples: list[dict[str, Any]] = []
    done = {"n": 0, "tokens": 0}
    window = dashboard_window(args.passerelle_toml)
    with fake_and_passerelle(work, args.ttft_ms, args.itl_ms, args.tokens, args.passerelle_toml,
                             src=args.src) as (_, gw):
        print(f"soak: {args.soak_concurrency} streams through passerelle for {args.soak:g} min; RSS every "
              f"{args.soak_interval:g} s after {args.soak_warmup:g} s of warm-up", flush=True)

        def on_done(t0: float, first: float, end: float, n: int) -> None:
            done["n"] += 1
            done["tokens"] += n

        async def sampler() -> None:
            t0 = time.perf_counter()
            await asyncio.sleep(args.soak_warmup)
            while time.perf_counter() - t0 < total_s:
                rss = rss_bytes(gw.pids)
                samples.append({"t_s": round(time.perf_counter() - t0, 1), "rss_mib": round(rss / 2**20, 2),
                                "requests": done["n"], "cpu_s": round(cpu_s(gw.pids), 2)})
                print(f"  t={samples[-1]['t_s']:6.0f} s  RSS {samples[-1]['rss_mib']:7.1f} MiB  "
                      f"requests {done['n']}", flush=True)
                await asyncio.sleep(args.soak_interval)

        async def both() -> Round:
            s = asyncio.create_task(sampler())
            r = await run_load(gw.url, args.soak_concurrency, 0, args.tokens, stagger_s=duration,
                               timeout=args.timeout, deadline_s=total_s, on_done=on_done)
            s.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await s
            return r

        r = run_async(both())
    res: dict[str, Any] = {"benchmark": "overhead-soak", "machine": machine(), "loadavg_end": loadavg(),
                           "minutes": args.soak, "concurrency": args.soak_concurrency, "warmup_s": args.soak_warmup,
                           "dashboard_window_s": window, "requests": r.requests, "errors": dict(r.errors),
                           "samples": samples}
    print()
    # The dashboard keeps every request of its window ([metrics] window_s) in memory, by design:
    # RSS grows until the window is full. Growth after that is what a leak would look like.
    for label, part in (("after warm-up", samples), ("after the dashboard window filled",
                                                      [s for s in samples if s["t_s"] >= window + 10])):
        rss = [s["rss_mib"] for s in part]
        if len(rss) < 2:
            print(f"RSS {label}: fewer than 2 samples (run longer than warm-up / window + 10 s)")
            continue
        spread = (max(rss) - min(rss)) / min(rss)
        res["after_window" if "window" in label else "after_warmup"] = {
            "samples": len(rss), "first_mib": rss[0], "last_mib": rss[-1], "min_mib": min(rss),
            "max_mib": max(rss), "spread_pct": round(100 * spread, 2),
            "growth_pct": round(100 * (rss[-1] - rss[0]) / rss[0], 2), "flat_within_5pct": spread <= 0.05}
        print(f"RSS {label} ({len(rss)} samples): first {rss[0]:.1f} MiB, last {rss[-1]:.1f}, min {min(rss):.1f}, "
              f"max {max(rss):.1f}: spread {100 * spread:.2f} % ({'flat' if spread <= 0.05 else 'NOT flat'} "
              f"within 5 %)")
    print(f"{r.requests} requests, {sum(r.errors.values())} errors" + (f" {dict(r.errors)}" if r.errors else ""))
    write_json(out / "soak.json", res)
    print(f"wrote {out / 'soak.json'}")
    return res

