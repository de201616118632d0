"""Recorded load shapes: a JSONL trace of arrival times and lengths, read for replay or exported.

One request per line, ``t`` in seconds from the trace's start (the arrival), the prompt length in
tokens and the output length in tokens; other fields are kept for the reader and ignored::

    {"t": 0.0, "prompt_tokens": 812, "output_tokens": 140, "priority": "interactive", "tenant": "alice"}
    {"t": 0.42, "prompt_tokens": 95, "output_tokens": 512}

A replay (``passerelle bench --trace FILE``, or ``trace = "FILE"`` in a scenario class) sends
request *i* at ``t_i / speed`` after the start, whatever the answers do (an open loop), with a
synthetic prompt of that many tokens and ``max_tokens`` = its output length: the runtime sees last
week's load shape and length mix, never its text (passerelle does not keep prompts).

``passerelle usage --export-trace FILE`` writes one from the gateway's usage store (the usage
table keeps each request's end time, so its arrivals are approximate: each is shifted by that
request's own duration) or, with ``--access-log FILE``, from access-log lines, whose ``ts`` and
``duration_ms`` give the exact arrival.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO


class TraceError(ValueError):
    pass


@dataclass(frozen=True)
class TraceEntry:
    t: float  # arrival, seconds from the trace's start
    prompt_tokens: int
    output_tokens: int


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_trace(path: str | Path) -> tuple[TraceEntry, ...]:
    """Read a trace; errors name the file and the line. Entries come back sorted by arrival,
    shifted so the first arrives at 0."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    entries = []
    for no, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise TraceError(f"{path}:{no}: not JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{no}: expected a JSON object per line")
        t = obj.get("t")
        if not isinstance(t, int | float) or isinstance(t, bool) or t < 0:
            raise TraceError(f"{path}:{no}: 't' must be a number of seconds >= 0")
        prompt, output = _int(obj.get("prompt_tokens")), _int(obj.get("output_tokens"))
        if prompt is None or prompt < 1:
            raise TraceError(f"{path}:{no}: 'prompt_tokens' must be an integer >= 1")
        if output is None or output < 1:
            raise TraceError(f"{path}:{no}: 'output_tokens' must be an integer >= 1")
        entries.append(TraceEntry(float(t), prompt, output))
    if not entries:
        raise TraceError(f"{path}: no request in the trace")
    entries.sort(key=lambda e: e.t)
    t0 = entries[0].t
    return tuple(TraceEntry(round(e.t - t0, 6), e.prompt_tokens, e.output_tokens) for e in entries)


def describe(entries: tuple[TraceEntry, ...], speed: float = 1.0) -> dict[str, Any]:
    """Size, span and mean lengths, for the report."""
    span = entries[-1].t / speed if entries else 0.0
    n = len(entries)
    return {"requests": n, "span_s": round(span, 3), "speed": speed,
            "mean_rate": round((n - 1) / span, 4) if span > 0 else None,
            "prompt_tokens_mean": round(sum(e.prompt_tokens for e in entries) / n, 1) if n else None,
            "output_tokens_mean": round(sum(e.output_tokens for e in entries) / n, 1) if n else None}


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
