"""The verdict: per target, the load it holds within the SLOs and whether a limit was found; the winner.

A target **holds** load L when every tested load up to L met every SLO, the error budget
included (``error_rate``: 1 % of requests by default, whatever failed them: a 429 as much as a
500). Goodput (requests that succeeded within every latency SLO, per second) stands beside the
throughput. It is said to "fail at"
the first load above that which missed one (and which SLO), or, when every tested load passed,
to hold "≥ L (the highest load tried)": a limit not found is not a limit. Only whole-load runs
count (a plain level, or a scenario's ``all``)::

    vulkan holds 4 concurrent requests, fails at 8 (TTFT p95) …
    rocm holds ≥ 4 concurrent requests (the highest load tried) …

With several targets, the winner holds the highest load (a single target is measured, never a
"winner"); at equal load a target whose limit was not found ranks above
one that failed just beyond, and then the higher output tokens/s wins — unless the throughputs
differ by less than the noise: ``tie_margin`` (5 % by default) or twice the combined relative
standard error of the two runs' mean request times, whichever is larger. Then there is no winner
and the verdict says it is a tie. Next to the winner's throughput
stands its memory at that load: peak PSS of the runtime's process tree (RSS where PSS cannot be
read) and GPU memory where there is a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from passerelle.bench.stats import Slo

DEFAULT_TIE_MARGIN = 0.05


def load_key(run: dict[str, Any]) -> tuple[float, float]:
    return (run["concurrency"] or 0, run["rate"] or 0.0)


def label(run: dict[str, Any]) -> str:
    parts = []
    if run["rate"] is not None:
        parts.append(f"rate {run['rate']:g}/s")
    if run["concurrency"] is not None:
        parts.append(f"concurrency {run['concurrency']}")
    return ", ".join(parts)


def load_phrase(run: dict[str, Any]) -> str:
    """``4 concurrent requests`` or ``2 requests/s``."""
    if run["rate"] is not None:
        return f"{run['rate']:g} requests/s"
    c = run["concurrency"]
    return f"{c} concurrent request{'' if c == 1 else 's'}"


def _short_load(run: dict[str, Any]) -> str:
    return f"{run['rate']:g}/s" if run["rate"] is not None else f"{run['concurrency']}"


def slo_name(key: str) -> str:
    """``ttft_p95`` → ``TTFT p95``; ``error_rate`` → ``error rate``."""
    if key == "error_rate":
        return "error rate"
    metric, _, stat = key.partition("_")
    return f"{metric.upper()} {stat}" if stat else key


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def memory_phrase(mem: dict[str, Any] | None) -> str | None:
    """``1.21 GiB (PSS, peak) + 5.30 GiB GPU``, from a run's ``memory`` section."""
    if not mem:
        return None
    parts = []
    if mem.get("pss_peak_bytes") is not None:
        parts.append(f"{gib(mem['pss_peak_bytes'])} resident (PSS, peak)")
    elif mem.get("rss_peak_bytes") is not None:
        parts.append(f"{gib(mem['rss_peak_bytes'])} resident (RSS, peak)")
    if mem.get("gpu_process_peak_bytes") is not None:
        parts.append(f"{gib(mem['gpu_process_peak_bytes'])} GPU")
    elif mem.get("gpu_device_used_peak_bytes") is not None:
        parts.append(f"{gib(mem['gpu_device_used_peak_bytes'])} GPU in use on the device")
    return " + ".join(parts) or None


def target_verdict(mine: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One target's part of the verdict from its whole-load runs."""
    ordered = sorted(mine, key=load_key)
    held = fails = None
    for r in ordered:
        if r["meets_slo"]:
            held = r
        else:
            fails = r
            break
    again = [r for r in ordered if fails is not None and load_key(r) > load_key(fails) and r["meets_slo"]]
    out = {
        "max_concurrency": held["concurrency"] if held else None,
        "max_rate": held["rate"] if held else None,
        "output_tokens_per_s": held["output_tokens_per_s"] if held else None,
        "requests_per_s": held["requests_per_s"] if held else None,
        "goodput_rps": held["goodput_rps"] if held else None,
        "loads_meeting_slo": [label(r) for r in ordered if r["meets_slo"]],
        "loads_tested": [label(r) for r in ordered],
        "limit_found": fails is not None,
        "fails_at": label(fails) if fails else None,
        "fails_on": list(fails.get("slo_failures", [])) if fails else [],
        "passes_again_at": [label(r) for r in again],
        # the memory at the load held; where none was, at the lowest load tried (still the runtime's cost)
        "memory": (held or ordered[0]).get("memory") if ordered else None,
        "memory_at": label(held or ordered[0]) if ordered else None,
        "throughput_rse": held.get("throughput_rse") if held else None,
    }
    out["summary"] = _summary(held, fails, again)
    return out


def _why(run: dict[str, Any]) -> str:
    """`` (TTFT p95, error rate 80 %)``: what a run missed, with its error rate where that was it."""
    names = []
    for key in run.get("slo_failures", []):
        name = slo_name(key)
        total = run.get("requests_ok", 0) + run.get("errors", 0)
        if key == "error_rate" and total:
            name += f" {run['errors'] / total:.0%}"
        names.append(name)
    return f" ({', '.join(names)})" if names else ""


def _summary(held: dict[str, Any] | None, fails: dict[str, Any] | None, again: list[dict[str, Any]]) -> str:
    why = _why(fails) if fails else ""
    if held is None:
        text = f"fails at the lowest load tried, {load_phrase(fails)}{why}" if fails else "nothing measured"
    elif fails is None:
        text = f"holds ≥ {load_phrase(held)} (the highest load tried)"
    else:
        text = f"holds {load_phrase(held)}, fails at {_short_load(fails)}{why}"
    if again:
        text += f"; passed again at {', '.join(_short_load(r) for r in again)} (noisy?)"
    return text


def verdict(runs: Sequence[dict[str, Any]], slos: Sequence[Slo], models: dict[str, str | None],
            tie_margin: float = DEFAULT_TIE_MARGIN) -> dict[str, Any]:
    """Per target, the load held within the SLOs (and where it fails); the winner or a tie."""
    targets: dict[str, Any] = {}
    for name in dict.fromkeys(r["target"] for r in runs):
        mine = [r for r in runs if r["target"] == name and r["class"] in (None, "all")]
        if mine:
            targets[name] = target_verdict(mine)

    def rank(item: tuple[str, dict[str, Any]]) -> tuple[Any, ...]:
        t = item[1]
        return ((t["max_concurrency"] or 0, t["max_rate"] or 0.0), not t["limit_found"],
                t["output_tokens_per_s"] or 0.0)

    ranked = sorted(((n, t) for n, t in targets.items() if t["max_concurrency"] or t["max_rate"]),
                    key=rank, reverse=True)
    slo_text = ", ".join(s.describe() for s in slos) or "no SLO given"
    best, tie, noise = (ranked[0][0] if ranked else None), [], tie_margin
    if len(ranked) > 1 and rank(ranked[0])[:2] == rank(ranked[1])[:2]:
        first = ranked[0][1]
        top = first["output_tokens_per_s"] or 0.0
        for n, t in ranked:
            if rank((n, t))[:2] != rank(ranked[0])[:2]:
                continue
            margin = max(tie_margin, 2 * ((first["throughput_rse"] or 0) ** 2 + (t["throughput_rse"] or 0) ** 2) ** 0.5)
            if (t["output_tokens_per_s"] or 0.0) >= top * (1 - margin):
                tie.append(n)
                noise = max(noise, margin)
        if len(tie) > 1:
            best = None
        else:
            tie = []
    # one target is measured, not compared: it holds what it holds, and wins nothing
    winner = best if len(targets) > 1 else None
    if tie:
        rates = " vs ".join(f"{targets[n]['output_tokens_per_s']:.1f}" for n in tie)
        reason = (f"no clear winner: {' and '.join(tie)} each {targets[tie[0]]['summary']} within the SLOs "
                  f"({slo_text}), at output tokens/s within the noise of each other ({rates}; differences under "
                  f"{noise:.0%} are noise here)")
    elif best is None and len(targets) == 1:
        name, t = next(iter(targets.items()))
        reason = f"{name} {t['summary']}: it does not meet the SLOs ({slo_text}) at any tested load"
    elif best is None:
        reason = f"no target meets the SLOs ({slo_text}) at any tested load"
    else:
        w = targets[best]
        reason = (f"{best} {w['summary']} within the SLOs ({slo_text}), at {w['output_tokens_per_s']:.1f} "
                  "output tokens/s")
        mem = memory_phrase(w["memory"])
        if mem:
            reason += f" and {mem}"
        if w["goodput_rps"] is not None:
            reason += f"; goodput {w['goodput_rps']:.2f} requests/s (succeeded within the SLOs)"
    others = [f"{n}: {t['summary']}" for n, t in targets.items() if n != best and n not in tie
              and len(targets) > 1]
    if others:
        reason += " (" + "; ".join(others) + ")"
    distinct = {m for m in models.values() if m}
    return {
        "slo": [{"key": s.key, "threshold": s.threshold, "unit": "fraction" if s.stat is None else "ms"}
                for s in slos],
        "targets": targets,
        "winner": winner,
        "tie": tie,
        "tie_margin": tie_margin,
        "tie_within": round(noise, 4) if tie else None,
        "reason": reason,
        "models": dict(models),
        "model_ids_differ": len(distinct) > 1,
    }
