"""From request measurements to the numbers of ``results.json``: percentiles, SLOs, throughput, goodput.

Definitions (DESIGN): TTFT = request sent → first content chunk; TPOT = (e2e − TTFT) / (output
tokens − 1), per request; ITL = gaps between content chunks, pooled over all requests of a run;
e2e = request sent → end of stream. Percentiles interpolate linearly between order statistics.

Throughput is measured over the run's **steady state**: from the end of the first answer (by
then every concurrent request has been through a whole cycle: the ramp-up, when all of them
started together, is over) to the last request's send (after which fewer requests are in flight
and the queue drains). Tokens are counted by the arrival time of their chunks; requests/s is that
token rate over the mean answer length, goodput its share of requests meeting every SLO. A run
too short to have one (its steady part under a quarter of its wall time) is measured over its
whole wall time (first send → last answer), and the record says which.

Goodput counts the successful requests that meet every latency SLO on their own (TTFT, TPOT and
e2e of the request; for ITL, the request's own percentile of its gaps), per second.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from passerelle.bench.client import RequestResult
from passerelle.bench.runner import LevelResult
from passerelle.bench.workload import parse_duration

STATS = ("mean", "p50", "p90", "p95", "p99")
METRICS = ("ttft", "tpot", "itl", "e2e")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100) of already sorted values, linear interpolation."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize_ms(values_s: Iterable[float]) -> dict[str, float | None]:
    """mean/p50/p90/p95/p99 in milliseconds (``None`` each when there is no value)."""
    values = sorted(v * 1000.0 for v in values_s)
    if not values:
        return dict.fromkeys(STATS)
    out: dict[str, float | None] = {"mean": round(sum(values) / len(values), 3)}
    for name in STATS[1:]:
        out[name] = round(percentile(values, float(name[1:])), 3)
    return out


# --- SLOs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slo:
    metric: str  # ttft, tpot, itl, e2e, or error_rate
    stat: str | None  # mean, p50, ... (None for error_rate)
    threshold: float  # milliseconds, or a fraction for error_rate

    @property
    def key(self) -> str:
        return f"{self.metric}_{self.stat}" if self.stat else self.metric

    def describe(self) -> str:
        if self.metric == "error_rate":
            return f"error_rate ≤ {self.threshold * 100:g} %"
        return f"{self.key} ≤ {self.threshold:g} ms"


# The share of a level's requests that may fail (any error: an HTTP 429 or 500, a cut stream, a
# timeout) for the level to hold, when --slo names no error_rate: a load where requests fail is
# never "held", however fast the answers that did come back.
DEFAULT_ERROR_BUDGET = 0.01


def with_error_budget(slos: Sequence[Slo], budget: float | None) -> list[Slo]:
    """``slos`` with an ``error_rate`` SLO of ``budget`` (default 1 %) unless they already have one;
    ValueError when both name one and they differ."""
    given = [s for s in slos if s.metric == "error_rate"]
    if given:
        if budget is not None and any(s.threshold != budget for s in given):
            raise ValueError("--error-budget and error_rate in --slo say different things; give one")
        return list(slos)
    return [*slos, Slo("error_rate", None, DEFAULT_ERROR_BUDGET if budget is None else budget)]


def parse_slos(text: str | None) -> list[Slo]:
    """``ttft_p95=2s,tpot_p95=100ms,e2e_p99=30s,error_rate=1%``; a bare number is milliseconds."""
    if not text:
        return []
    out = []
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not value:
            raise ValueError(f"SLO {item.strip()!r}: expected KEY=VALUE, e.g. ttft_p95=2s")
        if key == "error_rate":
            frac = float(value[:-1]) / 100 if value.endswith("%") else float(value)
            out.append(Slo("error_rate", None, frac))
            continue
        metric, _, stat = key.partition("_")
        if metric not in METRICS or stat not in STATS:
            raise ValueError(f"SLO {key!r}: expected METRIC_STAT with METRIC in {', '.join(METRICS)} and "
                             f"STAT in {', '.join(STATS)} (or error_rate)")
        out.append(Slo(metric, stat, parse_duration(value, default_unit="ms") * 1000.0))
    return out


def _request_meets(r: RequestResult, slos: Sequence[Slo]) -> bool:
    for slo in slos:
        if slo.metric == "error_rate":
            continue
        value: float | None
        if slo.metric == "itl":
            if not r.itl:
                continue
            gaps = sorted(r.itl)
            value = sum(gaps) / len(gaps) if slo.stat == "mean" else percentile(gaps, float((slo.stat or "p50")[1:]))
        else:
            value = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}[slo.metric]
            if value is None:
                if slo.metric == "tpot":
                    continue  # a one-token answer has no TPOT
                return False
        if value * 1000.0 > slo.threshold:
            return False
    return True


def run_failures(run: dict[str, Any], slos: Sequence[Slo]) -> list[str]:
    """The SLO keys a run misses (a run without a single success misses all)."""
    failed = []
    if not run["requests_ok"]:
        return [s.key for s in slos] or ["no successful request"]
    for slo in slos:
        if slo.metric == "error_rate":
            total = run["requests_ok"] + run["errors"]
            if run["errors"] / total > slo.threshold:
                failed.append(slo.key)
            continue
        value = run[f"{slo.metric}_ms"][slo.stat]
        if value is not None and value > slo.threshold:
            failed.append(slo.key)
    return failed


# A p95 (p99) of fewer requests than this is one or two requests: it moves with any single one.
FEW_FOR_TAIL = 20


def few_for_tail(run: dict[str, Any]) -> bool:
    """Does this run's p95 rest on too few requests to mean much?"""
    return bool(0 < run.get("requests_ok", 0) < FEW_FOR_TAIL)


def tail_warning(run: dict[str, Any]) -> str | None:
    n = run.get("requests_ok", 0)
    if not few_for_tail(run):
        return None
    return (f"its p95 and p99 rest on {n} request{'s' if n != 1 else ''}, fewer than {FEW_FOR_TAIL}: one slow "
            f"request moves them (give --requests {FEW_FOR_TAIL} or more)")


# --- steady state --------------------------------------------------------------------------
STEADY_MIN_SHARE = 0.25


def steady_window(level: LevelResult) -> tuple[float, float] | None:
    """(start, end) on the ``perf_counter`` clock: first answer's end → last send; ``None`` when
    that is under a quarter of the run (every request sent before the first one ended)."""
    results = level.results
    # the first *answer*: a request refused at once does not end the ramp-up
    done = [r.t_done for r in results if r.ok and r.t_done] or [r.t_done for r in results if r.t_done]
    sends = [r.t_send for r in results if r.t_send]
    if not done or not sends:
        return None
    start, end = min(done), max(sends)
    if end - start < STEADY_MIN_SHARE * level.wall_s:
        return None
    return start, end


def _tokens_between(r: RequestResult, start: float, end: float) -> float:
    """Output tokens of one request whose chunks arrived in [start, end]."""
    if r.ttft is None or not r.chunks:
        return 0.0
    per_chunk = r.output_tokens / r.chunks
    t = r.t_send + r.ttft
    n = 1 if start <= t <= end else 0
    for gap in r.itl:
        t += gap
        if t > end:
            break
        if t >= start:
            n += 1
    return n * per_chunk


def throughput(level: LevelResult, results: Sequence[RequestResult], slos: Sequence[Slo]) -> dict[str, Any]:
    """Output tokens/s, requests/s and goodput over the steady state (else the whole run).

    A level made of rounds (``segments``) adds up each round's steady window, tokens and requests.
    """
    ok = [r for r in results if r.ok]
    whole = {"output_tokens_per_s": sum(r.output_tokens for r in ok) / level.wall_s,
             "requests_per_s": len(ok) / level.wall_s,
             "goodput_rps": sum(1 for r in ok if _request_meets(r, slos)) / level.wall_s}
    whole = {k: round(v, 4) for k, v in whole.items()}
    span = tokens = 0.0
    finished: list[RequestResult] = []
    windows = []
    for seg in level.segments or [level]:
        window = steady_window(seg)
        if window is None:
            return {**whole, "throughput_over": "whole run", "whole_run": whole, "steady_state": None}
        start, end = window
        ids = {id(x) for x in seg.results}
        mine = ok if seg is level else [r for r in ok if id(r) in ids]
        span += end - start
        tokens += sum(_tokens_between(r, start, end) for r in mine)
        finished += [r for r in mine if start < r.t_done <= end]
        windows.append((round(start - seg.started, 3), round(end - seg.started, 3)))
    steady: dict[str, Any] = {"start_s": windows[0][0], "end_s": windows[0][1], "duration_s": round(span, 3),
              "requests_ended": len(finished), "output_tokens": round(tokens, 1)}
    if len(windows) > 1:
        steady["rounds"] = [{"start_s": a, "end_s": b} for a, b in windows]
    # Requests/s from tokens/s and the mean answer length, not by counting the requests that ended
    # inside the window: closed-loop requests end in batches, and a window edge on a batch's end
    # would count or miss a whole batch.
    rps = tokens / span / (sum(r.output_tokens for r in ok) / len(ok)) if ok else 0.0
    good = sum(1 for r in ok if _request_meets(r, slos)) / len(ok) if ok else 0.0
    return {"output_tokens_per_s": round(tokens / span, 4), "requests_per_s": round(rps, 4),
            "goodput_rps": round(rps * good, 4), "throughput_over": "steady state", "whole_run": whole,
            "steady_state": steady}


def spread(results: Sequence[RequestResult]) -> float | None:
    """The relative standard error of the mean request time (e2e): how much a rerun of this many
    requests would move a throughput that follows from it (``verdict``'s noise estimate)."""
    times = [r.e2e for r in results if r.ok and r.e2e]
    if len(times) < 2:
        return None
    mean = sum(times) / len(times)
    var = sum((t - mean) ** 2 for t in times) / (len(times) - 1)
    return round(math.sqrt(var / len(times)) / mean, 4)


# --- one run (a level, or one class of a scenario) ------------------------------------------
def run_record(target: str, level: LevelResult, results: Sequence[RequestResult], slos: Sequence[Slo],
               cls: str | None = None, concurrency: int | None = None, rate: float | None = None,
               prompt_tokens_requested: float | None = None, prefix_share: float = 0.0) -> dict[str, Any]:
    """The ``results.json`` entry of one run; DESIGN's keys first, additions after."""
    from passerelle.bench import cache

    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    wall = level.wall_s
    rates = throughput(level, results, slos)
    kinds = Counter(r.error or "unknown" for r in errors)
    samples: dict[str, str] = {}
    for r in errors:
        samples.setdefault(r.error or "unknown", r.detail)
    usage = sum(1 for r in ok if r.usage)
    source = None if not ok else "usage" if usage == len(ok) else "chunks" if usage == 0 else "mixed"
    out_tokens = sum(r.output_tokens for r in ok)
    chunks = sum(r.chunks for r in ok)
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    record: dict[str, Any] = {
        "target": target,
        "concurrency": concurrency,
        "rate": rate,
        "requests_ok": len(ok),
        "errors": len(errors),
        "ttft_ms": summarize_ms(r.ttft for r in ok if r.ttft is not None),
        "tpot_ms": summarize_ms(t for r in ok if (t := r.tpot) is not None),
        "itl_ms": summarize_ms(g for r in ok for g in r.itl),
        "e2e_ms": summarize_ms(r.e2e for r in ok if r.e2e is not None),
        "output_tokens_per_s": round(rates["output_tokens_per_s"], 3),
        "requests_per_s": rates["requests_per_s"],
        "goodput_rps": rates["goodput_rps"],
        "token_count_source": source,
        # additions to the DESIGN schema
        "class": cls,
        "requests": len(results),
        "errors_by_kind": dict(sorted(kinds.items())),
        "error_samples": samples,
        "duration_s": round(wall, 3),
        "output_tokens": out_tokens,
        "output_tokens_mean": round(out_tokens / len(ok), 3) if ok else None,
        "prompt_tokens_mean": round(sum(prompts) / len(prompts), 1) if prompts else None,
        "prompt_tokens_requested": prompt_tokens_requested,
        "tokens_per_chunk": round(out_tokens / chunks, 3) if chunks else None,
        "retried_on_closed_connection": sum(r.retries for r in results),
        "throughput_over": rates["throughput_over"],
        "throughput_rse": spread(results),
        "steady_state": rates["steady_state"],
        "whole_run": rates["whole_run"],
        "cache": cache.summarize(results, prefix_share),
        "generator": {
            "loop_lag_ms_p99": round(percentile(sorted(level.loop_lag), 99) * 1000, 3) if level.loop_lag else None,
            "send_lag_ms_p99": round(percentile(sorted(level.send_lag), 99) * 1000, 3) if level.send_lag else None,
        },
    }
    record["slo_failures"] = run_failures(record, slos)
    record["meets_slo"] = not record["slo_failures"]
    record["tail_warning"] = tail_warning(record)
    return record


def level_records(target: str, level: LevelResult, slos: Sequence[Slo]) -> list[dict[str, Any]]:
    """One record per class of the level, plus an ``all`` record when there are several classes."""
    classes = level.level.classes
    if len(classes) == 1 and classes[0].name is None:
        c = classes[0]
        return [run_record(target, level, level.results, slos, None, level.level.concurrency,
                           level.level.rate, c.workload.prompt_tokens, c.workload.prefix_share)]
    records = []
    for c in classes:
        mine = [r for r in level.results if r.cls == c.name]
        records.append(run_record(target, level, mine, slos, c.name, c.concurrency, c.rate,
                                  c.workload.prompt_tokens, c.workload.prefix_share))
    conc = sum(c.concurrency or 0 for c in classes) or None
    rate = sum(c.rate or 0 for c in classes) or None
    share = max(c.workload.prefix_share for c in classes)
    records.append(run_record(target, level, level.results, slos, "all", conc, rate, prefix_share=share))
    return records


def level_line(result: LevelResult) -> str:
    """A finished level in one line, with the figures its whole-load record (and so the report)
    gives: TTFT p50 interpolated, output tokens/s over the steady state."""
    run = level_records("", result, [])[-1]
    p50 = run["ttft_ms"]["p50"]
    return (f"{run['requests_ok']} ok, {run['errors']} errors, "
            + (f"TTFT p50 {p50:.1f} ms, " if p50 is not None else "")
            + f"{run['output_tokens_per_s']:.1f} output tok/s"
            + (" (steady state)" if run["throughput_over"] == "steady state" else ""))
