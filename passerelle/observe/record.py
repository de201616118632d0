"""One request's record: its state machine and everything measured about it.

    RECEIVED ──► QUEUED ──► DISPATCHED ──► STREAMING ──► DONE
        │           ▲ retry on    │   ▲           │ ▲
        │           └─another ────┘   └─resumed── SUSPENDED   (cut for a better class, queued)
        └───────────┴─replica────┴──────────────┴───────► DONE   (with a cause other than ok)

The record is created when the request arrives and written once, when it ends, to the access
log, the metrics, the usage store and, with ``[tracing]``, the request's spans (observe/tracing.py
builds them all from the record: its time stamps are the spans' ends). Times are
``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import enum
import os
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from passerelle.errors import Cause


class State(enum.Enum):
    RECEIVED = "received"  # read and validated the body
    QUEUED = "queued"  # waiting in passerelle's queue for a backend slot
    DISPATCHED = "dispatched"  # sent to a backend, no content yet
    STREAMING = "streaming"  # content is flowing to the client
    SUSPENDED = "suspended"  # its stream was cut upstream for a better class; queued to resume
    DONE = "done"

    # Members are singletons compared by identity: hashed by identity too (Enum's own hash is a
    # Python function hashing the name, run on every transition check of every request).
    __hash__ = object.__hash__


_ALLOWED = {
    State.RECEIVED: {State.QUEUED, State.DISPATCHED, State.DONE},
    State.QUEUED: {State.DISPATCHED, State.DONE},
    State.DISPATCHED: {State.STREAMING, State.QUEUED, State.SUSPENDED, State.DONE},  # QUEUED: retry elsewhere
    State.STREAMING: {State.SUSPENDED, State.DONE},
    State.SUSPENDED: {State.DISPATCHED, State.STREAMING, State.DONE},  # resumed as a continuation
    State.DONE: set(),
}


def clip(text: str, limit: int = 256) -> str:
    """``text`` cut to ``limit`` characters, ``…`` marking the cut. A record's strings that a client
    chose (a model id, an error message quoting it) leave the request through this: the access log,
    the usage store and the dashboard keep 256 characters of an 8 MiB model name, not 8 MiB a line.

    >>> clip("m" * 300)[-3:], len(clip("m" * 300))
    ('mm…', 256)
    """
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Attempt(NamedTuple):
    """An attempt that ended with another to follow: retried on another replica, or its stream
    cut for a better class and resumed later (the last attempt is the record's own fields)."""

    backend: str
    t_sent: float
    t_ended: float
    error: str = ""  # its cause, when it failed
    message: str = ""
    cut: bool = False


def new_request_id() -> str:
    return "req_" + os.urandom(12).hex()


@dataclass(slots=True)
class RequestRecord:
    id: str
    endpoint: str
    client: str = ""
    t_arrival: float = field(default_factory=time.perf_counter)
    state: State = State.RECEIVED
    model: str = ""
    stream: bool = False
    priority: str = "standard"
    tenant: str = "anonymous"
    key_id: str = ""  # the API key's id (never its secret); "" without a key
    user: str = ""  # the person a trusted front-end forwarded (bounded); "" for none
    user_name: str = ""  # ...and their name and email as it sent them (clipped), for usage reports
    user_email: str = ""
    task: str = ""  # the front-end's background task this request is (proxy/frontend.py); "" for none
    session: str = ""  # the session the client named, hashed (proxy/intake.py session_of); "" for none
    backend: str = ""
    slot: int | None = None  # the runtime's slot it ran in, where passerelle names it (llama-server)
    max_tokens: int | None = None
    status: int = 0
    cause: Cause | None = None
    error: str = ""
    t_queued: float = 0.0
    t_dispatch: float = 0.0
    t_sent: float = 0.0  # the current attempt was sent to ``backend``; 0 between attempts
    t_first: float = 0.0  # first content chunk sent to the client
    t_last: float = 0.0  # last content chunk sent
    t_end: float = 0.0
    content_chunks: int = 0
    # between content chunks, seconds; C doubles rather than a list of float objects (a quarter of
    # the memory, nothing for the garbage collector to scan)
    gaps: array[float] = field(default_factory=lambda: array("d"))
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    usage_from_server: bool = False
    cached_tokens: int | None = None  # prompt tokens the runtime took from its cache, as it reported them
    retries: int = 0
    suspensions: int = 0  # times its stream was cut for a better class and resumed
    suspended_s: float = 0.0  # time spent suspended, waiting to resume
    resume_prompt_tokens: int = 0  # prompt tokens the runtime processed again to resume (not cached)
    suspended_at: list[int] | None = None  # tokens generated when each cut came; None: never cut
    earlier: list[Attempt] | None = None  # attempts before the current one (retries, cuts); None: none
    # tool calls left as text by the runtime ([[models]] tool_calls, proxy/repair.py): the format ("" when
    # repair was off for the request), calls delivered as tool calls, markup passed through as text and why
    tool_call_format: str = ""
    tool_calls_repaired: int = 0
    tool_calls_unrepaired: int = 0
    tool_call_failure: str = ""
    cold: bool = False  # no replica of its pool was up when it came: its wait includes a start or a swap
    # the body as read, until the record is accounted (held by the request anyway): [tracing] record_prompts
    body: bytes = b""
    trace: Any = None  # its trace context (observe/tracing.py TraceContext) when [tracing] is on, else None

    def to(self, state: State) -> None:
        if state not in _ALLOWED[self.state]:
            raise RuntimeError(f"request {self.id}: illegal transition {self.state.name} -> {state.name}")
        self.state = state

    def finish(self, cause: Cause, status: int, error: str = "") -> None:
        """Set the one termination cause; the first call wins (later ones are consequences)."""
        if self.cause is None:
            self.cause, self.status, self.error = cause, status, error
            self.t_end = time.perf_counter()
            self.state = State.DONE

    def attempt_ended(self, t: float, error: str = "", message: str = "", *, cut: bool = False) -> None:
        """The current attempt ended at ``t`` and another may follow (a retry, a resume): kept as
        plain data, for the trace. (Rare: most requests make one attempt and never come here.)"""
        done = Attempt(self.backend, self.t_sent, t, error, message, cut)
        if self.earlier is None:
            self.earlier = [done]
        else:
            self.earlier.append(done)
        self.t_sent = 0.0

    @property
    def ttft(self) -> float | None:
        return self.t_first - self.t_arrival if self.t_first else None

    @property
    def queue_wait(self) -> float:
        return (self.t_dispatch or self.t_end) - self.t_queued if self.t_queued else 0.0

    @property
    def duration(self) -> float:
        return (self.t_end or time.perf_counter()) - self.t_arrival

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.content_chunks
