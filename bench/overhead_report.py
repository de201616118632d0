"""bench/overhead.py's figures: the rounds of one target at one concurrency (a :class:`Cell`)
summed up against direct's, and the printed report (``report.md``) made from ``results.json``.

A figure is the median over rounds, and what a gateway adds is taken round by round against the
direct round that ran next to it, so that one disturbed round on a shared machine moves nothing;
the pooled percentiles are in the JSON too. ``goals`` says which of the issue's targets were met.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from harness import fmt, median, pct
from loadgen import Round


@dataclass
class Cell:
    """All rounds of one target at one concurrency.

    Figures are medians over rounds (one disturbed round on a shared machine does not move them);
    what a gateway adds is taken round by round against direct's round of the same index, which
    ran next to it. The pooled percentiles are in the JSON too.
    """

    ttft_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    cpu_s: float = 0.0
    rss: int = 0
    gen_cpu_s: float = 0.0
    wall_s: float = 0.0
    spread_ms: list[float] = field(default_factory=list)
    rounds: list[dict[str, float]] = field(default_factory=list)

    def add(self, r: Round, cpu: float, rss: int) -> None:
        self.spread_ms += r.spread_ms
        self.ttft_ms += r.ttft_ms
        self.e2e_ms += r.e2e_ms
        self.errors.update(r.errors)
        self.requests += r.requests
        self.cpu_s += cpu
        self.rss = max(self.rss, rss)
        self.gen_cpu_s += r.gen_cpu_s
        self.wall_s += r.wall_s
        self.rounds.append({"p50": pct(r.ttft_ms, 50), "p95": pct(r.ttft_ms, 95), "p99": pct(r.ttft_ms, 99),
                            "tps": r.tokens_per_s, "cpu_s": cpu, "requests": r.requests})

    def summary(self, direct: Cell | None, is_gateway: bool) -> dict[str, Any]:
        keys = ("p50", "p95", "p99")
        q = {k: round(median([r[k] for r in self.rounds]), 3) for k in keys}
        paired = direct is not None and is_gateway
        added = ({k: round(median([r[k] - d[k] for r, d in zip(self.rounds, direct.rounds, strict=False)]), 3)
                  for k in keys} if paired else None)
        vs = (median([r["tps"] / d["tps"] for r, d in zip(self.rounds, direct.rounds, strict=False) if d["tps"]])
              if direct is not None else None)
        return {
            "requests_measured": len(self.ttft_ms), "errors": dict(self.errors), "ttft_ms": q,
            "added_ttft_ms": added,
            "ttft_ms_pooled": {k: round(pct(self.ttft_ms, int(k[1:])), 3) for k in keys},
            "e2e_ms_p50": round(pct(self.e2e_ms, 50), 3),
            "tokens_per_s": round(median([r["tps"] for r in self.rounds]), 1),
            "tokens_per_s_vs_direct": None if vs is None else round(vs, 4),
            "cpu_s_per_1k_requests": round(1000 * self.cpu_s / self.requests, 3) if is_gateway and self.requests
            else None,
            "rss_mib": round(self.rss / 2**20, 1) if is_gateway else None,
            "requests_total": self.requests,
            "generator_cpu_pct": round(100 * self.gen_cpu_s / self.wall_s, 1) if self.wall_s else None,
            "rounds": [{k: round(v, 3) for k, v in r.items()} for r in self.rounds],
            **({"write_spread_ms": {"p50": round(pct(self.spread_ms, 50), 3), "max": round(max(self.spread_ms), 3)}}
               if self.spread_ms else {}),
        }



GROUP = "passerelle-procs"  # the target of ``--gateway-processes N``: N passerelle processes as one

NAMES = {"passerelle": "passerelle", "passerelle-b": "passerelle (B)",
         GROUP: "passerelle ×N (a bound)", "envoy": "Envoy",
         "vllm-router": "vllm-router", "smg": "SMG", "litellm": "LiteLLM", "direct": "direct",
         "passerelle-granian": "passerelle under granian"}


def added(s: dict[str, Any], keys: tuple[str, ...] = ("p50", "p99")) -> str:
    a = s["added_ttft_ms"]
    return " / ".join(f"{a[k]:+.2f}" for k in keys) + " ms" if a else "–"


def peers_table(results: dict[str, Any], targets: list[str]) -> str:
    """The issue's table: what each gateway adds to direct, per concurrency."""
    lines = ["| streams | target | added TTFT p50 / p99 | tokens/s vs direct | CPU s per 1k requests | RSS MiB | "
             "errors |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for level in results["levels"]:
        for name in targets:
            s = level["targets"].get(name)
            if s is None or name == "direct":
                continue
            vs = s["tokens_per_s_vs_direct"]
            lines.append(f"| {level['concurrency']} | {NAMES.get(name, name)} | {added(s)} | "
                         f"{fmt(None if vs is None else 100 * vs, 1)} % | {fmt(s['cpu_s_per_1k_requests'], 2)} | "
                         f"{fmt(s['rss_mib'], 0)} | {sum(s['errors'].values())} |")
    return "\n".join(lines)


def waves_table(results: dict[str, Any], targets: list[str]) -> str:
    """Synchronized waves: TTFT, and what each gateway adds, when N requests arrive at once."""
    lines = ["| wave | target | TTFT p50 / p99 ms | added TTFT p50 / p99 | CPU s per 1k requests | "
             "write spread p50 / max ms | requests | errors |",
             "|---:|---|---|---|---:|---|---:|---:|"]
    for wave in results.get("waves", []):
        for name in targets:
            s = wave["targets"].get(name)
            if s is None:
                continue
            q, w = s["ttft_ms"], s.get("write_spread_ms")
            spread = f"{w['p50']:.2f} / {w['max']:.2f}" if w else "–"
            lines.append(f"| {wave['size']} | {NAMES.get(name, name)} | {q['p50']:.2f} / {q['p99']:.2f} | {added(s)} | "
                         f"{fmt(s['cpu_s_per_1k_requests'], 2)} | {spread} | {s['requests_measured']} | "
                         f"{sum(s['errors'].values())} |")
    return "\n".join(lines)


def table(results: dict[str, Any], targets: list[str]) -> str:
    """Every figure per concurrency and target: TTFT, added TTFT, tokens/s, CPU, RSS."""
    lines = ["| streams | target | TTFT p50 / p95 / p99 ms | added p50 / p95 / p99 ms | tokens/s | vs direct | "
             "gateway CPU s / 1k req | RSS MiB | errors |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for level in results["levels"]:
        for name in targets:
            s = level["targets"].get(name)
            if s is None:
                continue
            q, a = s["ttft_ms"], s["added_ttft_ms"]
            add = " / ".join(f"{a[k]:+.1f}" for k in ("p50", "p95", "p99")) if a else "–"
            vs = s["tokens_per_s_vs_direct"]
            lines.append(
                f"| {level['concurrency']} | {name} | {q['p50']:.1f} / {q['p95']:.1f} / {q['p99']:.1f} | {add} | "
                f"{s['tokens_per_s']:,.0f} | {fmt(None if vs is None else 100 * vs, 1)} % | "
                f"{fmt(s['cpu_s_per_1k_requests'], 2)} | {fmt(s['rss_mib'], 0)} | "
                f"{sum(s['errors'].values())} |")
    return "\n".join(lines)


def leaner_router(targets: dict[str, Any]) -> str | None:
    """Of the Rust routers measured at a level, the one with less CPU per request (None: neither)."""
    rust = [n for n in ("vllm-router", "smg") if n in targets and targets[n]["cpu_s_per_1k_requests"]]
    return min(rust, key=lambda n: targets[n]["cpu_s_per_1k_requests"]) if rust else None


def goals(results: dict[str, Any]) -> list[str]:
    """The issues' goals that this run's figures speak to: met or not."""
    by = {lv["concurrency"]: lv["targets"] for lv in results["levels"]}
    out = []
    if 64 in by and "passerelle" in by[64]:
        a = by[64]["passerelle"]["added_ttft_ms"]
        out.append(f"added TTFT at 64 streams: p50 {a['p50']:+.2f} ms (goal <= 1), p99 {a['p99']:+.2f} ms "
                   f"(goal <= 5): {'met' if a['p50'] <= 1 and a['p99'] <= 5 else 'NOT met'}")
        if "litellm" in by[64]:
            la = by[64]["litellm"]["added_ttft_ms"]
            ratio = a["p50"] / la["p50"] if la["p50"] > 0 else float("nan")
            out.append(f"passerelle / LiteLLM added TTFT p50 at 64 streams: {a['p50']:.2f} / {la['p50']:.2f} ms "
                       f"= {ratio:.3f} (goal <= 0.2): {'met' if ratio <= 0.2 else 'NOT met'}")
    if 256 in by and "passerelle" in by[256]:
        mine = by[256]["passerelle"]
        f = mine["tokens_per_s_vs_direct"]
        if f is not None:
            out.append(f"tokens/s through passerelle at 256 streams: {100 * f:.1f} % of direct (goal >= 90 %): "
                       f"{'met' if f >= 0.9 else 'NOT met'}")
        p99 = mine["added_ttft_ms"]["p99"]
        out.append(f"added TTFT p99 at 256 streams: {p99:+.2f} ms (goal <= 2): {'met' if p99 <= 2 else 'NOT met'}")
        lean = leaner_router(by[256])
        if lean is not None and mine["cpu_s_per_1k_requests"]:
            ratio = mine["cpu_s_per_1k_requests"] / by[256][lean]["cpu_s_per_1k_requests"]
            out.append(f"CPU per request at 256 streams: {ratio:.2f}x {NAMES[lean]}'s, the leaner Rust router "
                       f"(goal <= 1.2): {'met' if ratio <= 1.2 else 'NOT met'}")
    for wave in results.get("waves", []):
        a = wave["targets"].get("passerelle", {}).get("added_ttft_ms")
        if wave["size"] == 64 and a:
            out.append(f"added TTFT p99 in waves of 64: {a['p99']:+.2f} ms (goal <= 5): "
                       f"{'met' if a['p99'] <= 5 else 'NOT met'}")
    return out + bound(results)


def bound(results: dict[str, Any]) -> list[str]:
    """The same goals for ``--gateway-processes N``: what N event loops with no shared state reach, the most
    that several acceptor processes in front of one scheduler could."""
    name, n = GROUP, results.get("processes")
    if not n:
        return []
    out = []
    for level in results["levels"]:
        mine, one = level["targets"].get(name), level["targets"].get("passerelle")
        if mine is None or level["concurrency"] != 256:
            continue
        lean = leaner_router(level["targets"])
        cpu = mine["cpu_s_per_1k_requests"]
        text = (f"{n} processes (a bound), 256 streams: added TTFT p99 {mine['added_ttft_ms']['p99']:+.2f} ms "
                f"(goal <= 2)")
        if one is not None and one["cpu_s_per_1k_requests"] and cpu:
            text += f", CPU per request {cpu / one['cpu_s_per_1k_requests']:.2f}x one process's"
        if lean is not None and cpu:
            text += f", {cpu / level['targets'][lean]['cpu_s_per_1k_requests']:.2f}x {NAMES[lean]}'s (goal <= 1.2)"
        out.append(text)
    for wave in results.get("waves", []):
        a = wave["targets"].get(name, {}).get("added_ttft_ms")
        if wave["size"] == 64 and a:
            out.append(f"{n} processes (a bound), waves of 64: added TTFT p99 {a['p99']:+.2f} ms (goal <= 5)")
    return out


def report(results: dict[str, Any], targets: list[str]) -> str:
    m = results["machine"]
    la = results["loadavg"]
    loads = ", ".join(f"{x['concurrency'] if 'concurrency' in x else 'waves of ' + str(x['waves'])}: "
                      f"{x['before'][0]:.2f}→{x.get('after', ['?'])[0]}" for x in la)
    psi = [x.get(k) for x in la for k in ("cpu_pressure_before", "cpu_pressure_after") if x.get(k) is not None]
    versions = ", ".join(f"{NAMES.get(n, n)} {v}" for n, v in results.get("versions", {}).items())
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}; load average (1 min) at start "
             f"{results['loadavg_start'][0]:.2f}, per level {loads}"
             + (f"; CPU pressure (PSI some, avg10) {min(psi):.0f}–{max(psi):.0f} %" if psi else "") + ".",
             f"Versions: {versions}.",
             *([f"passerelle ×N: {results['processes']} passerelle processes side by side, the load's connections "
                "spread over them, each with a scheduler of its own: a bound on what several acceptor processes "
                "in front of one scheduler could give (they would add a round trip to it per request)."]
               if results.get("processes") else []),
             *(f"Not measured: {NAMES.get(n, n)}, {why}." for n, why in results.get("failed", {}).items()),
             f"fake-backend: TTFT {results['fake']['ttft_ms']:g} ms, ITL {results['fake']['itl_ms']:g} ms, "
             f"{results['fake']['tokens']} tokens; {results['rounds']} rounds per level alternating the targets; "
             f"measured requests per target: {results['requests_per_level']}"
             + "".join(f"; waves of {w['size']}: {w['waves_per_round']} per round" for w in results.get("waves", []))
             + ".", ""]
    if "generator_ceiling" in results:
        c = results["generator_ceiling"]
        lines.append(f"Generator ceiling (direct, fake with TTFT 0 / ITL 1 ms, {c['concurrency']} streams): "
                     f"{c['tokens_per_s']:,.0f} tokens/s, {c['requests_per_s']:,.0f} requests/s, generator CPU "
                     f"{c['generator_cpu_pct']} %, fake CPU {c['fake_cpu_pct']} %.")
    for lv in results["levels"]:
        d = lv["targets"]["direct"]
        lines.append(f"Direct at {lv['concurrency']} streams: {d['tokens_per_s']:,.0f} tokens/s = "
                     f"{100 * d['tokens_per_s'] / lv['ideal_tokens_per_s']:.1f} % of the fake's schedule "
                     f"({lv['ideal_tokens_per_s']:,.0f}); generator CPU {d['generator_cpu_pct']} %.")
    if results["levels"]:
        lines += ["", peers_table(results, targets)]
    if results.get("waves"):
        lines += ["", "Synchronized waves (N requests written at once; TTFT from each one's write):", "",
                  waves_table(results, targets)]
    if results["levels"]:
        lines += ["", "Every figure:", "", table(results, targets)]
    lines += ["", *goals(results)]
    return "\n".join(lines)
