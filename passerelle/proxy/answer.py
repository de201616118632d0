"""An answer the gateway holds while it assembles it from a stream: its text kept as the JSON it
will be sent as, sent in pieces, and one budget for all such answers at once.

Memory, measured (tests/unit/test_assembled_memory.py, bench/assembled_memory.py): the text of an
answer arrives as thousands of deltas. Kept as Python strings, joined, then encoded whole with
orjson (whose output buffer for a long string is reserved at about 15 bytes a character and kept),
an answer of 9 MiB cost 150-170 MiB at the peak. Here each delta is encoded as it arrives and
appended to one ``bytearray`` (:class:`Text`), the body is rendered as a list of pieces (a small
encoded skeleton, and views of those buffers: :func:`render`), and the pieces are written to the
client as they are: the peak is the answer's size and a little more.

:class:`AnswerBudget` caps the bytes all answers being assembled hold together
(``[limits] max_answer_bytes_total``); a request whose answer would pass it ends with 503
``answers_busy`` and ``Retry-After`` (:class:`~passerelle.errors.AnswersBusy`), and its runtime
connection is closed.

Example::

    text = Text()
    text.add('He said "hi"')                 # kept encoded: He said \\"hi\\"
    pieces = render({"content": text, "n": 1})
    b"".join(pieces)                          # b'{"content":"He said \\\\"hi\\\\"","n":1}'
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import orjson

from passerelle.config import LimitsConfig
from passerelle.errors import AnswersBusy, UpstreamError

Piece = bytes | bytearray | memoryview
# A string longer than this is encoded in slices of it: orjson reserves about 15 bytes per
# character of a string for its output, so one encode of a long string costs that much at once.
SLICE = 1 << 15


class Blob:
    """JSON kept encoded in a ``bytearray``, written between ``open`` and ``close`` by :func:`render`."""

    __slots__ = ("buf",)
    open = b""
    close = b""

    def __init__(self) -> None:
        self.buf = bytearray()

    def __len__(self) -> int:
        return len(self.buf)


class Text(Blob):
    """A JSON string built from parts; :meth:`add` returns the bytes it grew by."""

    __slots__ = ()
    open = close = b'"'

    def add(self, part: str) -> int:
        before = len(self.buf)
        for at in range(0, len(part), SLICE):
            encoded = orjson.dumps(part[at:at + SLICE] if len(part) > SLICE else part)
            self.buf += memoryview(encoded)[1:-1]
        return len(self.buf) - before

    def __bool__(self) -> bool:
        return bool(self.buf)


class Items(Blob):
    """A JSON array built from lists of items (logprobs), each item encoded as it arrives."""

    __slots__ = ()
    open, close = b"[", b"]"

    def add(self, items: list[Any]) -> int:
        before = len(self.buf)
        for item in items:
            if self.buf:
                self.buf += b","
            self.buf += encode(item)
        return len(self.buf) - before


class Raw(Blob):
    """JSON text that is already a complete value (a tool call's input, checked before use)."""

    __slots__ = ()


def encode(value: Any) -> bytes:
    """``value`` as JSON; long strings in it are encoded in slices (see ``SLICE``)."""
    return b"".join(render(value))


def _with_blobs(value: Any) -> Any:
    """``value`` with each string longer than ``SLICE`` replaced by a :class:`Text` (in place for
    the dicts and lists of ``value``, which the caller owns; an explicit stack, not recursion)."""
    if isinstance(value, str):
        if len(value) <= SLICE:
            return value
        text = Text()
        text.add(value)
        return text
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, str) and len(v) > SLICE:
                    node[k] = _with_blobs(v)
                elif isinstance(v, dict | list):
                    stack.append(v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, str) and len(v) > SLICE:
                    node[i] = _with_blobs(v)
                elif isinstance(v, dict | list):
                    stack.append(v)
    return value


def render(value: Any) -> list[Piece]:
    """``value`` (JSON data, with :class:`Blob` values anywhere) as pieces that make its JSON when
    written one after the other: a blob's buffer is a piece of its own, never copied."""
    value = _with_blobs(value)
    blobs: list[Blob] = []
    mark = secrets.token_hex(8)

    def default(obj: Any) -> str:
        if isinstance(obj, Blob):
            blobs.append(obj)
            return f"{mark}{len(blobs) - 1}"
        raise TypeError(f"{type(obj).__name__} is not JSON")

    try:
        skeleton = orjson.dumps(value, default=default)
    except TypeError:  # the runtime's JSON nested past what orjson writes (254 levels): its fault
        raise UpstreamError("The model runtime's answer is nested too deeply to be assembled.") from None
    if not blobs:
        return [skeleton]
    pieces: list[Piece] = []
    at = 0
    for i, blob in enumerate(blobs):
        token = b'"%s%d"' % (mark.encode(), i)
        found = skeleton.index(token, at)
        pieces += [skeleton[at:found], blob.open, memoryview(blob.buf), blob.close]
        at = found + len(token)
    pieces.append(skeleton[at:])
    return [p for p in pieces if len(p)]


def size_of(pieces: Sequence[Piece]) -> int:
    return sum(len(p) for p in pieces)


class AnswerBudget:
    """Bytes held by every answer being assembled at once, and their cap."""

    __slots__ = ("limit", "used")

    def __init__(self, limits: LimitsConfig) -> None:
        self.used = 0
        self.configure(limits)

    def configure(self, limits: LimitsConfig) -> None:
        """``max_answer_bytes_total``; answers held past a lowered cap finish, new ones wait for room."""
        self.limit = limits.max_answer_bytes_total

    def hold(self) -> AnswerShare:
        return AnswerShare(self)


class AnswerShare:
    """One request's share of an :class:`AnswerBudget`; :meth:`release` when the request ends."""

    __slots__ = ("budget", "size")

    def __init__(self, budget: AnswerBudget) -> None:
        self.budget = budget
        self.size = 0

    def check(self) -> None:
        """Raise AnswersBusy when the budget is used up already (before a runtime is asked)."""
        if self.budget.used >= self.budget.limit:
            raise AnswersBusy(self.budget.limit)

    def grow_to(self, size: int) -> None:
        """This request now holds ``size`` bytes; AnswersBusy when that passes the budget."""
        grow = size - self.size
        if grow <= 0:
            return
        budget = self.budget
        if budget.used + grow > budget.limit:
            raise AnswersBusy(budget.limit)
        budget.used += grow
        self.size = size

    def release(self) -> None:
        self.budget.used -= self.size
        self.size = 0
