"""One structured line per request, written when it ends, with its termination cause.

JSON lines by default (``--log-format text`` for people). Never the prompt or the completion.

Lines are not written one by one through ``logging``, which costs more than building them: they
collect in a buffer that goes out in one write at the end of the event loop's current pass (so a
line is out within milliseconds of its request's end, and a busy pass writes many lines at once),
on shutdown, and at interpreter exit, so that a clean stop loses none.

Example::

    log = AccessLog()            # JSON lines on stderr
    log.write(rec)               # buffered; written at the end of this loop pass
    log.flush()                  # now (shutdown does this)
"""

from __future__ import annotations

import asyncio
import atexit
import re
import sys
import time
import weakref
from typing import TextIO

import orjson

from passerelle.observe.record import RequestRecord, clip

# Characters that would let a client's string (model, user) forge a line or drive a terminal:
# C0 and C1 controls (newline, ESC), DEL, the Unicode line and paragraph separators, bidi overrides.
# The backslash too, so that an escape in the output always means an escaped character.
_UNPRINTABLE = re.compile("[\\\\\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return "\\\\" if c == "\\" else f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def printable(text: str) -> str:
    """``text`` with every control character escaped, for text logs and terminals.

    >>> printable("gpt\\n12:00:00 req_x forged")
    'gpt\\\\x0a12:00:00 req_x forged'
    >>> printable("\\x1b[2Jalice")
    '\\\\x1b[2Jalice'
    """
    return _UNPRINTABLE.sub(_escape, text)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def record_fields(rec: RequestRecord) -> dict[str, object]:
    ttft = rec.ttft
    gen_time = (rec.t_last - rec.t_first) if rec.t_first and rec.t_last > rec.t_first else 0.0
    tokens = rec.output_tokens
    return {
        "ts": round(time.time(), 3),
        "request_id": rec.id,
        "endpoint": rec.endpoint,
        "model": clip(rec.model),
        "backend": rec.backend,
        **({"slot": rec.slot} if rec.slot is not None else {}),
        "tenant": rec.tenant,
        **({"key_id": rec.key_id} if rec.key_id else {}),
        **({"user": rec.user} if rec.user else {}),
        **({"session": rec.session} if rec.session else {}),  # hashed: never the client's id itself
        **({"task": rec.task} if rec.task else {}),  # a front-end's background task (proxy/frontend.py)
        "priority": rec.priority,
        "stream": rec.stream,
        "status": rec.status,
        "cause": rec.cause.value if rec.cause else None,
        "queue_ms": _ms(rec.queue_wait),
        "ttft_ms": _ms(ttft),
        "duration_ms": _ms(rec.duration),
        "prompt_tokens": rec.prompt_tokens,
        **({"cached_tokens": rec.cached_tokens} if rec.cached_tokens is not None else {}),
        "completion_tokens": rec.completion_tokens if rec.completion_tokens is not None else rec.content_chunks,
        "tokens_per_s": round((tokens - 1) / gen_time, 2) if gen_time > 0 and tokens > 1 else None,
        "client": rec.client,
        **({"suspensions": rec.suspensions, "suspended_ms": _ms(rec.suspended_s),
            "resume_prompt_tokens": rec.resume_prompt_tokens, "suspended_at_tokens": rec.suspended_at}
           if rec.suspensions else {}),
        **({"tool_call_format": rec.tool_call_format, "tool_calls_repaired": rec.tool_calls_repaired,
            "tool_calls_unrepaired": rec.tool_calls_unrepaired} if rec.tool_call_format else {}),
        **({"tool_call_failure": rec.tool_call_failure} if rec.tool_call_failure else {}),
        **({"error": clip(rec.error, 512)} if rec.error else {}),
    }


def _tool_calls(rec: RequestRecord) -> str:
    """The text line's note of tool-call repair: calls repaired / passed through as text."""
    return f" tool_calls={rec.tool_calls_repaired}/{rec.tool_calls_unrepaired}" if rec.tool_call_format else ""


class AccessLog:
    def __init__(self, *, enabled: bool = True, fmt: str = "json", stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.fmt = fmt
        self.stream = stream or sys.stderr
        self._buf: list[bytes] = []
        self._flush_at: asyncio.Handle | None = None
        self._flush_loop: asyncio.AbstractEventLoop | None = None
        _open_logs.add(self)

    def write(self, rec: RequestRecord) -> None:
        if not self.enabled:
            return
        fields = record_fields(rec)
        if self.fmt == "json":
            line = orjson.dumps(fields, option=orjson.OPT_APPEND_NEWLINE)
        else:
            line = (f"{time.strftime('%H:%M:%S')} {rec.id} {rec.endpoint} {printable(clip(rec.model))} -> {rec.status} "
                    f"{fields['cause']} ttft={fields['ttft_ms']}ms dur={fields['duration_ms']}ms "
                    f"tokens={fields['prompt_tokens']}/{fields['completion_tokens']} backend={rec.backend or '-'} "
                    f"tenant={printable(rec.tenant)} class={rec.priority}"
                    f"{f' session={rec.session}' if rec.session else ''}"
                    f"{f' suspended={rec.suspensions}x' if rec.suspensions else ''}"
                    f"{_tool_calls(rec)}"
                    "\n").encode()
        self._buf.append(line)
        if self._flush_at is None or self._flush_loop is None or self._flush_loop.is_closed():
            try:
                self._flush_loop = asyncio.get_running_loop()
            except RuntimeError:  # no event loop: nothing to batch with
                self.flush()
                return
            self._flush_at = self._flush_loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write out the buffered lines."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        if not self._buf:
            return
        data = b"".join(self._buf)
        self._buf.clear()
        try:
            self.stream.write(data.decode())
            self.stream.flush()
        except (OSError, ValueError):  # stderr closed or full: losing log lines must not fail requests
            pass


_open_logs: weakref.WeakSet[AccessLog] = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    for log in list(_open_logs):
        log.flush()
