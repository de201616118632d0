"""An SSE byte stream cut into whole events, and the token counts of a ``usage`` object.

The relay (relay.py) and the answers assembled from a stream (assemble.py, assemble_events.py)
split what a runtime sends here: an event reaches them only once its blank line has arrived.

Example::

    scanner = SSEScanner()
    scanner.feed(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\\n\\ndata: [DO')
    # -> [b'data: {"choices":[{"delta":{"content":"Hi"}}]}\\n\\n'], 'data: [DO' kept for later
"""

from __future__ import annotations

from typing import Any

from passerelle.errors import UpstreamTooLarge
from passerelle.proxy.grammars import token_count


class SSEScanner:
    """Split a byte stream into complete SSE events (``\\n\\n`` or ``\\r\\n\\r\\n`` terminated).

    Linear in the bytes fed, however they are cut: an incomplete event is kept in a bytearray that
    grows by what arrives, and only the new bytes (plus the 3 before them, for a terminator cut in
    two) are searched. An event larger than ``max_event`` bytes, complete or still arriving, raises
    UpstreamTooLarge, so a runtime that sends an endless line costs at most that much memory.
    """

    __slots__ = ("_tail", "max_event")

    def __init__(self, max_event: int = 1 << 20) -> None:
        self._tail = bytearray()
        self.max_event = max_event

    def feed(self, data: bytes) -> list[bytes]:
        tail = self._tail
        if tail:
            if len(tail) > self.max_event:  # (over the cap since the last feed, which had events to return)
                self._too_large()
            # The tail holds no terminator: search only the new bytes (and the 3 before them, for a
            # terminator cut in two). Without one, the bytes are kept and nothing else is touched.
            search = max(0, len(tail) - 3)
            tail += data
            lf = tail.find(b"\n\n", search)
            crlf = tail.find(b"\r\n\r\n", search)
            if lf < 0 and crlf < 0:
                if len(tail) > self.max_event:
                    self._too_large()
                return []
            buf = bytes(tail)  # once per completed event: linear overall
            tail.clear()
        else:
            buf = data
            lf = buf.find(b"\n\n")
            crlf = buf.find(b"\r\n\r\n")
        events: list[bytes] = []
        start = 0
        limit = self.max_event
        # Each terminator is searched again only once the split has passed it: a stream that
        # never uses one (most never send CRLF) costs one scan of the buffer, not one per event.
        while lf >= 0 or crlf >= 0:
            end = lf + 2 if crlf < 0 or (0 <= lf < crlf) else crlf + 4
            if end - start > limit:
                self._too_large()
            events.append(buf[start:end])
            start = end
            if 0 <= lf < start:
                lf = buf.find(b"\n\n", start)
            if 0 <= crlf < start:
                crlf = buf.find(b"\r\n\r\n", start)
        if start < len(buf):
            tail += buf[start:] if start else buf
            if len(tail) > limit and not events:
                self._too_large()  # (with events: they are returned, and the next feed raises)
        return events

    def _too_large(self) -> None:
        self._tail = bytearray()
        raise UpstreamTooLarge("single stream event", self.max_event, "max_event_bytes")

    @property
    def pending(self) -> bytes:
        if len(self._tail) > self.max_event:
            self._too_large()
        return bytes(self._tail)


def parse_usage(obj: Any) -> tuple[int | None, int | None]:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None, None
    return token_count(usage.get("prompt_tokens")), token_count(usage.get("completion_tokens"))


