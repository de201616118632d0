"""The streaming tool-call parser: text passes through, a call's markup is held until it ends.

One parser per choice of one stream. ``feed`` answers what can be said of the text so far and
holds back only what could still be markup: a possible partial opening marker at the end of the
text, or a call that has opened and not yet ended (up to ``MAX_HELD`` characters; past that the
held text goes out as ``Unrepaired``). ``finish`` says the rest. No character is lost or said
twice, whatever the split: the pieces of any split, coalesced, are those of the whole text.

Cost per ``feed``: text with none of the format's markers' first characters (``<`` or ``[``)
and nothing held is one regex scan of the chunk (a C loop over its characters) and one ``Text``.
Otherwise one regex search of the chunk for the markers, and a look at its last 13 characters for
a partial marker. A held call is scanned from where the last feed stopped, so a call costs time
linear in its length however it is split. Measured by bench/toolcalls_cost.py on the shared
2-core development machine (where wrapping a chunk in a list costs 0.4 µs and making a ``Text``
2 µs): plain text 2.4-3.6 µs per feed; text full of ``<`` 8-12 µs; a whole call streamed in 15-33
chunks 0.35-0.6 ms (its JSON read, coerced, validated and written again); a 1 MiB call fed in
16-character pieces 4.0 times a 256 KiB one.

Markers per format (``auto`` watches all, and keeps to the format of the first one it meets):

==========  ===================================================================================
hermes      ``<tool_call>``
qwen3-xml   ``<tool_call>`` and a bare ``<function=``
mistral     ``[TOOL_CALLS]``, and ``[{`` or ``{`` opening the answer when the request has tools
llama3      ``<|python_tag|>``, and ``{`` or ``[{`` opening the answer when the request has tools
harmony     ``<|start|>``, ``<|channel|>``
==========  ===================================================================================
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from passerelle.proxy.toolcalls.calls import Calls
from passerelle.proxy.toolcalls.harmony import Harmony
from passerelle.proxy.toolcalls.pieces import Piece, Text, Unrepaired, coalesce
from passerelle.proxy.toolcalls.readers import (
    BareFunction,
    LlamaJson,
    Mistral,
    Reader,
    Step,
    Tagged,
    held_suffix,
    skip_space,
)

FORMATS = ("auto", "hermes", "qwen3-xml", "mistral", "llama3", "harmony", "off")
MAX_HELD = 1 << 20

Opener = Callable[[Calls], Reader]

_OPENERS: dict[str, Opener] = {
    "<tool_call>": lambda calls: Tagged(calls, len("<tool_call>")),
    "<function=": BareFunction,
    "[TOOL_CALLS]": Mistral,
    "<|python_tag|>": lambda calls: LlamaJson(calls, len("<|python_tag|>"), bare=False),
    "<|start|>": lambda calls: Harmony(calls, len("<|start|>")),
    "<|channel|>": lambda calls: Harmony(calls, len("<|channel|>")),
}

_MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>",),
    "qwen3-xml": ("<tool_call>", "<function="),
    "mistral": ("[TOOL_CALLS]",),
    "llama3": ("<|python_tag|>",),
    "harmony": ("<|start|>", "<|channel|>"),
}
_MARKERS["auto"] = tuple(dict.fromkeys(m for f in _MARKERS.values() for m in f))
# The format auto keeps to once it meets a marker.
_OWNER = {"<tool_call>": "qwen3-xml", "<function=": "qwen3-xml", "[TOOL_CALLS]": "mistral",
          "<|python_tag|>": "llama3", "<|start|>": "harmony", "<|channel|>": "harmony"}
_BARE_JSON = ("llama3", "mistral", "auto")


class _Scan:
    """What the text scan of one format looks for."""

    __slots__ = ("firsts", "markers", "search", "trigger")

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.markers = markers
        self.firsts = "".join(sorted({m[0] for m in markers}))
        self.trigger = re.compile("[" + re.escape(self.firsts) + "]").search
        self.search = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True))).search


_SCANS = {fmt: _Scan(markers) for fmt, markers in _MARKERS.items()}


class ToolCallParser:
    """Turns one stream of a model's text into Text, ToolCall and Unrepaired pieces."""

    def __init__(self, fmt: str, tools: list[dict[str, Any]] | None) -> None:
        if fmt not in _SCANS:
            raise ValueError(f"unknown tool-call format {fmt!r}: one of {', '.join(FORMATS)}")
        self.format = fmt
        self._calls = Calls(tools)
        self._scan = _SCANS[fmt]
        self._buf = ""
        self._reader: Reader | None = None
        # A bare JSON call is looked for while only whitespace has gone out.
        self._at_start = fmt in _BARE_JSON and bool(self._calls.known)
        self._finished = False

    def feed(self, text: str) -> list[Piece]:
        """The pieces ``text`` completes; what could still be markup is held."""
        if self._reader is None and not self._buf and not self._at_start:
            scan = self._scan
            if scan.trigger(text) is None:
                return [Text(text)] if text else []
            if scan.search(text) is None:
                keep = held_suffix(text, scan.markers, scan.firsts)
                if keep:
                    self._buf = text[-keep:]
                    text = text[:-keep]
                return [Text(text)] if text else []
        # Appended with no other reference to the held text, so that CPython grows it in place:
        # ``self._buf += text`` would copy it whole at every feed (quadratic in a long call).
        held, self._buf = self._buf, ""
        held += text
        self._buf = held
        return self._run(final=False)

    def finish(self) -> list[Piece]:
        """At the end of the stream: the pieces of everything held."""
        if self._finished:
            return []
        self._finished = True
        return self._run(final=True)

    def _run(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            step: Step | None
            if self._reader is None:
                step = self._text(final)
            else:
                step = self._reader.step(self._buf, final)
                if step is None and len(self._buf) > MAX_HELD:
                    # A JSON answer that might have been a call goes on as the text it is.
                    held: Piece = Text(self._buf) if getattr(self._reader, "bare", False) else \
                        Unrepaired(self._buf, f"call longer than {MAX_HELD} characters")
                    step = [held], len(self._buf), None
            if step is None:
                return out
            pieces, used, self._reader = step
            out.extend(pieces)
            if used:
                self._buf = self._buf[used:]
            if final and self._reader is None and not self._buf:
                return out

    def _text(self, final: bool) -> Step | None:
        buf = self._buf
        if not buf:
            return None
        if self._at_start:
            j = skip_space(buf, 0)
            if j == len(buf):
                return [Text(buf)], len(buf), None
            # "[" opens an array of calls only when "{" follows (else it may be "[TOOL_CALLS]").
            after = skip_space(buf, j + 1) if buf[j] == "[" else j
            if after == len(buf) and not final:
                return ([Text(buf[:j])], j, None) if j else None
            self._at_start = False
            if buf[j] == "{" or (after < len(buf) and buf[after] == "{"):
                return [Text(buf[:j])] if j else [], j, LlamaJson(self._calls, 0, bare=True)
        m = self._scan.search(buf)
        if m is not None:
            marker = m.group()
            if self.format == "auto":
                self.format = _OWNER[marker]
                self._scan = _SCANS[self.format]
            self._at_start = False
            return [Text(buf[:m.start()])] if m.start() else [], m.start(), _OPENERS[marker](self._calls)
        keep = 0 if final else held_suffix(buf, self._scan.markers, self._scan.firsts)
        n = len(buf) - keep
        if not n:
            return None
        return [Text(buf[:n])], n, None


def parser_for(fmt: str, tools: list[dict[str, Any]] | None) -> ToolCallParser | None:
    """A parser for ``fmt`` (one of FORMATS) given the request's tools (``{"name", "parameters"}``
    or any API's shape; None: names are not checked and arguments not validated), or None for
    ``off``. Raises ValueError for an unknown format."""
    if fmt == "off":
        return None
    return ToolCallParser(fmt, tools)


def parse_all(fmt: str, tools: list[dict[str, Any]] | None, text: str) -> list[Piece]:
    """The coalesced pieces of a whole text."""
    parser = parser_for(fmt, tools)
    if parser is None:
        return [Text(text)] if text else []
    return coalesce(parser.feed(text) + parser.finish())
