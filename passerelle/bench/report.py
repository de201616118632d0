"""The output directory: ``results.json``, ``results.csv``, ``requests.csv``, ``report.md``,
``report.html`` (self-contained, plots inlined) and the PNG plots.

``report.md`` and ``report.html`` are rendered from ``results.json``'s own data with the same
table builder, so the three always agree.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from passerelle.bench.stats import STATS

RESULTS_JSON = "results.json"
COLUMNS = (
    ("concurrency", "conc."), ("rate", "rate/s"), ("requests_ok", "ok"), ("errors", "errors"),
    ("ttft_ms.p50", "TTFT p50"), ("ttft_ms.p95", "TTFT p95"), ("tpot_ms.p50", "TPOT p50"),
    ("tpot_ms.p95", "TPOT p95"), ("itl_ms.p50", "ITL p50"), ("itl_ms.p95", "ITL p95"),
    ("e2e_ms.p50", "E2E p50"), ("e2e_ms.p95", "E2E p95"), ("output_tokens_per_s", "out tok/s"),
    ("requests_per_s", "req/s"), ("goodput_rps", "goodput req/s"), ("meets_slo", "SLO"),
)
DEFINITIONS = (
    "TTFT: request sent → first chunk with content (the generator's own wait for a free "
    "concurrency slot is never counted). TPOT: (e2e − TTFT) / (output tokens − 1), per request. "
    "ITL: gaps between content chunks, all requests pooled. E2E: request sent → end of stream. "
    "Latencies in ms; percentiles interpolated. Throughput: successful requests' output tokens over "
    "the run's wall time (first send → last answer). Goodput: requests meeting every SLO on their own, "
    "per second."
)


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


# --- formatting shared by markdown, html and the tests -------------------------------------
def cell(run: dict[str, Any], key: str) -> str:
    value: Any = run
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key in ("requests_per_s", "goodput_rps"):
        return f"{value:.2f}"
    if key == "rate":
        return f"{value:g}"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def run_table(runs: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    show_class = any(r["class"] is not None for r in runs)
    cols = ([("class", "class")] if show_class else []) + list(COLUMNS)
    if all(r["rate"] is None for r in runs):
        cols = [c for c in cols if c[0] != "rate"]
    return [h for _, h in cols], [[cell(r, k) for k, _ in cols] for r in runs]


def notes(results: dict[str, Any]) -> list[str]:
    out = list(results.get("notes", []))
    out += _retry_notes(results)
    v = results.get("verdict") or {}
    if v.get("model_ids_differ"):
        models = ", ".join(f"{t} → {m}" for t, m in v["models"].items())
        out.append(f"**Model ids differ between targets** ({models}): different models or "
                   "quantizations; the comparison is not like for like.")
    for run in results["runs"]:
        where = f"{run['target']} {_load(run)}"
        src = run["token_count_source"]
        if src in ("chunks", "mixed"):
            out.append(f"{where}: token counts from content chunks for {'some' if src == 'mixed' else 'all'} "
                       "requests (the server sent no usage).")
        tpc = run.get("tokens_per_chunk")
        if tpc and tpc > 1.05:
            out.append(f"{where}: the server packs {tpc:.2f} tokens per chunk on average; ITL measures "
                       "gaps between chunks, not between tokens.")
        gen = run.get("generator") or {}
        if (gen.get("loop_lag_ms_p99") or 0) > 5:
            out.append(f"{where}: the generator's event loop ran late (p99 {gen['loop_lag_ms_p99']:.1f} ms): the "
                       "machine was busy or the generator saturated (then try --processes); latencies may "
                       "include that much generator time.")
        if (gen.get("send_lag_ms_p99") or 0) > 5:
            out.append(f"{where}: arrivals were sent late (p99 {gen['send_lag_ms_p99']:.1f} ms); the "
                       "generator could not hold the rate.")
        for kind, n in run.get("errors_by_kind", {}).items():
            sample = run.get("error_samples", {}).get(kind, "")
            out.append(f"{where}: {n} × {kind}" + (f" — {sample}" if sample else ""))
    return out


def _retry_notes(results: dict[str, Any]) -> list[str]:
    totals: dict[str, int] = {}
    for run in results["runs"]:
        if run["class"] in (None, "all"):
            totals[run["target"]] = totals.get(run["target"], 0) + (run.get("retried_on_closed_connection") or 0)
    return [f"{name}: the server closed keep-alive connections right after answers (llama-server does); "
            f"{n} requests written on such a connection were sent again on a new one, their clocks starting "
            "at the second send." for name, n in totals.items() if n]


def _load(run: dict[str, Any]) -> str:
    parts = [f"class {run['class']}"] if run["class"] else []
    if run["rate"] is not None:
        parts.append(f"rate {run['rate']:g}/s")
    if run["concurrency"] is not None:
        parts.append(f"c={run['concurrency']}")
    return ", ".join(parts)


def _machine(m: dict[str, Any]) -> str:
    text = (f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB memory, {m['os']}, Python {m['python']}.")
    if m.get("load_average_start") is not None:
        text += (f" Load average (1 min) {m['load_average_start']:g} at the start, "
                 f"{m.get('load_average_end', 0):g} at the end.")
    return text


def _version(t: dict[str, Any]) -> str:
    v = t.get("version") or {}
    keys = ("build_info", "version", "owned_by", "total_slots", "n_ctx")
    return "; ".join(f"{k}: {v[k]}" for k in keys if k in v) or "not reported"


def _verdict_rows(v: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    head = ["target", "highest load within SLOs", "out tok/s there", "req/s there", "goodput req/s"]
    rows = []
    for name, t in v["targets"].items():
        load = (f"rate {t['max_rate']:g}/s" if t["max_rate"] is not None else
                f"concurrency {t['max_concurrency']}" if t["max_concurrency"] is not None else "none")
        rows.append([name + (" (winner)" if name == v["winner"] else ""), load,
                     cell(t, "output_tokens_per_s"), cell(t, "requests_per_s"), cell(t, "goodput_rps")])
    return head, rows


def _workload_lines(results: dict[str, Any]) -> list[str]:
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
    if load.get("rate"):
        lines.append(f"open loop at {', '.join(f'{r:g}' for r in load['rate'])} requests/s "
                     f"({'Poisson' if load.get('poisson') else 'constant'} arrivals)"
                     + (f", at most {', '.join(map(str, load['concurrency']))} in flight"
                        if load.get("concurrency") else ""))
    elif load.get("concurrency"):
        lines.append(f"closed loop at concurrency {', '.join(map(str, load['concurrency']))}")
    size = (f"{load['duration']:g} s per level" if load.get("duration") else
            f"{load['requests']} requests per level" if load.get("requests") else "")
    warm, procs = load.get("warmup", 0), load.get("processes", 1)
    lines.append(f"{size}; {warm} warm-up request{'s' if warm != 1 else ''} per level (not counted); "
                 f"{procs} generator process{'es' if procs != 1 else ''}")
    return lines


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
            "output_tokens", "prompt_tokens_mean", "tokens_per_chunk", "meets_slo", "errors_by_kind"]


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
            writer.writerow(row)
    return path


def write_requests_csv(rows: Sequence[dict[str, Any]], out_dir: Path) -> Path:
    """Every request's own measurement, for plots and further analysis."""
    path = out_dir / "requests.csv"
    cols = ["target", "class", "concurrency", "rate", "ok", "error", "t_send_s", "ttft_ms", "tpot_ms",
            "e2e_ms", "output_tokens", "prompt_tokens", "chunks"]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=cols)
        writer.writeheader()
        writer.writerows(rows)
    return path


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def render_markdown(results: dict[str, Any], plots: Sequence[Path]) -> str:
    m, v = results["machine"], results["verdict"]
    lines = ["# passerelle bench report", "",
             f"Measured {results['created']} with passerelle {results['passerelle_version']}: "
             f"`{results['command']}`", "", "## Verdict", "", v["reason"] + ".", ""]
    lines += _md_table(*_verdict_rows(v))
    lines += ["", "## Machine", "", f"Load generator: {_machine(m)}", "", "## Targets", ""]
    lines += _md_table(["target", "url", "model", "version"],
                       [[t["name"], t["url"], str(t["model"]), _version(t)] for t in results["targets"]])
    lines += ["", "## Workload", "", *(f"- {x}" for x in _workload_lines(results)), "", "## Results", ""]
    for name in dict.fromkeys(r["target"] for r in results["runs"]):
        lines += [f"### {name}", ""]
        lines += _md_table(*run_table([r for r in results["runs"] if r["target"] == name]))
        lines.append("")
    lines += ["Latencies in ms. " + DEFINITIONS, ""]
    all_notes = notes(results)
    if all_notes:
        lines += ["## Notes", "", *(f"- {n}" for n in all_notes), ""]
    if plots:
        lines += ["## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots), ""]
    return "\n".join(lines)


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em}td,th{border:1px solid #ccc;padding:.25em .5em;
text-align:right}th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
img{max-width:100%;display:block;margin:1em 0}code{background:#f3f3f3;padding:0 .2em}.verdict{font-size:1.1em}"""


def _html_table(head: list[str], rows: list[list[str]]) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def _md_inline(text: str) -> str:
    """The little markdown our notes use (**bold**, `code`) as HTML."""
    import re

    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def render_html(results: dict[str, Any], plots: Sequence[Path]) -> str:
    m, v = results["machine"], results["verdict"]
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>passerelle bench report</title>"
             f"<style>{_CSS}</style></head><body><h1>passerelle bench report</h1>",
             f"<p>Measured {e(results['created'])} with passerelle {e(results['passerelle_version'])}: "
             f"<code>{e(results['command'])}</code></p>",
             f"<h2>Verdict</h2><p class='verdict'>{e(v['reason'])}.</p>", _html_table(*_verdict_rows(v)),
             f"<h2>Machine</h2><p>Load generator: {e(_machine(m))}</p><h2>Targets</h2>",
             _html_table(["target", "url", "model", "version"],
                         [[t["name"], t["url"], str(t["model"]), _version(t)] for t in results["targets"]]),
             "<h2>Workload</h2><ul>" + "".join(f"<li>{_md_inline(x)}</li>" for x in _workload_lines(results))
             + "</ul><h2>Results</h2>"]
    for name in dict.fromkeys(r["target"] for r in results["runs"]):
        parts.append(f"<h3>{e(name)}</h3>")
        parts.append(_html_table(*run_table([r for r in results["runs"] if r["target"] == name])))
    parts.append(f"<p>Latencies in ms. {e(DEFINITIONS)}</p>")
    all_notes = notes(results)
    if all_notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{_md_inline(n)}</li>" for n in all_notes) + "</ul>")
    if plots:
        parts.append("<h2>Plots</h2>")
        for p in plots:
            data = base64.b64encode(p.read_bytes()).decode("ascii")
            parts.append(f"<img alt='{e(p.stem)}' src='data:image/png;base64,{data}'>")
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
