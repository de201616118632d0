"""The Batch API in the idle capacity, and its survival of kill -9: one run, ratios.

Against the fake runtime with slots (it runs ``--slots`` streams at once and queues the rest),
behind passerelle:

1. capacity: a batch alone, on a gateway whose batch lines may take every slot
   (``reserve_slots = 0``); its tokens/s is what the runtime does with no interactive load;
2. interactive alone: streamed chat requests at a fixed rate (the design point), TTFT p50/p95
   and the tokens/s they take;
3. the same interactive load while a batch of ``--lines`` lines runs: the batch's tokens/s over
   that window as a share of the capacity the interactive load leaves idle (goal >= 80 %), and the
   interactive TTFT p95 against phase 2 (goal <= 1.1x);
4. survival: a batch of ``--survival-lines`` lines; the gateway is killed with SIGKILL at a third
   and started again, the runtime killed with SIGKILL at two thirds and started again; the output
   is checked line by line: lines lost and lines duplicated (goal 0 and 0).

The interactive requests carry no key, so they are of the anonymous class (``standard``); batch
lines run at ``batch``, below it.

    .venv/bin/python bench/batch.py [--slots 4] [--rate 6] [--phase-s 20] [--lines 2000]
                                    [--reserve-slots N] [--survival-lines 10000] [--only load,survival]

``--reserve-slots``: ``[batches] reserve_slots`` of phases 2 to 4 (default: the configuration's).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai

sys.path.insert(0, str(Path(__file__).parent))
from harness import MODEL, ROOT, WORK, Service, free_port, pct, report_head, serve, source_env, spawn, write_json

from passerelle.chunks import is_content


def batch_file(n: int, max_tokens: int, tag: str) -> bytes:
    return b"".join(json.dumps({"custom_id": f"{tag}-{i:06d}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": MODEL, "max_tokens": max_tokens,
                                         "messages": [{"role": "user", "content": f"{tag} line {i}"}]}}).encode()
                    + b"\n" for i in range(n))


def start_fake(work: Path, port: int, a: argparse.Namespace) -> Service:
    svc = spawn(f"fake-{port}", [sys.executable, "-m", "passerelle", "fake-backend", "--port", str(port),
                                 "--ttft-ms", str(a.ttft_ms), "--itl-ms", str(a.itl_ms), "--tokens", str(a.tokens),
                                 "--model", MODEL, "--slots", str(a.slots)], work, env=source_env(ROOT),
                url=f"http://127.0.0.1:{port}")
    svc.wait_ready("/health", 30)
    return svc


def start_gateway(work: Path, fake_url: str, a: argparse.Namespace, *, fresh: bool,
                  reserve: int | None = None) -> Service:
    reserve = a.reserve_slots if reserve is None else reserve
    cfg = work / "gw.toml"
    cfg.write_text(f"""
[server]
state_dir = "{work / 'batch-state'}"
access_log = false

[batches]
in_flight_per_batch = {a.slots * 2}
in_flight_per_key = {a.slots * 2}
{"" if reserve is None else f"reserve_slots = {reserve}"}

[[backends]]
name = "fake"
kind = "openai"
url = "{fake_url}"
models = ["{MODEL}"]
max_concurrency = {a.slots}
""")
    if fresh:
        shutil.rmtree(work / "batch-state", ignore_errors=True)
    svc = serve(work, cfg, name="gw", src=ROOT)  # (its own state folder is wiped at each start: ours is batch-state)
    svc.wait_ready("/ready", 60)
    return svc


def client_of(gw: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=3)


def submit(client: openai.OpenAI, content: bytes) -> str:
    f = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id


def completed(client: openai.OpenAI, batch_id: str) -> tuple[str, int]:
    b = client.batches.retrieve(batch_id)
    return b.status, (b.request_counts.completed + b.request_counts.failed) if b.request_counts else 0


async def interactive(url: str, rate: float, duration: float, max_tokens: int) -> dict[str, Any]:
    """Streamed chat requests, one every 1/rate s, for ``duration`` s: TTFTs, tokens, errors."""
    ttfts: list[float] = []
    tokens = errors = 0
    body = {"model": MODEL, "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": "interactive"}]}

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal tokens, errors
        t0 = time.perf_counter()
        first = None
        try:
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    errors += 1
                    return
                async for raw in r.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    if is_content("chat", line):
                        tokens += 1
                        if first is None:
                            first = time.perf_counter() - t0
        except aiohttp.ClientError:
            errors += 1
            return
        if first is None:
            errors += 1
        else:
            ttfts.append(first * 1000)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = []
        start = time.perf_counter()
        n = int(rate * duration)
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return {"requests": n, "errors": errors, "ttft_p50_ms": pct(ttfts, 50), "ttft_p95_ms": pct(ttfts, 95),
            "tokens_per_s": tokens / elapsed, "elapsed_s": elapsed}


def load_phases(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    fake = start_fake(work, free_port(), a)
    gw = start_gateway(work, fake.url, a, fresh=True, reserve=0)
    try:
        client = client_of(gw)
        # 1. capacity: a batch alone, every slot its own
        n_cap = max(200, a.lines // 4)
        t0 = time.perf_counter()
        bid = submit(client, batch_file(n_cap, a.tokens, "cap"))
        while completed(client, bid)[0] != "completed":
            time.sleep(0.2)
        cap_s = time.perf_counter() - t0
        usage = client.batches.retrieve(bid).usage
        per_line = (usage.output_tokens / n_cap) if usage else a.tokens
        capacity = n_cap * per_line / cap_s
        gw.stop()
        gw = start_gateway(work, fake.url, a, fresh=True)
        client = client_of(gw)
        # 2. interactive alone
        alone = asyncio.run(interactive(gw.url, a.rate, a.phase_s, a.tokens))
        # 3. interactive with the batch
        bid = submit(client, batch_file(a.lines, a.tokens, "load"))
        while completed(client, bid)[1] < a.slots * 4:  # the batch is under way
            time.sleep(0.1)
        _, before = completed(client, bid)
        t1 = time.perf_counter()
        mixed = asyncio.run(interactive(gw.url, a.rate, a.phase_s, a.tokens))
        _, after = completed(client, bid)
        window = time.perf_counter() - t1
        batch_tps = (after - before) * per_line / window
        client.batches.cancel(bid)
        idle = capacity - alone["tokens_per_s"]
        return {"capacity_tokens_per_s": capacity, "interactive_alone": alone, "interactive_with_batch": mixed,
                "batch_tokens_per_s": batch_tps, "idle_capacity_tokens_per_s": idle,
                "batch_share_of_idle": batch_tps / idle if idle > 0 else None,
                "ttft_p95_ratio": mixed["ttft_p95_ms"] / alone["ttft_p95_ms"] if alone["ttft_p95_ms"] else None}
    finally:
        gw.stop()
        fake.stop()


def survival(work: Path, a: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    fake = start_fake(work, port, a)
    gw = start_gateway(work, fake.url, a, fresh=True)
    n = a.survival_lines
    try:
        client = client_of(gw)
        t0 = time.perf_counter()
        bid = submit(client, batch_file(n, 4, "s"))
        while completed(client, bid)[1] < n // 3:
            time.sleep(0.2)
        gw.proc.send_signal(signal.SIGKILL)
        gw.proc.wait()
        gw = start_gateway(work, fake.url, a, fresh=False)
        client = client_of(gw)
        while completed(client, bid)[1] < 2 * n // 3:
            time.sleep(0.2)
        fake.proc.send_signal(signal.SIGKILL)
        fake.proc.wait()
        time.sleep(1.0)  # the gateway sees its runtime gone; lines in flight meet a passing failure
        fake = start_fake(work, port, a)
        while completed(client, bid)[0] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.5)
        elapsed = time.perf_counter() - t0
        b = client.batches.retrieve(bid)
        ids: list[str] = []
        for fid in (b.output_file_id, b.error_file_id):
            if fid:
                ids += [json.loads(x)["custom_id"] for x in client.files.content(fid).content.splitlines()]
        expected = {f"s-{i:06d}" for i in range(n)}
        return {"lines": n, "status": b.status, "elapsed_s": elapsed, "answered": len(ids),
                "lost": len(expected - set(ids)), "duplicated": len(ids) - len(set(ids)),
                "failed": b.request_counts.failed if b.request_counts else None}
    finally:
        gw.stop()
        fake.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rate", type=float, default=6.0, help="interactive requests a second (the design point)")
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--lines", type=int, default=2000)
    p.add_argument("--survival-lines", type=int, default=10000)
    p.add_argument("--reserve-slots", type=int, default=None)
    p.add_argument("--only", default="load,survival")
    p.add_argument("--out", type=Path, default=WORK / "batch")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {**report_head("batch"), "args": {k: str(v) for k, v in vars(a).items()}}
    if "load" in a.only:
        r = report["load"] = load_phases(a.out, a)
        print(f"capacity (batch alone): {r['capacity_tokens_per_s']:.0f} tokens/s; interactive alone takes "
              f"{r['interactive_alone']['tokens_per_s']:.0f}; idle {r['idle_capacity_tokens_per_s']:.0f}")
        print(f"batch under interactive load: {r['batch_tokens_per_s']:.0f} tokens/s = "
              f"{(r['batch_share_of_idle'] or 0) * 100:.0f} % of the idle capacity (goal >= 80 %)")
        print(f"interactive TTFT p95: {r['interactive_alone']['ttft_p95_ms']:.1f} ms alone, "
              f"{r['interactive_with_batch']['ttft_p95_ms']:.1f} ms with the batch = "
              f"{r['ttft_p95_ratio'] or 0:.2f}x (goal <= 1.1x); errors {r['interactive_with_batch']['errors']}")
    if "survival" in a.only:
        s = report["survival"] = survival(a.out, a)
        print(f"survival: {s['lines']} lines, gateway and runtime each killed -9 once: {s['status']} in "
              f"{s['elapsed_s']:.0f} s, lost {s['lost']}, duplicated {s['duplicated']}, failed {s['failed']}")
    write_json(a.out / "batch.json", report)


if __name__ == "__main__":
    main()
