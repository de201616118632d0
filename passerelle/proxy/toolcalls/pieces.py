"""What a tool-call parser hands back: runs of text, repaired calls, and markup left as it came.

A parser's output, joined in order, accounts for every character it was fed: ``Text`` and
``Reasoning`` carry text as it was (Harmony's framing tokens of a recognised message excepted),
``ToolCall`` stands for the markup of a call it repaired, and ``Unrepaired`` carries the exact
markup of a call it could not repair. Streamed, text comes in runs of any length; ``coalesce``
joins neighbouring runs of the same kind, after which any split of the input gives the same pieces.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Text:
    """Text to deliver as content (or as reasoning, where the caller fed reasoning)."""

    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    """Reasoning found inside the text itself (Harmony's ``analysis`` channel)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A repaired call: ``index`` counts the calls of one parser from 0; ``arguments`` is a JSON
    object as text, coerced and validated against the tool's schema."""

    index: int
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Unrepaired:
    """Markup that looked like a call but could not be repaired, exactly as it came (to be passed
    through as text), and why."""

    text: str
    reason: str


Piece = Text | Reasoning | ToolCall | Unrepaired


def coalesce(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` with neighbouring ``Text`` runs joined, and neighbouring ``Reasoning`` runs; empty
    runs dropped."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, Text | Reasoning):
            if not piece.text:
                continue
            last = out[-1] if out else None
            if type(last) is type(piece) and isinstance(last, Text | Reasoning):
                out[-1] = type(piece)(last.text + piece.text)
                continue
        out.append(piece)
    return out


def plain_text(pieces: list[Piece]) -> str:
    """The text a client would see of ``pieces`` if the repaired calls were taken out: every
    ``Text`` and ``Unrepaired`` run, in order."""
    return "".join(p.text for p in pieces if isinstance(p, Text | Unrepaired))
