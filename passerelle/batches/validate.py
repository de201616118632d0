"""What a batch's input file and a batch request must be, checked before anything runs.

A file with ``purpose=batch`` is checked when it is uploaded (each line a JSON object with a
``custom_id`` unique in the file, ``method`` POST, a ``url`` of an endpoint the Batch API runs, a
``body`` object that does not ask for a stream); a batch is checked when it is created (each
line's ``url`` the batch's ``endpoint``, its ``model`` served and allowed for the key). A refusal
names the line numbers of the first errors (1-based, as an editor shows them).

Example::

    >>> lines = parse_lines(b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
    ...                     b'"body": {"model": "m", "messages": []}}\\n', max_lines=10)
    >>> [(l.number, l.custom_id, l.url) for l in lines]
    [(1, 'a', '/v1/chat/completions')]
    >>> window_seconds("24h")
    86400.0
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from passerelle.errors import InvalidRequest

# The Batch API's endpoints: the URL a line names -> the gateway's endpoint name (proxy/protocols.py).
ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
MAX_CUSTOM_ID = 512  # characters
SHOWN_ERRORS = 10  # a refusal names this many lines at most


class InvalidFile(InvalidRequest):
    code = "invalid_file"


class TooManyLines(InvalidRequest):
    code = "too_many_lines"


@dataclass(frozen=True, slots=True)
class Line:
    number: int  # 1-based
    custom_id: str
    url: str
    body: dict[str, Any]


def _refuse(errors: list[str], what: str) -> InvalidFile:
    more = "" if len(errors) <= SHOWN_ERRORS else f" (and {len(errors) - SHOWN_ERRORS} more lines)"
    return InvalidFile(f"{what}: " + "; ".join(errors[:SHOWN_ERRORS]) + more + ".", param="file")


def _check_line(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return "expected a JSON object"
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return "'custom_id' must be a non-empty string"
    if len(cid) > MAX_CUSTOM_ID:
        return f"'custom_id' is longer than {MAX_CUSTOM_ID} characters"
    if obj.get("method", "POST") != "POST":
        return "'method' must be POST"
    url = obj.get("url")
    if url not in ENDPOINTS:
        return f"'url' must be one of {', '.join(ENDPOINTS)}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "'body' must be a JSON object"
    if body.get("stream"):
        return "'body.stream' is not supported in a batch"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "'body.model' must be a model name"
    return None


def parse_lines(content: bytes, *, max_lines: int) -> list[Line]:
    """The lines of a batch input file; raises InvalidFile naming the first bad lines, or
    TooManyLines."""
    lines: list[Line] = []
    errors: list[str] = []
    seen: dict[str, int] = {}
    number = 0
    for raw in content.split(b"\n"):
        number += 1
        if not raw.strip():
            continue
        if len(lines) + len(errors) >= max_lines:
            raise TooManyLines(f"The file has more than {max_lines} requests, the most one batch may hold "
                               "([batches] max_lines).", param="file")
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            errors.append(f"line {number}: not valid JSON")
            continue
        problem = _check_line(obj)
        if problem is None and obj["custom_id"] in seen:
            problem = f"'custom_id' {obj['custom_id'][:64]!r} is also on line {seen[obj['custom_id']]}"
        if problem is not None:
            errors.append(f"line {number}: {problem}")
            continue
        seen[obj["custom_id"]] = number
        lines.append(Line(number, obj["custom_id"], obj["url"], obj["body"]))
    if errors:
        raise _refuse(errors, "The file is not a valid batch input")
    if not lines:
        raise InvalidFile("The file holds no request (one JSON object a line).", param="file")
    return lines


def check_batch(lines: list[Line], endpoint: str, knows: Callable[[str], str | None]) -> None:
    """Each line fits the batch: its ``url`` is ``endpoint``, and ``knows(model)`` (None when the
    model is served on that endpoint and allowed for the key; else why not) has nothing to say."""
    errors: list[str] = []
    verdicts: dict[str, str | None] = {}
    for line in lines:
        if line.url != endpoint:
            errors.append(f"line {line.number}: 'url' is {line.url}, not the batch's endpoint {endpoint}")
            continue
        model = line.body["model"]
        if model not in verdicts:
            verdicts[model] = knows(model)
        if verdicts[model] is not None:
            errors.append(f"line {line.number}: {verdicts[model]}")
    if errors:
        raise _refuse(errors, "The batch's input file does not fit it")


_WINDOW = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def window_seconds(text: Any, max_s: float = 7 * 86400.0) -> float:
    """``completion_window`` ("24h", OpenAI's value; also "30m", "90s", "2d") in seconds."""
    m = _WINDOW.match(text) if isinstance(text, str) else None
    seconds = float(m.group(1)) * _UNIT[m.group(2)] if m else 0.0
    if not 1 <= seconds <= max_s:
        raise InvalidRequest(f"'completion_window' must be a duration such as \"24h\" (at most {max_s / 3600:g}h).",
                             param="completion_window")
    return seconds


def check_metadata(meta: Any) -> dict[str, str] | None:
    """OpenAI's metadata: up to 16 pairs, keys up to 64 characters, values up to 512."""
    if meta is None:
        return None
    if (not isinstance(meta, dict) or len(meta) > 16
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in meta.items())):
        raise InvalidRequest("'metadata' must be an object of at most 16 string pairs (keys up to 64 characters, "
                             "values up to 512).", param="metadata")
    return meta
