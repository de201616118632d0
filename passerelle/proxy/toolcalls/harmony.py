"""gpt-oss's Harmony messages in a model's text: calls (a recipient in the header) repaired, text
channels passed on without their framing tokens (``analysis`` as Reasoning).

The raw text a runtime leaves when its own Harmony parser failed or was off looks like::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

Variants met in the wild: the recipient in the role (``<|start|>assistant to=functions.X<|channel|>
commentary``), no ``<|constrain|>`` or one with no space before it, a bare ``json`` content type,
and a call cut off before ``<|call|>`` at the end of the stream.
"""

from __future__ import annotations

import re

from passerelle.proxy.toolcalls.calls import Calls, Found
from passerelle.proxy.toolcalls.pieces import Reasoning, Text, Unrepaired
from passerelle.proxy.toolcalls.readers import Step, held_suffix, unrepaired_all
from passerelle.proxy.toolcalls.scan import TagEnd

_TERMINATORS = ("<|end|>", "<|return|>", "<|call|>")
_STARTS = ("<|start|>", "<|channel|>")
_BODY_END = re.compile(r"<\|(?:end|return|call)\|>|<\|start\|>|<\|channel\|>")
_RECIPIENT = re.compile(r"to=([^\s<]{1,256})")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]{1,64})")
HEADER_CAP = 4096


class Harmony:
    """One gpt-oss (Harmony) message from ``<|start|>`` or ``<|channel|>``: a header up to
    ``<|message|>``, then a body up to ``<|end|>``, ``<|return|>``, ``<|call|>`` or the next
    message. With a recipient (``to=functions.NAME``, before or after the channel, with or without
    ``<|constrain|>json``) the body is a call's arguments; else it is text, streamed as it comes
    (``analysis`` as Reasoning, other channels as Text) and the framing tokens are dropped."""

    def __init__(self, calls: Calls, opened: int) -> None:
        self._calls = calls
        self._header = TagEnd("<|message|>", opened)
        self._opened = opened
        self._body_from: int | None = None
        self._name: str | None = None
        self._reasoning = False
        self._scan = 0

    def step(self, buf: str, final: bool) -> Step | None:
        if self._body_from is None:
            return self._head(buf, final)
        if self._name is not None:
            return self._call(buf, final)
        return self._text(buf, final)

    def _head(self, buf: str, final: bool) -> Step | None:
        at = self._header.scan(buf)
        cut = buf.find("<|start|>", self._opened, at if at is not None else len(buf))
        if cut >= 0:
            return [Unrepaired(buf[:cut], "Harmony header without <|message|>")], cut, None
        if at is None:
            if final or len(buf) > HEADER_CAP:
                return unrepaired_all(buf, "Harmony header without <|message|>")
            return None
        header = buf[:at]
        body = at + len("<|message|>")
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            name = recipient.group(1)
            self._name = name[len("functions."):] if name.startswith("functions.") else name
            self._body_from = body
            self._scan = body
            return self._call(buf, final)
        channel = _CHANNEL.search(header)
        self._reasoning = channel is not None and channel.group(1) == "analysis"
        self._body_from = 0
        return [], body, self

    def _call(self, buf: str, final: bool) -> Step | None:
        assert self._name is not None and self._body_from is not None
        m = _BODY_END.search(buf, self._scan)
        if m is None:
            self._scan = max(self._scan, len(buf) - 11)
            if not final:
                return None
            stop = end = len(buf)
        else:
            stop = m.start()
            end = m.end() if m.group() in _TERMINATORS else m.start()
        found = Found(self._name, buf[self._body_from:stop].strip())
        return self._calls.pieces(buf[:end], [found]), end, None

    def _text(self, buf: str, final: bool) -> Step | None:
        kind = Reasoning if self._reasoning else Text
        m = _BODY_END.search(buf)
        if m is not None:
            end = m.end() if m.group() in _TERMINATORS else m.start()
            return ([kind(buf[:m.start()])] if m.start() else []), end, None
        if final:
            return ([kind(buf)] if buf else []), len(buf), None
        keep = held_suffix(buf, _TERMINATORS + _STARTS, "<")
        n = len(buf) - keep
        return ([kind(buf[:n])], n, self) if n else None
