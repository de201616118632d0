"""What ``bench flavours`` writes: the side-by-side table, the verdict sentence, the picture.

``rows`` turns one prompt depth's run records into one row per flavour; ``sentence`` says which
flavour to keep; ``write`` leaves ``backends.json``, ``backends.md`` and ``backends.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GIB = 1024**3


def _top(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run at the highest load (the most clients) of a flavour."""
    mine = [r for r in runs if r["class"] in (None, "all")]
    return max(mine, key=lambda r: (r["concurrency"] or 0, r["rate"] or 0.0), default=None)


def _gpu_peak(memory: dict[str, Any]) -> int | None:
    values = [v for k, v in memory.items() if k.startswith("gpu_") and k.endswith("_peak_bytes") and v is not None]
    return max(values) if values else None


def rows(runs: list[dict[str, Any]], targets: list[dict[str, Any]], flavours: dict[str, dict[str, Any]],
         depth: int) -> list[dict[str, Any]]:
    """One row per flavour at ``depth``: latency and throughput at the top load, memory, energy, failures."""
    out = []
    described = {t["name"]: t for t in targets}
    for name, entry in flavours.items():
        mine = [r for r in runs if r["target"] == name]
        top = _top(mine)
        rest = ((described.get(name) or {}).get("memory") or {}).get("at_rest") or {}
        memories = [r.get("memory") or {} for r in mine]
        rss_peaks = [m["rss_peak_bytes"] for m in memories if m.get("rss_peak_bytes") is not None]
        gpu_peaks = [p for m in memories if (p := _gpu_peak(m)) is not None]
        tokens = (entry.get("output_tokens") or {}).get(str(depth)) or 0
        joules = (entry.get("energy_j") or {}).get(str(depth))
        requests = sum(r["requests"] for r in mine if r["class"] in (None, "all"))
        errors = sum(r["errors"] for r in mine if r["class"] in (None, "all"))
        out.append({
            "flavour": name, "prompt_tokens": depth,
            "clients": top["concurrency"] if top else None,
            "ttft_p95_ms": top["ttft_ms"]["p95"] if top else None,
            "output_tokens_per_s": top["output_tokens_per_s"] if top else None,
            "requests": requests, "errors": errors,
            "rss_at_rest_bytes": rest.get("rss_bytes"),
            "rss_peak_bytes": max(rss_peaks) if rss_peaks else None,
            "gpu_peak_bytes": max(gpu_peaks) if gpu_peaks else None,
            "energy_j_per_token": round(joules / tokens, 4) if joules is not None and tokens else None,
            "crashed": entry.get("crashed"),
            "not_measured": entry.get("not_measured") or (entry.get("failed_at") or {}).get(str(depth)),
        })
    return out


def answers_match(flavours: dict[str, dict[str, Any]]) -> bool | None:
    """Whether every flavour that answered gave the same greedy answer (None: fewer than two answered)."""
    answers = [f["greedy_answer"] for f in flavours.values() if f.get("greedy_answer") is not None]
    return None if len(answers) < 2 else len(set(answers)) == 1


def sentence(doc: dict[str, Any]) -> str:
    """The verdict in one sentence: the compare verdict per depth, then failures and answers."""
    parts = []
    for d in doc["depths"]:
        v = d["verdict"]
        prefix = f"at {d['prompt_tokens']}-token prompts, " if len(doc["depths"]) > 1 else ""
        parts.append(prefix + v["reason"])
    failed = [f"{n} {'crashed (exit ' + str(f['crashed']) + ')' if f['crashed'] is not None else 'was not measured'}"
              for n, f in doc["flavours"].items() if f["crashed"] is not None or f["not_measured"]]
    failed += [f"{n} failed at {', '.join(f['failed_at'])}-token prompts" for n, f in doc["flavours"].items()
               if f.get("failed_at") and f["crashed"] is None and not f["not_measured"]]
    if failed:
        parts.append(", ".join(failed))
    match = doc.get("answers_match")
    if match is not None:
        if match:
            parts.append("greedy answers match across flavours")
        else:
            said = ", ".join(f"{n}: {f['greedy_answer'][:40]!r}" for n, f in doc["flavours"].items()
                             if f.get("greedy_answer") is not None)
            parts.append(f"greedy answers differ between flavours ({said}): check which is right before choosing")
    text = "; ".join(parts) or "nothing was measured"
    if text.startswith(("at ", "no ", "nothing ")):  # a flavour's name keeps its case
        text = text[0].upper() + text[1:]
    return text + "."


def _gib(v: int | None) -> str:
    return "-" if v is None else f"{v / GIB:.2f}"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(doc: dict[str, Any]) -> str:
    """The side-by-side table (markdown)."""
    energy = "energy J/token" if doc.get("energy_sources") else "energy J/token (not available)"
    lines = [f"| flavour | prompt | clients | TTFT p95 ms | tokens/s | errors | RSS at rest GiB | RSS peak GiB "
             f"| GPU peak GiB | {energy} | crashed | greedy answer |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for d in doc["depths"]:
        for r in d["rows"]:
            f = doc["flavours"][r["flavour"]]
            answer = (f.get("greedy_answer") or "-").replace("|", "\\|").replace("\n", " ")[:60]
            crashed = "not measured" if r["not_measured"] else (
                "no" if r["crashed"] is None else f"exit {r['crashed']}")
            lines.append(f"| {r['flavour']} | {r['prompt_tokens']} | {r['clients'] or '-'} "
                         f"| {_num(r['ttft_p95_ms'], '.0f')} | {_num(r['output_tokens_per_s'], '.2f')} "
                         f"| {r['errors']}/{r['requests']} | {_gib(r['rss_at_rest_bytes'])} "
                         f"| {_gib(r['rss_peak_bytes'])} "
                         f"| {_gib(r['gpu_peak_bytes'])} | {_num(r['energy_j_per_token'], '.3f')} | {crashed} "
                         f"| {answer} |")
    return "\n".join(lines)


def environment_table(doc: dict[str, Any]) -> str:
    lines = ["| flavour | CMake flags | runtime version | driver | kernel |", "| --- | --- | --- | --- | --- |"]
    for name, f in doc["flavours"].items():
        e = f["environment"]
        flags = e["cmake_flags"]
        flags = " ".join(flags) if isinstance(flags, list) else (flags or "-")
        lines.append(f"| {name} | `{flags}` | {e['runtime_version'] or '-'} | {e['driver']} | {e['kernel']} |")
    return "\n".join(lines)


def markdown(doc: dict[str, Any], png: Path | None) -> str:
    energy = ", ".join(doc["energy_sources"]) if doc.get("energy_sources") else (
        "not available (no RAPL powercap, amdgpu power1_average or nvidia-smi on this machine)")
    out = ["# llama-server flavours compared", "", f"**Verdict:** {doc['verdict']}", "",
           f"Model: `{doc['model_file']}` (sha256 `{doc['model_sha256']}`); {doc['slots']} slots × "
           f"{doc['ctx_per_slot']} tokens of context on every flavour. Energy: {energy}.", "",
           table(doc), "", "## Environment", "", environment_table(doc), ""]
    if png is not None:
        out += [f"![flavours]({png.name})", ""]
    for d in doc["depths"]:
        out.append(f"Full report at {d['prompt_tokens']}-token prompts: `{d['report']}/report.md`.")
    return "\n".join(out) + "\n"


def plot(doc: dict[str, Any], path: Path) -> Path | None:
    """TTFT p95 and tokens/s per flavour, one group per prompt depth."""
    measured = [r for d in doc["depths"] for r in d["rows"] if r["output_tokens_per_s"] is not None]
    if not measured:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["flavours"])
    depths = [d["prompt_tokens"] for d in doc["depths"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        ttft, tps = [], []
        for d in doc["depths"]:
            row: dict[str, Any] = next((r for r in d["rows"] if r["flavour"] == name), {})
            ttft.append(row.get("ttft_p95_ms") or 0)
            tps.append(row.get("output_tokens_per_s") or 0)
        xs = [j + i * width for j in range(len(depths))]
        axes[0].bar(xs, ttft, width, label=name)
        axes[1].bar(xs, tps, width, label=name)
    clients = max((r["clients"] or 0 for r in measured), default=0)
    for ax, title in ((axes[0], f"TTFT p95 (ms) at {clients} clients"), (axes[1], "output tokens/s")):
        ax.set_title(title)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(depths))],
                      [f"{d} prompt tokens" for d in depths])
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / "backends.json"
    data.write_text(json.dumps(doc, indent=2, default=str))
    png = plot(doc, out_dir / "backends.png")
    md = out_dir / "backends.md"
    md.write_text(markdown(doc, png))
    return [data, md] + ([png] if png else [])
