"""Recorded load shapes: a JSONL trace of arrival times and lengths, read for replay or exported.

One request per line, ``t`` in seconds from the trace's start (the arrival), the prompt length in
tokens and the output length in tokens; other fields are kept for the reader and ignored::

    {"t": 0.0, "prompt_tokens": 812, "output_tokens": 140, "priority": "interactive", "tenant": "alice"}
    {"t": 0.42, "prompt_tokens": 95, "output_tokens": 512}

A replay (``passerelle bench --trace FILE``, or ``trace = "FILE"`` in a scenario class) sends
request *i* at ``t_i / speed`` after the start, whatever the answers do (an open loop), with a
synthetic prompt of that many tokens and ``max_tokens`` = its output length: the runtime sees last
week's load shape and length mix, never its text (passerelle does not keep prompts).

``passerelle usage --export-trace FILE`` (tenants/trace.py) writes one from the gateway's usage store (the usage
table keeps each request's end time, so its arrivals are approximate: each is shifted by that
request's own duration) or, with ``--access-log FILE``, from access-log lines, whose ``ts`` and
``duration_ms`` give the exact arrival.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
