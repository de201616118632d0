"""One reader per kind of call markup, each taking over from the text scan at its opening marker.

A reader is handed the held buffer, which starts at its marker, and answers ``None`` (the call has
not ended: hold it all) or a step: the pieces it made, how many characters of the buffer they
stand for, and the reader that goes on (``None``: back to text). Each step consumes characters or
changes the reader; at the end of the stream (``final``) a reader always answers a step. Readers
keep where they stopped scanning (``scan.py``) so that a call fed in small pieces costs linear time.
"""

from __future__ import annotations

import re
from typing import Protocol

from passerelle.proxy.toolcalls.calls import (
    Bad,
    Calls,
    Found,
    found_in_body,
    found_in_json,
    found_in_object,
    found_in_xml,
)
from passerelle.proxy.toolcalls.pieces import Piece, Text, Unrepaired
from passerelle.proxy.toolcalls.scan import JsonEnd, TagEnd, TooDeep, loads_bounded

Step = tuple[list[Piece], int, "Reader | None"]


class Reader(Protocol):
    def step(self, buf: str, final: bool) -> Step | None: ...


_NOT_SPACE = re.compile(r"\S")


def skip_space(buf: str, pos: int) -> int:
    """The index of the first character from ``pos`` that is not whitespace, or ``len(buf)``."""
    m = _NOT_SPACE.search(buf, pos)
    return len(buf) if m is None else m.start()


def held_suffix(buf: str, tokens: tuple[str, ...], firsts: str) -> int:
    """How many characters at the end of ``buf`` could begin one of ``tokens`` (to hold back)."""
    lo = max(0, len(buf) - max(len(t) for t in tokens) + 1)
    earliest = len(buf)
    for first in firsts:
        j = buf.find(first, lo, earliest)
        while j >= 0:
            tail = buf[j:]
            if any(t.startswith(tail) for t in tokens):
                earliest = j
                break
            j = buf.find(first, j + 1, earliest)
    return len(buf) - earliest


def unrepaired_all(buf: str, reason: str) -> Step:
    return [Unrepaired(buf, reason)], len(buf), None


_TOOL_CALL_TAG = re.compile(r"</?tool_call>")


class Tagged:
    """``<tool_call>BODY</tool_call>``: the body is Hermes' JSON or Qwen3-Coder's ``<function=...>``.
    A call left unclosed ends where the next ``<tool_call>`` opens, or at the end of the stream,
    and then, when it is a Qwen3-Coder function, at its ``</function>`` (what follows is text)."""

    CLOSE = "</tool_call>"

    def __init__(self, calls: Calls, opened: int) -> None:
        self._calls = calls
        self._opened = opened
        self._from = opened

    def step(self, buf: str, final: bool) -> Step | None:
        m = _TOOL_CALL_TAG.search(buf, self._from)
        if m is None:
            self._from = max(self._from, len(buf) - len(self.CLOSE) + 1)
            return self._unclosed(buf, len(buf)) if final else None
        if m.group() != self.CLOSE:
            return self._unclosed(buf, m.start())
        return self._calls.read(buf[:m.end()], found_in_body, buf[self._opened:m.start()]), m.end(), None

    def _unclosed(self, buf: str, stop: int) -> Step:
        body = buf[self._opened:stop]
        function_end = body.find("</function>")
        if function_end >= 0 and body.lstrip().startswith("<function="):
            stop = self._opened + function_end + len("</function>")
            body = buf[self._opened:stop]
        return self._calls.read(buf[:stop], found_in_body, body), stop, None


class BareFunction:
    """Qwen3-Coder's ``<function=NAME>...</function>`` without its wrapper (as Ollama's qwen3-coder
    prints it), taking a stray ``</tool_call>`` after it along."""

    CLOSE = "</function>"
    STRAY = "</tool_call>"

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self._end = TagEnd(self.CLOSE, 1)
        self._closed: int | None = None
        self._spaced = 0

    def step(self, buf: str, final: bool) -> Step | None:
        if self._closed is None:
            at = self._end.scan(buf)
            if at is None:
                if not final:
                    return None
                return self._calls.read(buf, found_in_xml, buf), len(buf), None
            self._closed = at + len(self.CLOSE)
        closed = self._closed
        after = self._spaced = skip_space(buf, max(closed, self._spaced))
        end = closed
        if buf.startswith(self.STRAY, after):
            end = after + len(self.STRAY)
        elif not final and self.STRAY.startswith(buf[after:after + len(self.STRAY)]):
            return None
        return self._calls.read(buf[:end], found_in_xml, buf[:closed]), end, None


_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,256}")
_CALL_ID = re.compile(r"[A-Za-z0-9_\-]{1,64}")


class Mistral:
    """``[TOOL_CALLS][{"name", "arguments"}, ...]`` (or one object), and the newer
    ``[TOOL_CALLS]NAME[ARGS]{...}`` (``[CALL_ID]ID`` before ``[ARGS]`` allowed)."""

    MARK = "[TOOL_CALLS]"

    def __init__(self, calls: Calls) -> None:
        self._calls = calls
        self._span: JsonEnd | None = None
        self._name = ""
        self._start = 0
        self._spaced = len(self.MARK)  # whitespace after the marker is scanned once

    def step(self, buf: str, final: bool) -> Step | None:
        if self._span is None:
            head = self._head(buf, final)
            if head is not None:
                return head
            if self._span is None:
                return None
        try:
            end = self._span.scan(buf)
        except TooDeep:
            return unrepaired_all(buf, "arguments nested too deep")
        if end is None:
            return unrepaired_all(buf, "unterminated call") if final else None
        start = self._start
        if self._name:
            return self._calls.pieces(buf[:end], [Found(self._name, buf[start:end])]), end, None
        return self._calls.read(buf[:end], found_in_json, buf[start:end]), end, None

    def _head(self, buf: str, final: bool) -> Step | None:
        """Reads up to the JSON (setting ``_span``), or says the markup is no call; None: more is
        needed (or the JSON has begun)."""
        j = self._spaced = skip_space(buf, self._spaced)
        if j == len(buf):
            return unrepaired_all(buf, "no call after [TOOL_CALLS]") if final else None
        if buf[j] in "[{":
            self._start = j
            self._span = JsonEnd(j)
            return None
        m = _NAME.match(buf, j)
        if m is None:
            return [Unrepaired(buf[:j], "no call after [TOOL_CALLS]")], j, None
        k = m.end()
        if k == len(buf) or (len(m.group()) == 256 and _NAME.match(buf, k)):
            if not final and len(m.group()) < 256:
                return None
            return [Unrepaired(buf[:k], "no [ARGS] after the name")], k, None
        rest = buf[k:k + 9]
        if not final and len(rest) < 9 and ("[CALL_ID]".startswith(rest) or "[ARGS]".startswith(rest)):
            return None
        if rest == "[CALL_ID]":
            c = _CALL_ID.match(buf, k + 9)
            if c is None or (c.end() == len(buf) and len(c.group()) < 64):
                if not final and (c is not None or k + 9 == len(buf)):
                    return None
                return [Unrepaired(buf[:k], "bad [CALL_ID]")], k, None
            k = c.end()
        if not buf.startswith("[ARGS]", k):
            if not final and "[ARGS]".startswith(buf[k:]):
                return None
            return [Unrepaired(buf[:k], "no [ARGS] after the name")], k, None
        start = skip_space(buf, k + 6)
        if start == len(buf):
            return unrepaired_all(buf, "no arguments after [ARGS]") if final else None
        if buf[start] != "{":
            return [Unrepaired(buf[:start], "arguments are not an object")], start, None
        self._name = m.group()
        self._start = start
        self._span = JsonEnd(start)
        return None


class LlamaJson:
    """Llama 3's JSON calls: ``{"name", "parameters" | "arguments"}``, several separated by ``;``
    (or an array of them: Mistral's calls when the runtime dropped the ``[TOOL_CALLS]`` token).
    After ``<|python_tag|>`` (``bare`` False) the objects are a call; ``bare``, they are one only
    as the whole answer and naming the request's tools, else they are text (an answer in JSON)."""

    def __init__(self, calls: Calls, opened: int, bare: bool) -> None:
        self._calls = calls
        self._pos = opened
        self.bare = bare
        self._objects: list[tuple[int, int]] = []
        self._span: JsonEnd | None = None
        self._start = opened

    def step(self, buf: str, final: bool) -> Step | None:
        if self.bare and not self._objects and self._span is None:
            known = _call_key(buf, 1) if buf[0] == "{" else _call_array(buf)
            if known is None:
                return ([Text(buf)], len(buf), None) if final else None
            if not known:
                return [Text(buf[:1])], 1, None
        while True:
            if self._span is None:
                j = self._pos = skip_space(buf, self._pos)
                if self._objects:
                    if j == len(buf) and not final:
                        return None
                    if j < len(buf) and buf[j] == ";":
                        k = skip_space(buf, j + 1)
                        if k == len(buf) and not final:
                            return None
                        if k < len(buf) and buf[k] == "{":
                            self._span = JsonEnd(k)
                            self._start = k
                            continue
                    return self._done(buf, j, final)
                if j == len(buf):
                    return unrepaired_all(buf, "no call after <|python_tag|>") if final else None
                if buf[j] not in "{[":
                    return [Unrepaired(buf[:j], "<|python_tag|> not followed by a JSON call")], j, None
                self._span = JsonEnd(j)
                self._start = j
            try:
                end = self._span.scan(buf)
            except TooDeep:
                return self._give_up(buf, "nested too deep")
            if end is None:
                return self._give_up(buf, "unterminated call") if final else None
            self._objects.append((self._start, end))
            self._span = None
            self._pos = end

    def _give_up(self, buf: str, reason: str) -> Step:
        if self.bare:
            return [Text(buf)], len(buf), None
        return unrepaired_all(buf, reason)

    def _found(self, buf: str) -> list[Found]:
        found: list[Found] = []
        for start, end in self._objects:
            value = loads_bounded(buf[start:end])
            found.extend(map(found_in_object, value if isinstance(value, list) else [value]))
        if not found:
            raise Bad("empty call list")
        return found

    def _done(self, buf: str, after: int, final: bool) -> Step:
        end = self._objects[-1][1]
        markup = buf[:end]
        if self.bare:
            if after < len(buf):
                return [Text(buf[:after])], after, None
            try:
                found = self._found(buf)
            except (Bad, ValueError, RecursionError):
                return [Text(buf)], len(buf), None
            if not all(self._calls.is_tool(f.name) for f in found):
                return [Text(buf)], len(buf), None
            return [*self._calls.pieces(markup, found), Text(buf[end:])], len(buf), None
        try:
            found = self._found(buf)
        except (Bad, ValueError, RecursionError) as e:
            return [Unrepaired(markup, str(e)[:80] or "not a call")], end, None
        return self._calls.pieces(markup, found), end, None


_CALL_KEYS = ("name", "type", "function")


def _call_key(buf: str, pos: int) -> bool | None:
    """Whether the object whose first key starts at ``pos`` (after its ``{``) can be a call: its
    first key is one a call begins with; None while that cannot be told yet. A JSON answer that is
    no call is let go at once, not held to its end."""
    pos = skip_space(buf, pos)
    if pos == len(buf):
        return None
    if buf[pos] != '"':
        return False
    close = buf.find('"', pos + 1, pos + 10)
    if close < 0:
        typed = buf[pos + 1:pos + 10]
        return None if len(typed) < 9 and any(k.startswith(typed) for k in _CALL_KEYS) else False
    return buf[pos + 1:close] in _CALL_KEYS


def _call_array(buf: str) -> bool | None:
    """``_call_key`` for an array (``buf`` starts with ``[``): its first element must be a call."""
    j = skip_space(buf, 1)
    if j == len(buf):
        return None
    return _call_key(buf, j + 1) if buf[j] == "{" else False
