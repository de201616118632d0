"""Was a run answered from the runtime's prompt cache? The check behind the report's cache warning.

A runtime that finds a request's prompt (or most of it) in its prefix cache skips computing it,
and the request's TTFT then measures a lookup, not the work a fresh prompt costs: a benchmark run
after another with the same prompts, or a second target behind the same runtime, can look many
times faster than it is. The bench sends fresh prompts (``workload``'s nonce), and checks what the
runtime itself says it took from its cache:

- per request: ``usage.prompt_tokens_details.cached_tokens``, or llama-server's
  ``timings.cache_n`` (see ``client``);
- per level, from the runtime's counters when its ``/metrics`` is reachable (``monitor``):
  vLLM's ``prefix_cache_hits_total`` over ``prefix_cache_queries_total``, llama-server's
  ``prompt_tokens_cached_total``.

A request counts as **served from cache** when the runtime reused more of its prompt than the
workload shares on purpose (``--prefix-share``; later turns of a chat share their history and are
left out) by more than ``max(16 tokens, 20 % of the prompt)``: a chat template's first few tokens
always match, and that is not a cache-served prompt. Example::

    summary = summarize(results, prefix_share=0.0)
    warning(summary)   # "12 of 16 requests were served from the runtime's prompt cache (…)" or None
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from passerelle.bench.client import RequestResult

SLACK_TOKENS = 16
SLACK_FRACTION = 0.2


def served_from_cache(r: RequestResult, prefix_share: float) -> bool:
    """More of this (first-turn) request's prompt came from the cache than the workload shares."""
    if r.cached_tokens is None or not r.prompt_tokens:
        return False
    deliberate = prefix_share * r.prompt_tokens
    return r.cached_tokens - deliberate > max(SLACK_TOKENS, SLACK_FRACTION * r.prompt_tokens)


def summarize(results: Sequence[RequestResult], prefix_share: float = 0.0) -> dict[str, Any]:
    """The cache section of a run's record (successful requests only)."""
    ok = [r for r in results if r.ok]
    reported = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    out: dict[str, Any] = {"prefix_share": prefix_share}
    if not reported:
        out["source"] = None  # the runtime says nothing per request
        return out
    sources = {r.cache_source for r in reported}
    out["source"] = ("usage.prompt_tokens_details.cached_tokens" if sources == {"usage"} else
                     "timings.cache_n" if sources == {"timings"} else "mixed")
    prompt = sum(r.prompt_tokens or 0 for r in reported)
    cached = sum(r.cached_tokens or 0 for r in reported)
    first = [r for r in reported if r.turn == 0]
    out.update({
        "requests_reporting": len(reported),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_fraction": round(cached / prompt, 4) if prompt else None,
        "first_turn_requests": len(first),
        "first_turn_cached_fraction": (round(sum(r.cached_tokens or 0 for r in first)
                                             / max(sum(r.prompt_tokens or 0 for r in first), 1), 4)
                                       if first else None),
        "served_from_cache": sum(1 for r in first if served_from_cache(r, prefix_share)),
        "later_turns": len(reported) - len(first),
    })
    evaluated = [r.prompt_evaluated for r in reported if r.prompt_evaluated is not None]
    if evaluated:
        out["prompt_tokens_evaluated_mean"] = round(sum(evaluated) / len(evaluated), 1)
    return out


def warning(cache: dict[str, Any] | None) -> str | None:
    """One sentence when the run was (partly) served from cache beyond what it shares on purpose."""
    if not cache:
        return None
    share = cache.get("prefix_share") or 0.0
    served = cache.get("served_from_cache") or 0
    if served:
        n = cache["first_turn_requests"]
        frac = cache.get("first_turn_cached_fraction") or 0.0
        return (f"{served} of {n} requests were served from the runtime's prompt cache ({frac:.0%} of their "
                f"prompt tokens reused{f', {share:.0%} shared on purpose' if share else ''}; source: "
                f"{cache['source']}): their TTFT measures a cache lookup, not prompt processing. Same prompts "
                "as an earlier run? Leave out --seed so each run gets fresh prompts")
    runtime = cache.get("runtime") or {}
    hit = runtime.get("hit_fraction")
    if cache.get("source") is None and hit is not None and runtime.get("prompt_tokens", 0) > 0:
        # no per-request figure: judge the level as a whole, turns and deliberate sharing allowed for
        allowed = share + (0.5 if cache.get("turns", 1) > 1 else 0.0) + SLACK_FRACTION
        if hit > allowed:
            return (f"the runtime served {hit:.0%} of this run's prompt tokens from its prefix cache "
                    f"({runtime['source']}){f', {share:.0%} shared on purpose' if share else ''}: TTFT "
                    "may measure cache lookups rather than prompt processing")
    return None
