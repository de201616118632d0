"""TTFT straight to llama-server vs through passerelle, same run, alternating request by request.

Starts the embedded llama-server (Gemma 3 270M, 4 slots) and a gateway in front of it, then sends
the same kind of streaming request to each in turn (fresh prompts, so the prompt cache helps
neither side) and prints median / p95 TTFT for both and their ratio, per API: OpenAI chat
completions, OpenAI Responses and Anthropic Messages (``--apis``), interleaved in one run so all
see the same machine. TTFT ends at the first event with generated text in that API's grammar
(a content event as passerelle/chunks.py defines it for the gateway too: a ``content`` delta,
``response.output_text.delta`` or a reasoning delta, ``text_delta`` or ``thinking_delta``).

With ``--runtime fake`` the runtime is ``passerelle fake-backend`` (first token at 50 ms, every
API's events on the same schedule): no model's variance, only the gateway's cost is left.

    .venv/bin/python bench/ttft_gateway_vs_direct.py [--requests 60] [--max-tokens 8] [--apis chat,responses]
                                                     [--runtime llama|fake]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from harness import ROOT, NotReady, free_port, pct, serve, source_env, spawn

from passerelle.chunks import PATTERNS
from passerelle.runtimes import embedded

# per API: path, the body's text and budget fields, and what marks the first generated text
# (for chat a non-empty content: the fake's first chat chunk carries the role and "content":"")
APIS = {
    "chat": ("/v1/chat/completions", "messages", "max_tokens", PATTERNS["chat"]),
    "responses": ("/v1/responses", "input", "max_output_tokens", PATTERNS["responses"]),
    "messages": ("/v1/messages", "messages", "max_tokens", PATTERNS["messages"]),
}


async def ttft(session: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int, api: str = "chat") -> float:
    path, text_field, budget, marker = APIS[api]
    body = {"model": "gemma-3-270m", "stream": True, budget: max_tokens, "ignore_eos": True,
            text_field: [{"role": "user", "content": prompt}]}
    t0 = time.perf_counter()
    first = None
    async with session.post(base + path, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if first is None and line.startswith(b"data: {") and marker.search(line):
                first = time.perf_counter() - t0
    assert first is not None
    return first


async def run(direct: str, gateway: str, n: int, max_tokens: int,
              apis: list[str]) -> dict[tuple[str, str], list[float]]:
    out: dict[tuple[str, str], list[float]] = {(a, t): [] for a in apis for t in ("direct", "gateway")}
    # A new connection per request for both: llama-server drops reused keep-alive connections.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for i in range(3):  # warm-up, not counted
            for api in apis:
                await ttft(session, direct, f"warm-up {i}", 2, api)
                await ttft(session, gateway, f"warm-up {i}", 2, api)
        for i in range(n):
            for api in apis:
                order = [("direct", direct), ("gateway", gateway)]
                if i % 2:
                    order.reverse()
                for name, base in order:
                    prompt = f"Request {i} to {name} at {time.time_ns()}: describe a lighthouse."
                    out[(api, name)].append(await ttft(session, base, prompt, max_tokens, api))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--apis", default="chat", help="comma-separated: chat, responses, messages (default chat)")
    ap.add_argument("--runtime", choices=("llama", "fake"), default="llama",
                    help="the embedded llama-server (default) or passerelle fake-backend (TTFT 50 ms)")
    args = ap.parse_args()
    apis = [a for a in args.apis.split(",") if a]
    if not apis or set(apis) - set(APIS):
        ap.error(f"--apis: choose among {', '.join(APIS)}")
    lport = free_port()
    work = Path(tempfile.mkdtemp(prefix="passerelle-bench-"))
    if args.runtime == "fake":
        cmd = [sys.executable, "-m", "passerelle", "fake-backend", "--port", str(lport), "--ttft-ms", "50",
               "--itl-ms", "10", "--model", "gemma-3-270m"]
        kind, routes = "openai", 'endpoints = ["chat", "completions", "responses", "messages"]\n'
    else:
        binary, model = embedded.find_or_build_llama_server(), embedded.ensure_gemma()
        cmd = [str(binary), "-m", str(model), "--alias", "gemma-3-270m", "--port", str(lport),
               "-np", "4", "-c", "8192", "--metrics", "--slots", "--no-webui"]
        kind, routes = "llama-server", ""
    runtime = spawn("runtime", cmd, work, env=source_env(ROOT), url=f"http://127.0.0.1:{lport}")
    cfg = work / "gw.toml"
    cfg.write_text(f'[[backends]]\nname = "b"\nkind = "{kind}"\nurl = "{runtime.url}"\n'
                   f'models = ["gemma-3-270m"]\nmax_concurrency = 4\n{routes}')
    gw = serve(work, cfg, name="gateway", src=ROOT)  # this checkout's passerelle
    try:
        runtime.wait_ready("/health", 120)  # (the fake answers it too)
        gw.wait_ready("/ready", 120)
        res = asyncio.run(run(runtime.url, gw.url, args.requests, args.max_tokens, apis))
    except NotReady as exc:
        raise SystemExit(str(exc)) from None
    finally:
        gw.stop(30)
        runtime.stop(30)
    what = ("passerelle fake-backend (TTFT 50 ms)" if args.runtime == "fake"
            else "Gemma 3 270M on llama-server (4 slots)")
    print(f"TTFT over {args.requests} streaming requests each, alternating, {what}")
    for api in apis:
        d, g = res[(api, "direct")], res[(api, "gateway")]
        print(f"\n{api} ({APIS[api][0]})")
        print(f"{'':10}{'median ms':>12}{'p95 ms':>10}{'mean ms':>10}")
        for name, xs in (("direct", d), ("gateway", g)):
            print(f"{name:10}{statistics.median(xs) * 1000:12.1f}{pct(xs, 95) * 1000:10.1f}"
                  f"{statistics.mean(xs) * 1000:10.1f}")
        print(f"{'added':10}{(statistics.median(g) - statistics.median(d)) * 1000:12.1f}"
              f"{(pct(g, 95) - pct(d, 95)) * 1000:10.1f}{(statistics.mean(g) - statistics.mean(d)) * 1000:10.1f}")
        print(f"ratio gateway/direct: median {statistics.median(g) / statistics.median(d):.3f}, "
              f"p95 {pct(g, 95) / pct(d, 95):.3f}")
        # each gateway request against the direct one sent next to it: less of the machine's noise
        paired = [b - a for a, b in zip(d, g, strict=True)]
        print(f"added, request by request: median {statistics.median(paired) * 1000:.1f} ms, "
              f"p95 {pct(paired, 95) * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
