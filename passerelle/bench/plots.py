"""PNG plots of a benchmark (matplotlib, Agg backend, imported only when plotting).

- ``summary.png``: per target, the load held within the SLOs (hatched where no limit was found:
  "≥") next to the memory it took there — the decision at a glance, at the top of the report;
- ``ttft_vs_<load>.png`` and ``tpot_vs_<load>.png``: p50 (solid) and p95 (dashed) per target
  against the load, the SLO thresholds on that metric drawn as red lines;
- ``throughput_vs_<load>.png``: output tokens/s (steady state) per target against the load;
- ``latency_cdf.png``: the distribution of TTFT and of end-to-end latency, one column per target,
  one line per load level, every column on the same axes so that targets compare by eye.

Legends sit outside the plotting area, never over a curve. The load axis is the concurrency, or
the rate for open-loop sweeps, or the traffic class for a scenario.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

SLO_STYLE = {"color": "#c0392b", "linestyle": ":", "linewidth": 1.4}


def load_axis(runs: Sequence[dict[str, Any]]) -> str:
    """``concurrency``, ``rate`` or ``class``: what varies between the runs of a target."""
    if any(r["class"] not in (None, "all") for r in runs):
        return "class"
    rates = {r["rate"] for r in runs}
    if None not in rates and (len(rates) > 1 or all(r["concurrency"] is None for r in runs)):
        return "rate"
    return "concurrency"


def _x(run: dict[str, Any], axis: str) -> Any:
    return run[axis] if axis != "class" else run["class"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_all(results: dict[str, Any], samples: dict[tuple[str, str], dict[str, list[float]]],
             out_dir: Path) -> list[Path]:
    """Write the plots; ``samples[(target, level label)]`` holds per-request ``ttft``/``e2e`` in ms."""
    runs = results["runs"]
    axis = load_axis(runs)
    slos = (results.get("verdict") or {}).get("slo", [])
    return [
        _summary(results, out_dir / "summary.png"),
        _lines(runs, axis, "ttft_ms", "TTFT (ms)", "Time to first token", out_dir / f"ttft_vs_{axis}.png",
               stats=(("p50", "-"), ("p95", "--")), slos=[s for s in slos if s["key"].startswith("ttft_")]),
        _lines(runs, axis, "tpot_ms", "TPOT (ms)", "Time per output token", out_dir / f"tpot_vs_{axis}.png",
               stats=(("p50", "-"), ("p95", "--")), slos=[s for s in slos if s["key"].startswith("tpot_")]),
        _lines(runs, axis, "output_tokens_per_s", "output tokens/s", "Output throughput (steady state)",
               out_dir / f"throughput_vs_{axis}.png"),
        _cdf(samples, slos, out_dir / "latency_cdf.png"),
    ]


def _legend_outside(ax: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
                  fontsize="small", frameon=False)


def _slo_lines(ax: Any, slos: Sequence[dict[str, Any]], vertical: bool = False) -> None:
    for s in slos:
        text = f"SLO {s['key'].replace('_', ' ')} ≤ {s['threshold']:g} ms"
        if vertical:
            ax.axvline(s["threshold"], **SLO_STYLE, label=text)
        else:
            ax.axhline(s["threshold"], **SLO_STYLE, label=text)


def _lines(runs: Sequence[dict[str, Any]], axis: str, key: str, ylabel: str, title: str, path: Path,
           stats: Sequence[tuple[str, str]] = (), slos: Sequence[dict[str, Any]] = ()) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.4, 4.2), dpi=110)
    targets = list(dict.fromkeys(r["target"] for r in runs))
    categories = list(dict.fromkeys(r["class"] for r in runs if r["class"] not in (None, "all")))
    for i, name in enumerate(targets):
        color = f"C{i % 10}"
        mine = [r for r in runs if r["target"] == name and (axis == "class") == (r["class"] not in (None, "all"))]
        if axis != "class":
            mine.sort(key=lambda r: _x(r, axis) or 0)
        xs = [categories.index(r["class"]) if axis == "class" else _x(r, axis) for r in mine]
        if stats:
            for stat, style in stats:
                ys = [r[key][stat] for r in mine]
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{name} {stat}")
        else:
            ax.plot(xs, [r[key] for r in mine], "-", marker="o", color=color, label=name)
    _slo_lines(ax, slos)
    if axis == "class":
        ax.set_xticks(range(len(categories)), categories)
    elif axis == "concurrency":
        ticks = sorted({r["concurrency"] for r in runs if r["concurrency"] is not None})
        if ticks:
            ax.set_xticks(ticks)
    ax.set_xlabel({"class": "traffic class", "rate": "request rate (requests/s)",
                   "concurrency": "concurrent requests"}[axis])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    _legend_outside(ax)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def _cdf(samples: dict[tuple[str, str], dict[str, list[float]]], slos: Sequence[dict[str, Any]], path: Path) -> Path:
    plt = _pyplot()
    targets = list(dict.fromkeys(t for t, _ in samples)) or ["(none)"]
    # the same x-scale in every column of a row: a slow target must look slow next to a fast one
    fig, axes = plt.subplots(2, len(targets), figsize=(3.8 * len(targets) + 2.2, 6.4), dpi=110, squeeze=False,
                             sharex="row", sharey=True)
    levels = list(dict.fromkeys(lvl for _, lvl in samples))
    for col, name in enumerate(targets):
        for row, (metric, label) in enumerate((("ttft", "TTFT (ms)"), ("e2e", "end-to-end latency (ms)"))):
            ax = axes[row][col]
            for lvl in (lv for t, lv in samples if t == name):
                values = sorted(samples[(name, lvl)][metric])
                if values:
                    ys = [(i + 1) / len(values) for i in range(len(values))]
                    ax.step(values, ys, where="post", color=f"C{levels.index(lvl) % 10}", label=lvl)
            _slo_lines(ax, [s for s in slos if s["key"].startswith(metric + "_")], vertical=True)
            ax.set_xlabel(label)
            ax.set_ylim(0, 1.02)
            ax.set_xlim(left=0)
            ax.grid(True, alpha=0.3)
            if col == 0:
                ax.set_ylabel("fraction of requests")
            if row == 0:
                ax.set_title(name)
    # one legend for the figure (load levels and SLO lines), right of the last column
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    fig.suptitle("Latency distribution per target (shared axes)")
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / (3.8 * len(targets) + 2.2), 1))
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="upper left", fontsize="small", frameon=False,
                   bbox_to_anchor=(1 - 1.95 / (3.8 * len(targets) + 2.2), 0.93))
    fig.savefig(path)
    plt.close(fig)
    return path


def _summary(results: dict[str, Any], path: Path) -> Path:
    """Load held (bars, hatched when no limit was found) beside memory there (PSS + GPU)."""
    from passerelle.bench.verdict import load_phrase

    plt = _pyplot()
    v = results.get("verdict") or {}
    names = list(v.get("targets", {}))
    fig, (ax_load, ax_mem) = plt.subplots(1, 2, figsize=(10, 1.2 + 0.75 * max(len(names), 1)), dpi=110,
                                          sharey=True)
    ys = list(range(len(names)))[::-1]
    by_rate = any(t.get("max_rate") is not None for t in v.get("targets", {}).values())
    for y, name in zip(ys, names, strict=True):
        t = v["targets"][name]
        color = f"C{names.index(name) % 10}"
        held = (t.get("max_rate") if by_rate else t.get("max_concurrency")) or 0
        ax_load.barh(y, held, color=color, alpha=0.85, hatch=None if t.get("limit_found") else "//",
                     edgecolor="white")
        run = {"rate": t.get("max_rate"), "concurrency": t.get("max_concurrency")}
        text = ("none" if not held else ("" if t.get("limit_found") else "≥ ") + load_phrase(run)
                + (f", {t['output_tokens_per_s']:.0f} tok/s" if t.get("output_tokens_per_s") else ""))
        ax_load.text(held, y, f"  {text}", va="center", fontsize="small")
        mem = t.get("memory") or {}
        resident = mem.get("pss_peak_bytes") or mem.get("rss_peak_bytes")
        gpu = mem.get("gpu_process_peak_bytes")
        left = 0.0
        if resident:
            ax_mem.barh(y, resident / 2**30, color=color, alpha=0.85)
            left = resident / 2**30
        if gpu:
            ax_mem.barh(y, gpu / 2**30, left=left, color=color, alpha=0.4, hatch="..", edgecolor="white")
        parts = [f"{resident / 2**30:.2f} GiB {'PSS' if mem.get('pss_peak_bytes') else 'RSS'}"] if resident else []
        parts += [f"{gpu / 2**30:.2f} GiB GPU"] if gpu else []
        text = " + ".join(parts) or "not measured"
        if parts and not held:
            text += f" (at {t.get('memory_at')}, not held)"
        ax_mem.text(left + (gpu or 0) / 2**30, y, "  " + text, va="center", fontsize="small")
    ax_load.set_yticks(ys, [n + (" ★" if n == v.get("winner") else "") for n in names])
    ax_load.set_xlabel("request rate held (requests/s)" if by_rate else "concurrent requests held")
    ax_load.set_title("Load held within the SLOs (hatched: no limit found)", fontsize="medium")
    ax_mem.set_xlabel("memory at that load (GiB)")
    ax_mem.set_title("Runtime memory there (peak)", fontsize="medium")
    for ax in (ax_load, ax_mem):
        ax.set_xlim(left=0, right=max(ax.get_xlim()[1], 1e-9) * 1.6)  # room for the labels
        ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
