"""What a batch's input file and a batch request must be, checked before anything runs, and the
file's lines read back a few at a time.

A file with ``purpose=batch`` is checked when it is uploaded (each line a JSON object with a
``custom_id`` unique in the file, ``method`` POST, a ``url`` of an endpoint the Batch API runs, a
``body`` object that does not ask for a stream); a batch is checked when it is created (each
line's ``url`` the batch's ``endpoint``, its ``model`` served and allowed for the key). A refusal
names the line numbers of the first errors (1-based, as an editor shows them).

Memory: a file is never held as parsed objects. :class:`Checker` takes one line at a time, parses
it, keeps what the file's verdict needs (a count, an 8-byte hash of each ``custom_id``, the first
errors, each (url, model) pair with the first lines naming it) and drops the object;
:class:`LineReader` gives a batch's lines back from its file a block at a time. A line is at most
``max_line_bytes`` (the request body it carries is refused past ``[server] max_body_bytes`` anyway).

Example::

    >>> check = Checker(max_lines=10, max_line_bytes=1024)
    >>> check.feed(1, b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
    ...               b'"body": {"model": "m", "messages": []}}')
    >>> check.summary().pairs
    {('/v1/chat/completions', 'm'): [1]}
    >>> window_seconds("24h")
    86400.0
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

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
MAX_PAIRS = 1024  # (url, model) pairs one file may name (each is checked at the batch's creation)
BLOCK = 64 * 1024  # bytes read from a file at once (a batch holds one block, or one line if longer)


def max_line_bytes(max_body_bytes: int) -> int:
    """The longest line of an input file: a request body the gateway takes, and its line's fields."""
    return max_body_bytes + 64 * 1024


class InvalidFile(InvalidRequest):
    code = "invalid_file"


class TooManyLines(InvalidRequest):
    code = "too_many_lines"


@dataclass(frozen=True, slots=True)
class Line:
    """One request of a batch's input file."""

    number: int  # 1-based
    custom_id: str
    url: str
    body: dict[str, Any]


def _refuse(errors: list[str], more: int, what: str) -> InvalidFile:
    tail = f" (and {more} more lines)" if more else ""
    return InvalidFile(f"{what}: " + "; ".join(errors) + tail + ".", param="file")


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
    if not isinstance(url, str) or url not in ENDPOINTS:  # (a list or an object is unhashable)
        return f"'url' must be one of {', '.join(ENDPOINTS)}"
    body = obj.get("body")
    if not isinstance(body, dict):
        return "'body' must be a JSON object"
    if body.get("stream"):
        return "'body.stream' is not supported in a batch"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "'body.model' must be a model name"
    return None


def parse_line(number: int, raw: bytes | memoryview) -> Line:
    """A line already checked (its file's own): parsed again to run it."""
    obj = orjson.loads(raw)
    return Line(number, obj["custom_id"], obj["url"], obj["body"])


@dataclass(slots=True)
class Summary:
    """What a checked file holds: its lines, and for each (url, model) pair the first lines naming it."""

    lines: int
    pairs: dict[tuple[str, str], list[int]] = field(default_factory=dict)


class Checker:
    """A batch input file's verdict, fed one raw line at a time; raises at the first fault that
    ends the check (too many lines), else :meth:`summary` raises naming the first bad lines."""

    def __init__(self, *, max_lines: int, max_line_bytes: int) -> None:
        self.max_lines, self.max_line_bytes = max_lines, max_line_bytes
        self.lines = 0
        self.errors: list[str] = []
        self.more_errors = 0
        self.seen: dict[int, int] = {}  # custom_id's 8-byte hash -> its line
        self.pairs: dict[tuple[str, str], list[int]] = {}

    def _error(self, number: int, problem: str) -> None:
        if len(self.errors) < SHOWN_ERRORS:
            self.errors.append(f"line {number}: {problem}")
        else:
            self.more_errors += 1

    def feed(self, number: int, raw: bytes | memoryview) -> None:
        self.lines += 1
        if self.lines > self.max_lines:
            raise TooManyLines(f"The file has more than {self.max_lines} requests, the most one batch may hold "
                               "([batches] max_lines).", param="file")
        if len(raw) > self.max_line_bytes:
            self._error(number, f"longer than {self.max_line_bytes} bytes")
            return
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self._error(number, "not valid JSON")
            return
        problem = _check_line(obj)
        if problem is None:
            cid = obj["custom_id"]
            h = int.from_bytes(hashlib.blake2b(cid.encode(), digest_size=8).digest(), "little")
            if h in self.seen:
                problem = f"'custom_id' {cid[:64]!r} is also on line {self.seen[h]}"
            else:
                self.seen[h] = number
        if problem is not None:
            self._error(number, problem)
            return
        pair = (obj["url"], obj["body"]["model"])
        first = self.pairs.get(pair)
        if first is None:
            if len(self.pairs) >= MAX_PAIRS:
                self._error(number, f"the file names more than {MAX_PAIRS} different models")
                return
            self.pairs[pair] = first = []
        if len(first) < SHOWN_ERRORS:
            first.append(number)

    def summary(self) -> Summary:
        if self.errors:
            raise _refuse(self.errors, self.more_errors, "The file is not a valid batch input")
        if not self.lines:
            raise InvalidFile("The file holds no request (one JSON object a line).", param="file")
        return Summary(self.lines, self.pairs)


def lines_in(buf: bytes, start: int, end: int) -> Iterator[tuple[int, bytes | memoryview]]:
    """The non-blank lines of ``buf[start:end]`` with their numbers. Split a block of about
    :data:`BLOCK` bytes at a time (in C; a block's copy is all that is held), a line longer than
    a block given as a view of ``buf``."""
    number, pos = 0, start
    while pos < end:
        cut = buf.rfind(b"\n", pos, min(pos + BLOCK, end))
        if cut < 0:  # one line longer than a block (or the last one)
            nl = buf.find(b"\n", pos, end)
            stop = end if nl < 0 else nl
            number += 1
            view = memoryview(buf)[pos:stop]
            if buf[pos:min(stop, pos + 64)].strip() or (stop - pos > 64 and bytes(view).strip()):
                yield number, view
            pos = stop + 1
            continue
        for raw in buf[pos:cut].split(b"\n"):
            number += 1
            if raw.strip():
                yield number, raw
        pos = cut + 1


def check_content(buf: bytes, start: int, end: int, *, max_lines: int, max_line_bytes: int) -> Summary:
    """Check the file held in ``buf[start:end]`` (an upload), line by line."""
    check = Checker(max_lines=max_lines, max_line_bytes=max_line_bytes)
    for number, raw in lines_in(buf, start, end):
        check.feed(number, raw)
    return check.summary()


class LineReader:
    """A file's non-blank lines with their numbers, a block at a time (blocking: run it on the
    store's thread). A line longer than ``max_line_bytes`` raises InvalidFile (the file changed
    since it was checked)."""

    def __init__(self, f: BinaryIO, max_line_bytes: int) -> None:
        self.f, self.max_line_bytes = f, max_line_bytes
        self.number = 0
        self.buf = b""
        self.pos = 0  # where the next line starts in buf
        self.eof = False

    def read(self, most: int) -> list[tuple[int, bytes]]:
        """Up to ``most`` more lines; [] at the end of the file."""
        out: list[tuple[int, bytes]] = []
        while len(out) < most:
            nl = self.buf.find(b"\n", self.pos)
            if nl < 0:
                if not self.eof:
                    if len(self.buf) - self.pos > self.max_line_bytes:
                        raise InvalidFile(f"line {self.number + 1}: longer than {self.max_line_bytes} bytes")
                    block = self.f.read(BLOCK)
                    self.eof = not block
                    self.buf, self.pos = self.buf[self.pos:] + block, 0
                    continue
                if self.pos >= len(self.buf):
                    break
                nl = len(self.buf)
            raw = self.buf[self.pos:nl]
            self.pos = nl + 1
            self.number += 1
            if raw.strip():
                out.append((self.number, raw))
        return out

    def close(self) -> None:
        self.f.close()


def check_file(f: BinaryIO, *, max_lines: int, max_line_bytes: int) -> Summary:
    """Check a stored file, streamed from ``f`` (blocking)."""
    check = Checker(max_lines=max_lines, max_line_bytes=max_line_bytes)
    reader = LineReader(f, max_line_bytes)
    while block := reader.read(256):
        for number, raw in block:
            check.feed(number, raw)
    return check.summary()


def check_batch(summary: Summary, endpoint: str, knows: Callable[[str], str | None]) -> None:
    """Each line fits the batch: its ``url`` is ``endpoint``, and ``knows(model)`` (None when the
    model is served on that endpoint and allowed for the key; else why not) has nothing to say."""
    errors: list[tuple[int, str]] = []
    for (url, model), first in summary.pairs.items():
        why = (f"'url' is {url}, not the batch's endpoint {endpoint}" if url != endpoint else knows(model))
        if why is not None:
            errors.extend((n, f"line {n}: {why}") for n in first)
    if errors:
        errors.sort()
        raise _refuse([e for _, e in errors[:SHOWN_ERRORS]], 0, "The batch's input file does not fit it")


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
