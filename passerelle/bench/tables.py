"""The report's content as rows and sentences, shared by ``report.md`` and ``report.html``.

Every table is built here once from ``results.json``'s data (``cell`` formats one value), so the
two renderings and the tests agree by construction. Sections: the verdict, the cache check, the
memory per target, the workload (with warm-up and steady state), the per-target results, notes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from passerelle.bench.stats import FEW_FOR_TAIL, few_for_tail
from passerelle.bench.verdict import gib, memory_phrase

COLUMNS = (
    ("concurrency", "conc."), ("rate", "rate/s"), ("requests_ok", "ok"), ("errors", "errors"),
    ("ttft_ms.p50", "TTFT p50"), ("ttft_ms.p95", "TTFT p95"), ("tpot_ms.p50", "TPOT p50"),
    ("tpot_ms.p95", "TPOT p95"), ("itl_ms.p50", "ITL p50"), ("itl_ms.p95", "ITL p95"),
    ("e2e_ms.p50", "E2E p50"), ("e2e_ms.p95", "E2E p95"), ("output_tokens_per_s", "out tok/s"),
    ("requests_per_s", "req/s"), ("goodput_rps", "goodput req/s"), ("steady_state.duration_s", "steady s"),
    ("cache.cached_fraction", "cached"), ("meets_slo", "SLO"),
)
# the percentiles taken over requests (ITL pools every gap of every request: it has many more)
_TAILS = tuple(f"{m}_ms.{p}" for m in ("ttft", "tpot", "e2e") for p in ("p95", "p99"))


DEFINITIONS = (
    "TTFT: request sent → first chunk with content (the generator's own wait for a free "
    "concurrency slot is never counted). TPOT: (e2e − TTFT) / (output tokens − 1), per request. "
    "ITL: gaps between content chunks, all requests pooled. E2E: request sent → end of stream. "
    "Latencies in ms; percentiles interpolated. Throughput (out tok/s, req/s, goodput) over the run's "
    "steady state: from the end of the first answer to the last request's send, so neither the ramp-up "
    "(every request starting at once) nor the drain (fewer and fewer in flight) counts; `steady s` is "
    "that window's length, `–` where a run was too short to have one (then: its whole wall time). "
    "Goodput: requests that succeeded and met every latency SLO on their own, per second. A level holds "
    "when it meets every SLO, the error budget included (`error_rate`: any failed request, a 429 as much "
    "as a 500). `cached`: the share of prompt tokens the runtime says it took from its prompt cache. "
    f"A p95 or p99 marked * rests on fewer than {FEW_FOR_TAIL} requests: one slow request moves it."
)


def cell(run: dict[str, Any], key: str) -> str:
    if key in _TAILS and few_for_tail(run) and _get(run, key) is not None:
        return f"{_format(_get(run, key), key)}*"
    return _format(_get(run, key), key)


def _get(run: dict[str, Any], key: str) -> Any:
    value: Any = run
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _format(value: Any, key: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key in ("requests_per_s", "goodput_rps"):
        return f"{value:.2f}"
    if key == "rate":
        return f"{value:g}"
    if key.endswith("_fraction"):
        return f"{value:.0%}"
    if key.endswith("_bytes"):
        return gib(value)
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def run_table(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    show_class = any(r["class"] is not None for r in runs)
    cols = ([("class", "class")] if show_class else []) + list(COLUMNS)
    if all(r["rate"] is None for r in runs):
        cols = [c for c in cols if c[0] != "rate"]
    if all((r.get("cache") or {}).get("source") is None for r in runs):
        cols = [c for c in cols if c[0] != "cache.cached_fraction"]
    return [h for _, h in cols], [[cell(r, k) for k, _ in cols] for r in runs]


def where(run: dict[str, Any]) -> str:
    parts = [f"class {run['class']}"] if run["class"] else []
    if run["rate"] is not None:
        parts.append(f"rate {run['rate']:g}/s")
    if run["concurrency"] is not None:
        parts.append(f"c={run['concurrency']}")
    return ", ".join(parts)


# --- verdict ---------------------------------------------------------------------------------
def verdict_rows(v: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["target", "load held within SLOs", "out tok/s there", "req/s there", "goodput req/s there",
            "memory there"]
    rows = []
    for name, t in v["targets"].items():
        tag = " (winner)" if name == v["winner"] else " (tie)" if name in v.get("tie", []) else ""
        mem = memory_phrase(t.get("memory")) if t.get("max_concurrency") or t.get("max_rate") else None
        if mem is None and t.get("memory"):
            mem = f"{memory_phrase(t['memory'])} at {t.get('memory_at')} (not held)"
        rows.append([name + tag, t.get("summary", "–"), cell(t, "output_tokens_per_s"), cell(t, "requests_per_s"),
                     cell(t, "goodput_rps"), mem or "–"])
    return head, rows


# --- cache check -----------------------------------------------------------------------------
def prompt_lines(results: dict[str, Any]) -> list[str]:
    w = results["workload"]
    if w.get("nonce"):
        text = (f"prompts: fresh for this run (nonce `{w['nonce']}` mixed into every prompt, another per target), "
                "so no request can be answered from a cache an earlier run or target filled")
    else:
        text = (f"prompts: reproducible (`--seed {w.get('seed')}`): the same prompts as any run with that seed; "
                "a runtime that still holds them in its cache answers them faster (the check below says)")
    out = [text]
    if w.get("prefix_share"):
        out.append(f"deliberate shared prefix: {w['prefix_share']:.0%} of each prompt is a passage common to all "
                   "requests of a target (`--prefix-share`), as a system prompt would be: cache hits on it are "
                   "expected")
    if w.get("turns", 1) > 1:
        out.append(f"{w['turns']}-turn chats: later turns share their conversation's history on purpose and are "
                   "left out of the check")
    return out


def cache_rows(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    head = ["target", "load", "prompt tokens cached", "first-turn requests served from cache", "source"]
    rows = []
    for r in runs:
        c = r.get("cache") or {}
        runtime = c.get("runtime") or {}
        if c.get("source"):
            share = cell(c, "cached_fraction")
            served = f"{c.get('served_from_cache', 0)} of {c.get('first_turn_requests', 0)}"
            source = c["source"]
        elif runtime:
            share, served, source = cell(runtime, "hit_fraction"), "–", runtime["source"]
        else:
            share, served, source = "–", "–", "the runtime reports nothing"
        rows.append([r["target"], where(r), share, served, source])
    return head, rows


# --- memory ------------------------------------------------------------------------------------
_AT_REST = (("rss_bytes", "RSS"), ("pss_bytes", "PSS"), ("gpu_process_bytes", "GPU"),
            ("gpu_device_used_bytes", "GPU in use on the device"), ("gpu_gtt_used_bytes", "GTT in use"))

def memory_lines(target: dict[str, Any]) -> list[str]:
    """What was measured for one target: which processes, at rest, what the runtime reports."""
    mem = target.get("memory") or {}
    proc = mem.get("process")
    lines = []
    if proc:
        kids = mem.get("children") or []
        names = ", ".join(sorted({k.get("name", "?") for k in kids}))
        lines.append(f"process: {proc.get('name', '?')} (pid {proc['pid']}, {mem.get('found')})"
                     + (f" and {len(kids)} child process{'es' if len(kids) != 1 else ''} ({names})" if kids else ""))
        rest = mem.get("at_rest") or {}
        parts = [f"{name} {gib(rest[key])}" for key, name in _AT_REST if rest.get(key) is not None]
        if parts:
            lines.append("at rest (before the first level): " + ", ".join(parts))
    else:
        lines.append(f"process: {mem.get('found', 'not measured')}")
    gpu_info = mem.get("gpu")
    if gpu_info:
        devices = "; ".join(f"{d.get('name')} ({gib(d['total_bytes'])})" if d.get("total_bytes")
                            else str(d.get("name")) for d in gpu_info.get("devices", []))
        lines.append(f"GPU memory from {gpu_info['source']}: {devices}")
    runtime = mem.get("runtime") or {}
    if runtime.get("slots"):
        ctx = runtime.get("n_ctx_per_slot")
        lines.append(f"runtime reports {runtime['slots']} slots" + (f" of {ctx} tokens of context each" if ctx else ""))
    vc = runtime.get("vllm_cache") or {}
    if vc.get("kv_capacity_tokens"):
        size = f"{gib(vc['kv_cache_bytes'])}, " if vc.get("kv_cache_bytes") else ""
        lines.append(f"runtime reports a KV cache of {vc['kv_capacity_tokens']:,} tokens "
                     f"({size}{vc.get('num_gpu_blocks')} blocks of {vc.get('block_size')})")
    return lines


MEMORY_COLUMNS = (("rss_peak_bytes", "RSS peak"), ("pss_peak_bytes", "PSS peak"),
                  ("gpu_process_peak_bytes", "GPU peak"), ("gpu_device_used_peak_bytes", "GPU device peak"),
                  ("gpu_gtt_used_peak_bytes", "GTT peak"), ("kv_cache_usage_peak", "KV cache use peak"))


def memory_rows(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    shown = [(k, h) for k, h in MEMORY_COLUMNS if any((r.get("memory") or {}).get(k) is not None for r in runs)]
    head = ["target", "load", *(h for _, h in shown)]
    rows = []
    for r in runs:
        m = r.get("memory") or {}
        rows.append([r["target"], where(r), *(_share(m[k]) if k == "kv_cache_usage_peak" and m.get(k) is not None
                                               else cell(m, k) for k, _ in shown)])
    return head, rows


def _share(x: float) -> str:
    return f"{x:.0%}" if x >= 0.1 or x == 0 else f"{x:.2%}"


# --- workload ----------------------------------------------------------------------------------
def workload_lines(results: dict[str, Any]) -> list[str]:
    w, load = results["workload"], results["load"]
    lines = [
        f"endpoint: {w['endpoint']} (streaming; `stream_options.include_usage`: {w['include_usage']}; "
        f"`ignore_eos`: {w['ignore_eos']})",
        f"prompt: {w['prompt_tokens']} tokens" + (f" ± {w['prompt_spread']}" if w["prompt_spread"] else "")
        + f"; output: max_tokens {w['max_tokens']}" + (f" ± {w['max_tokens_spread']}" if w["max_tokens_spread"]
                                                       else "") + (f"; {w['turns']} turns per chat" if
                                                                   w["turns"] > 1 else ""),
    ]
    if load.get("scenario"):
        lines.append(f"scenario: {load['scenario']}")
    if load.get("trace"):
        lines.append(f"trace replay: {load['trace']}, {load['trace_requests']} requests over "
                     f"{load['trace_span_s']:g} s (×{load['trace_speed']:g} speed), prompts "
                     f"{load['trace_prompt_tokens_mean']:g} and answers {load['trace_output_tokens_mean']:g} tokens on "
                     "average: arrivals and lengths from the trace, not the options above")
    elif load.get("rate"):
        lines.append(f"open loop at {', '.join(f'{r:g}' for r in load['rate'])} requests/s "
                     f"({'Poisson' if load.get('poisson') else 'constant'} arrivals)"
                     + (f", at most {', '.join(map(str, load['concurrency']))} in flight"
                        if load.get("concurrency") else ""))
    elif load.get("concurrency"):
        lines.append(f"closed loop at concurrency {', '.join(map(str, load['concurrency']))}")
    if load.get("find_max"):
        lines.append(f"`--find-max`: the load doubled from the first value until an SLO broke, then bisected "
                     f"(up to {load['find_max']['limit']:g})")
    if (load.get("rounds") or 1) > 1:
        lines.append(f"each level measured in {load['rounds']} rounds, the targets taking turns (A B, then B A, ...) "
                     "so that other load on the machine weighs on each alike; each target's rounds pooled")
    size = (f"{load['duration']:g} s per level" if load.get("duration") else
            f"{load['requests']} requests per level" if load.get("requests") else "")
    warm, procs = load.get("warmup", 0), load.get("processes", 1)
    lines.append(f"{size + '; ' if size else ''}{warm} warm-up request{'s' if warm != 1 else ''} before each level "
                 f"(not counted); {procs} generator process{'es' if procs != 1 else ''}")
    lines.append("steady state: throughput counts the tokens that arrived between the end of a level's first "
                 "answer and its last request's send (ramp-up and drain excluded); latencies count every request")
    return lines


# --- notes -------------------------------------------------------------------------------------
def notes(results: dict[str, Any]) -> list[str]:
    out = list(results.get("notes", []))
    m = results.get("machine") or {}
    busy = max(m.get("load_average_start") or 0, m.get("load_average_end") or 0)
    if m.get("cores") and busy > 0.75 * m["cores"]:
        out.append(f"**The machine was busy** (load average {m.get('load_average_start')} at the start, "
                   f"{m.get('load_average_end')} at the end, on {m['cores']} cores): other processes took CPU time "
                   "from the runtime and the generator, and latencies include that.")
    out += _retry_notes(results)
    v = results.get("verdict") or {}
    if v.get("model_ids_differ"):
        models = ", ".join(f"{t} → {m}" for t, m in v["models"].items())
        out.append(f"**Model ids differ between targets** ({models}): different models or "
                   "quantizations; the comparison is not like for like.")
    for run in results["runs"]:
        at = f"{run['target']} {where(run)}"
        if run.get("cache_warning"):
            out.append(f"**{at}: served from cache** — {run['cache_warning']}.")
        if run.get("tail_warning"):
            out.append(f"**{at}: {run['tail_warning']}**.")
        src = run["token_count_source"]
        if src in ("chunks", "mixed"):
            out.append(f"{at}: token counts from content chunks for {'some' if src == 'mixed' else 'all'} "
                       "requests (the server sent no usage).")
        tpc = run.get("tokens_per_chunk")
        if tpc and tpc > 1.05:
            out.append(f"{at}: the server packs {tpc:.2f} tokens per chunk on average; ITL measures "
                       "gaps between chunks, not between tokens.")
        gen = run.get("generator") or {}
        if (gen.get("loop_lag_ms_p99") or 0) > 5:
            out.append(f"{at}: the generator's event loop ran late (p99 {gen['loop_lag_ms_p99']:.1f} ms): the "
                       "machine was busy or the generator saturated (then try --processes); latencies may "
                       "include that much generator time.")
        if (gen.get("send_lag_ms_p99") or 0) > 5:
            out.append(f"{at}: arrivals were sent late (p99 {gen['send_lag_ms_p99']:.1f} ms); the "
                       "generator could not hold the rate.")
        for kind, n in run.get("errors_by_kind", {}).items():
            sample = run.get("error_samples", {}).get(kind, "")
            out.append(f"{at}: {n} × {kind}" + (f" — {sample}" if sample else ""))
    return out


def _retry_notes(results: dict[str, Any]) -> list[str]:
    totals: dict[str, int] = {}
    for run in results["runs"]:
        if run["class"] in (None, "all"):
            totals[run["target"]] = totals.get(run["target"], 0) + (run.get("retried_on_closed_connection") or 0)
    return [f"{name}: the server closed keep-alive connections right after answers (llama-server does); "
            f"{n} requests written on such a connection were sent again on a new one, their clocks starting "
            "at the second send." for name, n in totals.items() if n]

