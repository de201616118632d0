"""The options of ``passerelle bench`` and ``bench compare`` (argparse types and groups).

``cli`` registers the commands and runs them; the options shared by both live here, grouped as
``--help`` shows them: load, workload, output.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from passerelle.bench.workload import DEFAULT_MIN_REQUESTS, ENDPOINTS, parse_duration


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers like 1,5,10") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers like 1,5,10")
    return values


def float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers like 0.5,2") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive numbers like 0.5,2")
    return values


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def duration(text: str) -> float:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be > 0")
    return value


def json_object(text: str) -> dict[str, Any]:
    import json

    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction like 0.5 or 50%") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction in [0, 1)")
    return value


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model id to request (default: the first of GET /v1/models)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY (compare: to targets without key=)")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=int_list, metavar="N[,N...]",
                      help="closed loop: requests kept in flight, one level each (default 1); with "
                           "--rate: the cap on requests in flight")
    load.add_argument("--rate", type=float_list, metavar="R[,R...]",
                      help="open loop: requests per second, one level each")
    load.add_argument("--poisson", action="store_true", help="Poisson arrivals for --rate (default: constant)")
    size = load.add_mutually_exclusive_group()
    size.add_argument("--requests", type=positive_int, metavar="N",
                      help=f"requests per level (default: max({DEFAULT_MIN_REQUESTS}, 4 × concurrency) "
                           "or 10 s worth of --rate)")
    size.add_argument("--duration", type=duration, metavar="S", help="seconds per level, e.g. 60s or 2m")
    load.add_argument("--warmup", type=int, default=1, metavar="N",
                      help="warm-up requests before each level, not counted (default 1)")
    load.add_argument("--scenario", type=Path, metavar="FILE", help="TOML file mixing traffic classes")
    load.add_argument("--trace", type=Path, metavar="FILE",
                      help="replay a JSONL trace of arrival times and lengths (passerelle usage --export-trace)")
    load.add_argument("--trace-speed", type=float, default=1.0, metavar="X",
                      help="replay the trace X times faster (default 1)")
    load.add_argument("--find-max", action="store_true",
                      help="search the highest load within the SLOs: double the first --concurrency (or "
                           "--rate) until an SLO breaks, then bisect")
    load.add_argument("--find-max-limit", type=float, default=256, metavar="N",
                      help="stop doubling at this load (default 256)")
    load.add_argument("--processes", type=positive_int, default=1, metavar="N",
                      help="load generator processes (default 1; one event loop each)")
    load.add_argument("--timeout", type=duration, default=300.0, metavar="S",
                      help="per-request timeout (default 300s)")
    work = p.add_argument_group("workload")
    work.add_argument("--prompt-tokens", type=positive_int, default=128, metavar="P",
                      help="prompt length in tokens (default 128)")
    work.add_argument("--prompt-spread", type=int, default=0, metavar="S",
                      help="prompt lengths uniform in P ± S (default 0)")
    work.add_argument("--max-tokens", type=positive_int, default=64, metavar="T",
                      help="output tokens per request (default 64)")
    work.add_argument("--max-tokens-spread", type=int, default=0, metavar="S",
                      help="max_tokens uniform in T ± S (default 0)")
    work.add_argument("--turns", type=positive_int, default=1, metavar="K",
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
    work.add_argument("--extra-body", type=json_object, default={}, metavar="JSON",
                      help='fields added to every request, e.g. \'{"temperature": 0}\'')
    work.add_argument("--seed", type=int, default=None,
                      help="seed for prompts, lengths and arrivals; given, prompts repeat exactly between runs "
                           "(default: fresh prompts every run, a random nonce mixed in)")
    work.add_argument("--prefix-share", type=fraction, default=0.0, metavar="F",
                      help="make that fraction of every prompt a passage shared by all requests (a common "
                           "system prompt: deliberate prefix-cache hits, reported as such; default 0)")
    out = p.add_argument_group("output")
    out.add_argument("--slo", metavar="SPEC",
                     help="targets, e.g. ttft_p95=2s,tpot_p95=100ms,e2e_p99=30s,error_rate=1%%")
    out.add_argument("--error-budget", type=fraction, default=None, metavar="F",
                     help="the share of requests that may fail (HTTP 429 and 5xx, cut streams, timeouts) for a "
                          "load to hold; a level over it never holds and ends --find-max's climb (default 1%%; "
                          "the same as error_rate in --slo)")
    out.add_argument("--tie-margin", type=fraction, default=0.05, metavar="F",
                     help="targets holding the same load whose throughputs differ by less than this are a tie "
                          "(default 5%%)")
    out.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                     help="sample the runtime's memory (process tree found from the port, GPU memory) "
                          "(default on)")
    out.add_argument("--out", type=Path, metavar="DIR", help="output directory (required)")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="live progress bar (default: when stderr is a terminal)")
    p.set_defaults(endpoint="chat")
