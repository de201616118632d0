"""PNG plots of a benchmark (matplotlib, Agg backend, imported only when plotting).

- ``ttft_vs_<load>.png``: TTFT p50 (solid) and p95 (dashed) per target against the load;
- ``throughput_vs_<load>.png``: output tokens/s per target against the load;
- ``latency_cdf.png``: the distribution of TTFT and of end-to-end latency, one column per target,
  one line per load level.

The load axis is the concurrency, or the rate for open-loop sweeps, or the traffic class for a
scenario.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


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
    paths = [
        _lines(runs, axis, "ttft_ms", "TTFT (ms)", "Time to first token", out_dir / f"ttft_vs_{axis}.png",
               stats=(("p50", "-"), ("p95", "--"))),
        _lines(runs, axis, "output_tokens_per_s", "output tokens/s", "Output throughput",
               out_dir / f"throughput_vs_{axis}.png"),
        _cdf(results, samples, out_dir / "latency_cdf.png"),
    ]
    return paths


def _lines(runs: Sequence[dict[str, Any]], axis: str, key: str, ylabel: str, title: str, path: Path,
           stats: Sequence[tuple[str, str]] = ()) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
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
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _cdf(results: dict[str, Any], samples: dict[tuple[str, str], dict[str, list[float]]], path: Path) -> Path:
    plt = _pyplot()
    targets = list(dict.fromkeys(t for t, _ in samples)) or ["(none)"]
    fig, axes = plt.subplots(2, len(targets), figsize=(4.2 * len(targets) + 1, 6.4), dpi=110, squeeze=False)
    for col, name in enumerate(targets):
        levels = [lvl for t, lvl in samples if t == name]
        for row, (metric, label) in enumerate((("ttft", "TTFT (ms)"), ("e2e", "end-to-end latency (ms)"))):
            ax = axes[row][col]
            for k, lvl in enumerate(levels):
                values = sorted(samples[(name, lvl)][metric])
                if not values:
                    continue
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", color=f"C{k % 10}", label=lvl)
            ax.set_xlabel(label)
            ax.set_ylim(0, 1.02)
            ax.set_xlim(left=0)
            ax.grid(True, alpha=0.3)
            if col == 0:
                ax.set_ylabel("fraction of requests")
            if row == 0:
                ax.set_title(name)
                if levels:
                    ax.legend(fontsize="x-small")
    fig.suptitle("Latency distribution per target")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
