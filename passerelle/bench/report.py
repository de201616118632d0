"""The output directory: ``results.json``, ``results.csv``, ``requests.csv``, ``report.md``,
``report.html`` (self-contained, plots inlined) and the PNG plots.

``report.md`` and ``report.html`` are two renderings of one document (:func:`document`: headings,
paragraphs, tables from ``tables``, lists, images) built from ``results.json``'s own data, so the
three always agree. The summary figure (load held against memory, per target) opens the report.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import os
import platform
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from passerelle.bench.stats import STATS
from passerelle.bench.tables import (
    DEFINITIONS,
    cache_rows,
    memory_lines,
    memory_rows,
    notes,
    prompt_lines,
    run_table,
    verdict_rows,
    workload_lines,
)

RESULTS_JSON = "results.json"
SUMMARY_PNG = "summary.png"
Block = tuple[Any, ...]  # ("h1"|"h2"|"h3"|"p", text) | ("table", head, rows) | ("ul", items) | ("img", path)


def machine_info() -> dict[str, Any]:
    """The load generator's machine (the report says where the numbers were measured)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
                break
    except (OSError, ValueError):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory_gib, "os": platform.platform(),
            "python": platform.python_version()}


# --- writers -------------------------------------------------------------------------------
def write_json(results: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / RESULTS_JSON
    path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    return path


def csv_columns() -> list[str]:
    cols = ["target", "class", "concurrency", "rate", "requests", "requests_ok", "errors"]
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        cols += [f"{metric}_{s}" for s in STATS]
    return [*cols, "output_tokens_per_s", "requests_per_s", "goodput_rps", "token_count_source",
            "output_tokens", "prompt_tokens_mean", "tokens_per_chunk", "meets_slo", "errors_by_kind",
            "throughput_over", "steady_s", "cached_fraction", "served_from_cache", *_MEMORY_CSV]


_MEMORY_CSV = ("rss_peak_bytes", "pss_peak_bytes", "gpu_process_peak_bytes", "gpu_device_used_peak_bytes",
               "kv_cache_usage_peak")


def write_csv(results: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / "results.csv"
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=csv_columns())
        writer.writeheader()
        for run in results["runs"]:
            row = {k: run.get(k) for k in csv_columns() if k in run}
            for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                for s in STATS:
                    row[f"{metric}_{s}"] = run[metric][s]
            row["errors_by_kind"] = ";".join(f"{k}={v}" for k, v in run["errors_by_kind"].items())
            row["steady_s"] = (run.get("steady_state") or {}).get("duration_s")
            cache = run.get("cache") or {}
            row["cached_fraction"] = cache.get("cached_fraction")
            row["served_from_cache"] = cache.get("served_from_cache")
            row.update({k: (run.get("memory") or {}).get(k) for k in _MEMORY_CSV})
            writer.writerow(row)
    return path


def write_requests_csv(rows: Sequence[dict[str, Any]], out_dir: Path) -> Path:
    """Every request's own measurement, for plots and further analysis."""
    path = out_dir / "requests.csv"
    cols = ["target", "class", "concurrency", "rate", "ok", "error", "t_send_s", "ttft_ms", "tpot_ms",
            "e2e_ms", "output_tokens", "prompt_tokens", "cached_tokens", "chunks"]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=cols)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _machine(m: dict[str, Any]) -> str:
    text = (f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB memory, {m['os']}, Python {m['python']}.")
    if m.get("load_average_start") is not None:
        text += (f" Load average (1 min) {m['load_average_start']:g} at the start, "
                 f"{m.get('load_average_end', 0):g} at the end.")
    return text


def _version(t: dict[str, Any]) -> str:
    v = t.get("version") or {}
    parts = [f"passerelle {v['passerelle']}"] if "passerelle" in v else []
    parts += [f"{k}: {v[k]}" for k in ("build_info", "version", "total_slots", "n_ctx") if k in v]
    if parts:
        return "; ".join(parts)
    # who owns the models says what kind of server it may be, not which version it runs
    return f"not reported (models owned by {v['owned_by']})" if "owned_by" in v else "not reported"


def document(results: dict[str, Any], plots: Sequence[Path]) -> list[Block]:
    """The report as blocks, in order."""
    v, runs = results["verdict"], results["runs"]
    whole = [r for r in runs if r["class"] in (None, "all")]
    blocks: list[Block] = [("h1", "passerelle bench report"),
                           ("p", f"Measured {results['created']} with passerelle {results['passerelle_version']}: "
                                 f"`{results['command']}`")]
    summary = [p for p in plots if p.name == SUMMARY_PNG]
    blocks += [("img", p) for p in summary]
    blocks += [("h2", "Verdict"), ("p", v["reason"] + "."), ("table", *verdict_rows(v))]
    blocks += [("h2", "Cache check"), ("ul", prompt_lines(results)), ("table", *cache_rows(whole))]
    warned = [r for r in runs if r.get("cache_warning")]
    blocks.append(("p", f"**{len(warned)} run{'s' if len(warned) != 1 else ''} served from cache**: see the notes; "
                        "their TTFT is not the runtime's prompt processing." if warned else
                        "No run was served from the runtime's prompt cache beyond what the workload shares on "
                        "purpose (or the runtime does not say; the source column tells which)."))
    blocks.append(("h2", "Memory"))
    for t in results["targets"]:
        blocks += [("h3", t["name"]), ("ul", memory_lines(t))]
    head, rows = memory_rows(whole)
    if len(head) > 2:
        blocks += [("p", "Peaks over each level's measured load (the runtime's whole process tree; PSS shares "
                         "pages between processes, RSS counts them in each):"), ("table", head, rows)]
    blocks += [("h2", "Machine"), ("p", f"Load generator: {_machine(results['machine'])}"), ("h2", "Targets"),
               ("table", ["target", "url", "model", "version"],
                [[t["name"], t["url"], str(t.get("model")), _version(t)] for t in results["targets"]]),
               ("h2", "Workload"), ("ul", workload_lines(results)), ("h2", "Results")]
    for name in dict.fromkeys(r["target"] for r in runs):
        blocks += [("h3", name), ("table", *run_table([r for r in runs if r["target"] == name]))]
    blocks.append(("p", "Latencies in ms. " + DEFINITIONS))
    all_notes = notes(results)
    if all_notes:
        blocks += [("h2", "Notes"), ("ul", all_notes)]
    rest = [p for p in plots if p.name != SUMMARY_PNG]
    if rest:
        blocks += [("h2", "Plots"), *(("img", p) for p in rest)]
    return blocks


def render_markdown(results: dict[str, Any], plots: Sequence[Path]) -> str:
    lines: list[str] = []
    for block in document(results, plots):
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + block[1], ""]
        elif kind == "p":
            lines += [block[1], ""]
        elif kind == "ul":
            lines += [*(f"- {x}" for x in block[1]), ""]
        elif kind == "table":
            head, rows = block[1], block[2]
            lines += ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|",
                      *("| " + " | ".join(r) + " |" for r in rows), ""]
        elif kind == "img":
            lines += [f"![{block[1].stem}]({block[1].name})", ""]
    return "\n".join(lines)


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em}td,th{border:1px solid #ccc;padding:.25em .5em;
text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
img{max-width:100%;display:block;margin:1em 0}code{background:#f3f3f3;padding:0 .2em}"""


def _md_inline(text: str) -> str:
    """The little markdown our sentences use (**bold**, `code`) as HTML."""
    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def render_html(results: dict[str, Any], plots: Sequence[Path]) -> str:
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>passerelle bench report</title>"
             f"<style>{_CSS}</style></head><body>"]
    for block in document(results, plots):
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{e(block[1])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{_md_inline(block[1])}</p>")
        elif kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{_md_inline(x)}</li>" for x in block[1]) + "</ul>")
        elif kind == "table":
            h = "".join(f"<th>{e(c)}</th>" for c in block[1])
            body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in block[2])
            parts.append(f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "img":
            data = base64.b64encode(block[1].read_bytes()).decode("ascii")
            parts.append(f"<img alt='{e(block[1].stem)}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_all(results: dict[str, Any], samples: dict[tuple[str, str], dict[str, list[float]]],
              request_rows: Sequence[dict[str, Any]], out_dir: Path, *, plots: bool = True) -> list[Path]:
    """Write every output file into ``out_dir`` (created); returns their paths."""
    from passerelle.bench.plots import plot_all

    out_dir.mkdir(parents=True, exist_ok=True)
    written = [write_json(results, out_dir), write_csv(results, out_dir), write_requests_csv(request_rows, out_dir)]
    pngs = plot_all(results, samples, out_dir) if plots else []
    md = out_dir / "report.md"
    md.write_text(render_markdown(results, pngs))
    page = out_dir / "report.html"
    page.write_text(render_html(results, pngs))
    return [*written, *pngs, md, page]
