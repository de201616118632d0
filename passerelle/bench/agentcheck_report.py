"""``passerelle agentcheck``'s report: the pass matrix (runtime x model x API x stream x repair)
and the failing turns, as ``results.json`` and ``report.md``.

    >>> rows = [{"runtime": "r", "model": "m", "api": "chat", "stream": True, "repair": "off", "client": "c",
    ...          "turn": "c/001-chat", "passed": False, "failures": [["markup", "<tool_call>"]]}]
    >>> summarize(rows)[0]["pass_rate"]
    0.0
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

KEYS = ("runtime", "model", "api", "stream", "repair")
KINDS = ("no_tool_call", "markup", "arguments", "unknown_tool", "ids", "stop_reason", "stream_end", "http",
         "unreadable")


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per cell of the matrix: turns, passes, the pass rate, failures by kind."""
    cells: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault(tuple(row[k] for k in KEYS), []).append(row)
    out = []
    for key, group in cells.items():
        kinds = Counter(k for r in group for k in {f[0] for f in r["failures"]})
        passed = sum(1 for r in group if r["passed"])
        out.append({**dict(zip(KEYS, key, strict=True)), "turns": len(group), "passed": passed,
                    "pass_rate": round(passed / len(group), 4), "failures": dict(sorted(kinds.items()))})
    return out


def matrix_markdown(rows: list[dict[str, Any]]) -> str:
    """The matrix as a markdown table, with the failure kinds counted per cell."""
    lines = ["| runtime | model | API | stream | repair | passed | pass rate | " + " | ".join(KINDS) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(KINDS)]
    for cell in summarize(rows):
        lines.append(f"| {cell['runtime']} | {cell['model']} | {cell['api']} | "
                     f"{'yes' if cell['stream'] else 'no'} | {cell['repair']} | {cell['passed']}/{cell['turns']} | "
                     f"{100 * cell['pass_rate']:.0f} % | "
                     + " | ".join(str(cell["failures"].get(k, 0) or "") for k in KINDS) + " |")
    return "\n".join(lines) + "\n"


def pivot_markdown(rows: list[dict[str, Any]]) -> str:
    """The compact matrix: one line per runtime x model x API, one column per stream x repair,
    each cell ``passed/turns``."""
    columns = sorted({(r["stream"], r["repair"]) for r in rows}, key=lambda c: (c[1], c[0]))
    cells = {tuple(c[k] for k in KEYS): c for c in summarize(rows)}
    lines = ["| runtime | model | API | " + " | ".join(f"{'streamed' if s else 'JSON'}, repair {rep}"
                                                     for s, rep in columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    seen: list[tuple[Any, ...]] = []
    for r in rows:
        if (key := (r["runtime"], r["model"], r["api"])) not in seen:
            seen.append(key)
    for runtime, model, api in seen:
        out = []
        for stream, repair in columns:
            cell = cells.get((runtime, model, api, stream, repair))
            out.append(f"{cell['passed']}/{cell['turns']}" if cell else "")
        lines.append(f"| {runtime} | {model} | {api} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def failures_markdown(rows: list[dict[str, Any]], limit: int = 60) -> str:
    failing = [r for r in rows if not r["passed"]]
    if not failing:
        return "Every turn passed.\n"
    lines = ["| runtime | API | stream | repair | turn | why |", "|---|---|---|---|---|---|"]
    for r in failing[:limit]:
        why = "; ".join(f"{k}: {d}" for k, d in r["failures"]).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['runtime']} | {r['api']} | {'yes' if r['stream'] else 'no'} | {r['repair']} | "
                     f"{r['turn']} | {why[:240]} |")
    if len(failing) > limit:
        lines.append(f"\n({len(failing) - limit} more failing turns in results.json)")
    return "\n".join(lines) + "\n"


def legend() -> str:
    return ("A turn passes when the tool call arrives as the API's own tool call, its arguments fit the "
            "tool's schema, no tool-call markup is left in the text, and the answer ends as the client "
            "expects (chat `tool_calls` and `[DONE]`, Responses `completed` and `response.completed`, "
            "Messages `tool_use` and `message_stop`). Failure columns count the turns failing for that "
            "reason (a turn may fail for several).\n")


def write(out: Path, rows: list[dict[str, Any]], command: str) -> tuple[Path, Path]:
    """``results.json`` and ``report.md`` in ``out`` (made when missing); their paths."""
    out.mkdir(parents=True, exist_ok=True)
    results, report = out / "results.json", out / "report.md"
    results.write_text(json.dumps({"command": command, "summary": summarize(rows), "rows": rows}, indent=1) + "\n")
    report.write_text(f"# agentcheck\n\n`{command}`\n\n{legend()}\n{pivot_markdown(rows)}\n"
                      f"## Per cell, with the reasons\n\n{matrix_markdown(rows)}\n"
                      f"## Failing turns\n\n{failures_markdown(rows)}")
    return results, report


def read_rows(paths: list[Path]) -> list[dict[str, Any]]:
    """The rows of earlier runs' results.json files, to report them as one matrix."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        rows += json.loads(path.read_text())["rows"]
    return rows
