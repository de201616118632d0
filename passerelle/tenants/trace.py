"""Exporting the gateway's recorded load as a trace for ``passerelle bench --trace``.

The format (one JSON object per line: ``t`` seconds from the start, ``prompt_tokens``,
``output_tokens``, and optional ``priority``, ``tenant``, ``model``) is read by
``passerelle/bench/trace.py``; the two agree on it, neither imports the other (the benchmark is a
client of the gateway, not a part of it).

Example::

    $ passerelle usage --since 7d --export-trace week.jsonl
    passerelle: wrote 1,204 requests from the usage store ... to week.jsonl
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def write_trace(rows: Iterable[dict[str, Any]], out: TextIO) -> int:
    """Write rows with an absolute ``arrival`` (epoch seconds) as a trace; returns the count."""
    rows = sorted(rows, key=lambda r: r["arrival"])
    if not rows:
        return 0
    t0 = rows[0]["arrival"]
    for r in rows:
        line = {"t": round(r["arrival"] - t0, 3), "prompt_tokens": r["prompt_tokens"],
                "output_tokens": r["output_tokens"]}
        line.update({k: r[k] for k in ("priority", "tenant", "model") if r.get(k)})
        out.write(json.dumps(line) + "\n")
    return len(rows)


def usage_rows(conn: Any, since: float = 0.0) -> Iterator[dict[str, Any]]:
    """Successful requests of the gateway's usage store (SQLite), as trace rows.

    The store keeps the time a request ended, not when it arrived: arrivals come out late by
    each request's own duration.
    """
    cur = conn.execute("SELECT ts, tenant, class, model, prompt_tokens, completion_tokens FROM usage "
                       "WHERE ts >= ? AND cause = 'ok' AND prompt_tokens > 0 AND completion_tokens > 0 "
                       "ORDER BY ts", (since,))
    for ts, tenant, cls, model, prompt, completion in cur:
        yield {"arrival": ts, "prompt_tokens": prompt, "output_tokens": completion, "priority": cls,
               "tenant": tenant, "model": model}


_GENERATING = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "chat",
               "completions", "responses", "messages"}


def access_log_rows(lines: Iterable[str], since: float = 0.0) -> Iterator[dict[str, Any]]:
    """Successful generation requests of access-log JSON lines (anything before the ``{`` of a
    line, such as a journald prefix, is skipped); arrival = ``ts`` − ``duration_ms``."""
    for line in lines:
        start = line.find("{")
        if start < 0:
            continue
        try:
            obj = json.loads(line[start:])
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("cause") != "ok":
            continue
        endpoint = str(obj.get("endpoint", ""))
        if endpoint not in _GENERATING and not endpoint.endswith(("/completions", "/responses", "/messages")):
            continue
        prompt, output = _int(obj.get("prompt_tokens")), _int(obj.get("completion_tokens"))
        ts, duration = obj.get("ts"), obj.get("duration_ms")
        if not prompt or not output or not isinstance(ts, int | float) or not isinstance(duration, int | float):
            continue
        arrival = ts - duration / 1000.0
        if arrival >= since:
            yield {"arrival": arrival, "prompt_tokens": prompt, "output_tokens": output,
                   "priority": obj.get("priority"), "tenant": obj.get("tenant"), "model": obj.get("model")}


def export_trace(rows: Iterable[dict[str, Any]], out: Path, source: str) -> int:
    """Write ``rows`` to ``out`` (``-``: stdout) as a trace, saying how many and from where."""
    import sys

    if str(out) == "-":
        n = write_trace(rows, sys.stdout)
    else:
        with out.open("w") as fh:
            n = write_trace(rows, fh)
    print(f"{n} requests from {source} written to {out}", file=sys.stderr)
    return 0
