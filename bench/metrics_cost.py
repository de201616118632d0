"""What passerelle's metrics cost on the hot path: tokens/s through the gateway with
``[metrics] enabled = true`` and ``false``, same run, rounds alternating between the two.

Two gateways (one per setting) stand in front of the same ``passerelle fake-backend`` with no
delays, so the gateway's own work is what limits throughput. Each round sends the same streaming
workload (``--concurrency`` clients, ``--requests`` requests of ``--tokens`` tokens) to one
gateway, then to the other, in alternating order; the figures are medians over rounds.

Two figures: tokens/s through the gateway (what a user sees, but noisy on a shared machine:
the client, the fake and the gateway compete for the same cores), and the gateway process's own
CPU time per relayed token (from /proc, so other processes barely disturb it).

"enabled = false" skips the per-request latency histograms (TTFT, inter-token, TPOT, e2e, queue
wait: one observation per token for inter-token latency) and the dashboard's rolling window;
counters, gauges and the access log stay on in both.

    .venv/bin/python bench/metrics_cost.py [--rounds 6] [--concurrency 16] [--requests 200] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
from harness import MODEL, ROOT, NotReady, Service, cpu_s, start_fake, start_passerelle

from passerelle.chunks import CHAT


def start_gateway(backend_url: str, enabled: bool, workdir: Path) -> Service:
    """This checkout's passerelle in front of the fake, its metrics on or off; ready."""
    gw = start_passerelle(workdir, backend_url, f"[metrics]\nenabled = {'true' if enabled else 'false'}\n",
                          name=f"gateway-{'on' if enabled else 'off'}", src=ROOT)
    try:
        gw.wait_ready("/ready", 60)
    except NotReady as exc:
        gw.stop()
        raise SystemExit(str(exc)) from None
    return gw


async def one_round(url: str, concurrency: int, requests: int, tokens: int) -> tuple[float, int, int]:
    """(tokens/s, tokens, errors) for ``requests`` streams over ``concurrency`` clients."""
    body = {"model": MODEL, "stream": True, "max_tokens": tokens, "messages": [{"role": "user", "content": "go"}]}
    todo = iter(range(requests))
    received = errors = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal received, errors
        for _ in todo:
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    errors += 1
                    await r.read()
                    continue
                async for line in r.content:
                    if CHAT.search(line):  # a content event (passerelle/chunks.py), not the role chunk
                        received += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return received / elapsed, received, errors


async def run(args: argparse.Namespace, urls: dict[str, str], pids: dict[str, list[int]]
              ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per setting: tokens/s of each round, and the gateway's CPU microseconds per token."""
    results: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    for name in ("on", "off"):  # warm-up, not counted
        await one_round(urls[name], args.concurrency, max(args.requests // 4, args.concurrency), args.tokens)
    for i in range(args.rounds):
        order = ["on", "off"] if i % 2 == 0 else ["off", "on"]
        for name in order:
            c0 = cpu_s(pids[name])
            tps, n, errors = await one_round(urls[name], args.concurrency, args.requests, args.tokens)
            us = (cpu_s(pids[name]) - c0) / max(n, 1) * 1e6
            if errors:
                raise SystemExit(f"round {i + 1}, metrics {name}: {errors} failed requests")
            results[name].append(tps)
            cpu[name].append(us)
            print(f"  round {i + 1}  metrics {name:>3}: {tps:10.0f} tokens/s  {us:6.2f} µs gateway CPU per token",
                  flush=True)
    return results, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=200, help="requests per round and setting")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="passerelle-metrics-cost-") as tmp:
        services: list[Service] = []
        try:
            fake = start_fake(Path(tmp), 0, 0, args.tokens, src=ROOT)
            services.append(fake)
            urls, pids = {}, {}
            for name, enabled in (("on", True), ("off", False)):
                gw = start_gateway(fake.url, enabled, Path(tmp))
                services.append(gw)
                urls[name], pids[name] = gw.url, gw.pids
            print(f"fake-backend (no delays) at {fake.url}; gateways: metrics on {urls['on']}, off {urls['off']}")
            print(f"{args.rounds} rounds x {args.requests} streams x {args.tokens} tokens, "
                  f"{args.concurrency} concurrent, alternating order; {os.cpu_count()} CPUs")
            results, cpu = asyncio.run(run(args, urls, pids))
        finally:
            for svc in reversed(services):
                svc.stop(30)
    on, off = statistics.median(results["on"]), statistics.median(results["off"])
    cpu_on, cpu_off = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    print(f"\nmedian tokens/s through the gateway: metrics on {on:.0f}, metrics off {off:.0f}; "
          f"ratio on/off {on / off:.3f}")
    print(f"median gateway CPU per token: metrics on {cpu_on:.2f} µs, off {cpu_off:.2f} µs; "
          f"metrics cost {cpu_on - cpu_off:+.2f} µs per token ({100 * (cpu_on / cpu_off - 1):+.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
