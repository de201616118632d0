"""Resumable scans over a growing buffer: the end of a JSON value, and a closing tag.

A call is held while it streams in, and each feed must not rescan what came before (a 1 MiB call
fed four characters at a time would cost quadratic time): both scanners keep where they stopped.
The JSON scanner jumps between the characters that matter (quotes, backslashes, brackets) with a
regex, counts nesting without recursing, and refuses nesting deeper than ``MAX_NESTING``.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_NESTING = 64

_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["{}\[\]]')


class TooDeep(Exception):
    """A JSON value nested deeper than MAX_NESTING."""


class JsonEnd:
    """Finds where the JSON object or array starting at ``start`` ends, across calls on a buffer
    that only grows."""

    __slots__ = ("_depth", "_escape", "_in_string", "_pos")

    def __init__(self, start: int) -> None:
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escape = False

    def scan(self, buf: str) -> int | None:
        """The index just past the value's end, or None while it has not ended; raises TooDeep."""
        pos = self._pos
        n = len(buf)
        while pos < n:
            if self._escape:
                self._escape = False
                pos += 1
                continue
            if self._in_string:
                m = _IN_STRING.search(buf, pos)
                if m is None:
                    pos = n
                    break
                pos = m.end()
                if m.group() == "\\":
                    self._escape = True
                else:
                    self._in_string = False
                continue
            m = _OUTSIDE.search(buf, pos)
            if m is None:
                pos = n
                break
            pos = m.end()
            ch = m.group()
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
                if self._depth > MAX_NESTING:
                    raise TooDeep
            else:
                self._depth -= 1
                if self._depth <= 0:
                    self._pos = pos
                    return pos
        self._pos = pos
        return None


class TagEnd:
    """Finds ``tag`` in a buffer that only grows, from ``start``, never searching a part twice."""

    __slots__ = ("_from", "tag")

    def __init__(self, tag: str, start: int) -> None:
        self.tag = tag
        self._from = start

    def scan(self, buf: str) -> int | None:
        """The index where ``tag`` starts, or None."""
        at = buf.find(self.tag, self._from)
        if at < 0:
            self._from = max(self._from, len(buf) - len(self.tag) + 1)
            return None
        return at


def _no_constant(word: str) -> Any:
    raise ValueError(f"{word} is not JSON")


def loads_bounded(text: str) -> Any:
    """``text`` as JSON, refusing (ValueError) what nests deeper than MAX_NESTING, so that the
    decoder never meets Python's recursion limit, and ``NaN`` / ``Infinity``, which Python reads
    but no JSON parser of a client does."""
    stripped = text.lstrip()
    if stripped[:1] in ("{", "["):
        try:
            JsonEnd(0).scan(stripped)
        except TooDeep:
            raise ValueError(f"nested deeper than {MAX_NESTING}") from None
    return json.loads(text, parse_constant=_no_constant)
