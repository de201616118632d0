"""OpenTelemetry traces of requests, after the GenAI semantic conventions, sent over OTLP/HTTP.

One span per request (kind SERVER, named ``"{operation} {model}"``), its children for the wait in
passerelle's queue (``queue``, one per attempt), a wait for a runtime to start or be swapped in
(``swap``: no replica of the pool was up when the request came), each try on a runtime
(``"{operation} {model}"``, kind CLIENT, one per attempt), and the time a stream spent suspended
for a better class (``suspended``). A client's W3C ``traceparent`` makes the request's span its
child (and its sampled flag is followed); each attempt sends its own ``traceparent`` to the
runtime, so a runtime that traces (vLLM) joins the trace.

The tracer takes no part in the request's flow. It is a listener of the finished
:class:`~passerelle.observe.record.RequestRecord`, as the metrics, the access log and the usage
store are: the record's time stamps (arrival, queued, each attempt sent and ended, first token,
end) and its earlier attempts are plain data the gateway keeps anyway, and :meth:`RequestTracer.observe`
makes every span from them, once the request is over. The request itself carries only its
:class:`TraceContext` (``rec.trace``: the trace's ids, made by :meth:`RequestTracer.begin` from the
client's headers), from which each attempt takes the ``traceparent`` it sends (proxy/attempt.py).

Finished spans are tuples (``SPAN_FIELDS``) handed to the exporter (observe/span_pipe.py), whose
child process (observe/otlp_export.py, started again when it dies) encodes and sends them, so that
neither OpenTelemetry's span objects nor the protobuf encoding and the HTTP run on the event
loop's interpreter. The sampler (parent-based,
else by trace id ratio) and the W3C ``traceparent`` are the few lines below: the SDK's propagator
and sampler cost ~12 µs a request against ~1.3 µs.

Off (``[tracing] enabled = false``, the default) nothing here is built and nothing of
OpenTelemetry is imported: the request path checks ``rec.trace is None`` and goes on. The
exporter's child needs the ``otel`` extra (opentelemetry-proto).

Example::

    tracer = RequestTracer(cfg.tracing)        # starts the exporter's child process
    gateway.listeners.append(tracer.observe)   # server/build.py: spans from each finished record
    rec.trace = tracer.begin(scope)            # in Gateway.handle: the trace's ids
    header = rec.trace.traceparent()           # b"00-<trace>-<span>-01": an attempt's, sent upstream
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from typing import Any

from passerelle.config import TracingConfig
from passerelle.endpoints import BY_NAME
from passerelle.errors import Cause, ConfigError
from passerelle.observe.record import Attempt, RequestRecord

# GenAI operation names (gen_ai.operation.name) by the gateway's endpoint
_OPERATIONS = {"chat": "chat", "responses": "chat", "messages": "chat", "completions": "text_completion",
               "infill": "text_completion", "embeddings": "embeddings"}
PROMPT_CHARS = 4096  # a recorded prompt (record_prompts) is cut to this

# A finished span: a plain tuple of these (marshal-able, cheap to build), OTLP's own enum values.
SPAN_FIELDS = ("trace_id", "span_id", "parent_span_id", "name", "kind", "start_ns", "end_ns", "attributes",
               "status", "status_message", "events", "trace_state")
Span = tuple[bytes, bytes, bytes, str, int, int, int, dict[str, Any], int, str, list[Any], str]
INTERNAL, SERVER, CLIENT = 1, 2, 3  # Span.SpanKind
STATUS_ERROR = 2  # Status.StatusCode
_BITS64 = (1 << 64) - 1
_getrandbits = random.getrandbits
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def operation_of(endpoint: str) -> str:
    return _OPERATIONS.get(endpoint, endpoint)


def finish_reasons(rec: RequestRecord) -> list[str]:
    """What ended the generation, from the record: ``length`` when the output reached
    ``max_tokens``, ``stop`` otherwise; an error's termination cause when it did not end well
    (the runtime's own reason is not decoded from the stream: that would cost every request)."""
    if rec.cause is not Cause.OK:
        return [rec.cause.value if rec.cause is not None else "error"]
    if rec.max_tokens and rec.completion_tokens is not None and rec.completion_tokens >= rec.max_tokens:
        return ["length"]
    return ["stop"]


def parse_traceparent(value: str) -> tuple[bytes, bytes, bool] | None:
    """A W3C ``traceparent``'s trace id, parent span id and sampled flag; None when it is not one
    (then the request starts a trace of its own). A later version's extra fields are allowed."""
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None or m[1] == "ff" or (m[1] == "00" and m[5]):
        return None
    trace_id, span_id = bytes.fromhex(m[2]), bytes.fromhex(m[3])
    if not any(trace_id) or not any(span_id):
        return None
    return trace_id, span_id, bool(int(m[4], 16) & 1)


def start_tracer(cfg: TracingConfig, source: str = "") -> RequestTracer:
    """The tracer for ``[tracing]``; a ConfigError naming the extra when OpenTelemetry is missing."""
    try:
        return RequestTracer(cfg)
    except ImportError as exc:
        raise ConfigError(f"[tracing] enabled needs OpenTelemetry ({exc.name} is missing): "
                          "pip install 'passerelle[otel]'", file=source or None, key="tracing.enabled") from None


class RequestTracer:
    """The sampler and the exporter for ``[tracing]``: :meth:`begin` opens a request's trace,
    :meth:`observe` (a listener of finished records) makes its spans and hands them on."""

    def __init__(self, cfg: TracingConfig, exporter: Callable[[list[Span]], None] | None = None) -> None:
        """``exporter``: called with each request's finished spans, in place of the OTLP/HTTP child."""
        self.cfg = cfg
        self._bound = round(cfg.sample_ratio * (1 << 64))  # a new trace is kept when its low 64 bits are under it
        self.pipe = None
        if exporter is None:
            from passerelle.observe.span_pipe import SpanPipe

            self.pipe = SpanPipe(cfg)
            exporter = self.pipe.submit
        self.export = exporter

    def begin(self, scope: dict[str, Any]) -> TraceContext:
        """The trace of the request ``scope`` opens: the client's, or one of its own."""
        parent = None
        state = ""
        for k, v in scope.get("headers", ()):
            if k == b"traceparent":
                parent = parse_traceparent(v.decode("latin-1"))
            elif k == b"tracestate":
                state = v.decode("latin-1")
        if parent is not None:
            trace_id, parent_id, sampled = parent
        else:
            n = _getrandbits(128) or 1
            trace_id, parent_id, sampled, state = n.to_bytes(16, "big"), b"", (n & _BITS64) < self._bound, ""
        return TraceContext(trace_id, parent_id, sampled, state, scope.get("method", "POST"), scope.get("path", ""))

    def observe(self, rec: RequestRecord) -> None:
        """A finished request's spans, made from its record, to the exporter (sampled traces only)."""
        ctx = rec.trace
        if ctx is None or not ctx.sampled or rec.cause is None:
            return
        self.export(spans_of(rec, ctx, self.cfg.record_prompts))

    def shutdown(self) -> None:
        """Send what is buffered (within a deadline), then stop the exporter's child."""
        if self.pipe is not None:
            self.pipe.shutdown()


def _span_id() -> bytes:
    return (_getrandbits(64) or 1).to_bytes(8, "big")


class TraceContext:
    """One request's trace ids, all it carries through its life (``rec.trace``); a sampled-out
    trace records nothing but still sends ``traceparent`` (flag 00) to the runtime."""

    __slots__ = ("attempts", "method", "parent_id", "path", "sampled", "state", "trace_id")

    def __init__(self, trace_id: bytes, parent_id: bytes, sampled: bool, state: str, method: str, path: str) -> None:
        self.trace_id, self.parent_id, self.sampled, self.state = trace_id, parent_id, sampled, state
        self.method, self.path = method, path
        self.attempts: list[bytes] = []  # each attempt's span id, in order

    def traceparent(self) -> bytes:
        """A new attempt's span id, as the ``traceparent`` header value sent with it."""
        span_id = _span_id()
        self.attempts.append(span_id)
        return b"00-%s-%s-%s" % (self.trace_id.hex().encode(), span_id.hex().encode(), b"01" if self.sampled else b"00")


def spans_of(rec: RequestRecord, ctx: TraceContext, record_prompts: bool = False) -> list[Span]:
    """The spans of the finished request ``rec`` (the module docstring's), children first.

    Its attempts are the record's earlier ones (retried, or cut and resumed) and its last one, sent
    at ``t_sent`` and ended with the request; each waited in the queue from the end of the one
    before (the first from ``t_queued``), a cut one also suspended until the next was sent."""
    now_ns, now = time.time_ns(), time.perf_counter()

    def ns(t: float) -> int:  # the record's perf_counter() seconds, as the wall clock's nanoseconds
        return now_ns - int((now - t) * 1e9)

    tid, root_id, state, op, model = ctx.trace_id, _span_id(), ctx.state, operation_of(rec.endpoint), rec.model
    spans: list[Span] = []

    def child(name: str, start: float, end: float, attrs: dict[str, Any], kind: int = INTERNAL,
              status: int = 0, message: str = "", span_id: bytes = b"") -> None:
        spans.append((tid, span_id or _span_id(), root_id, name, kind, ns(start), ns(end), attrs, status, message,
                      [], state))

    t_end = rec.t_end
    failed = rec.cause is not Cause.OK
    attempts = list(rec.earlier or ())
    if rec.t_sent:  # the last attempt: it ended with the request
        attempts.append(Attempt(rec.backend, rec.t_sent, t_end, rec.cause.value if failed and rec.cause else "",
                                rec.error))
    endpoint = BY_NAME.get(rec.endpoint)
    queued = endpoint is None or endpoint.scheduled  # (the others go to the least busy replica up)
    waited_from = rec.t_queued
    for i, a in enumerate(attempts):
        if queued and waited_from:
            child("queue", waited_from, a.t_sent, {"passerelle.backend": a.backend})
        if i == 0 and rec.cold and rec.t_queued:
            child("swap", rec.t_queued, a.t_sent, {"passerelle.backend": a.backend})
        attrs: dict[str, Any] = {"gen_ai.operation.name": op, "gen_ai.request.model": model,
                                 "passerelle.backend": a.backend, "passerelle.attempt": i + 1}
        status, message = 0, ""
        if a.cut:
            attrs["passerelle.suspended"] = True
            # (a cut attempt is never the last: the next one resumed it, or the request ended suspended)
            child("suspended", a.t_ended, attempts[i + 1].t_sent if i + 1 < len(attempts) else t_end, {})
        elif a.error:
            attrs["error.type"] = a.error
            status, message = STATUS_ERROR, a.message[:256]
        child(f"{op} {model}", a.t_sent, a.t_ended, attrs, CLIENT, status, message,
              ctx.attempts[i] if i < len(ctx.attempts) else b"")
        waited_from = a.t_ended
    if not rec.t_sent and waited_from:  # it ended waiting for a replica (the first, or the next)
        if queued:
            child("queue", waited_from, t_end, {})
        if not attempts and rec.cold:
            child("swap", waited_from, t_end, {})
    attrs = {"gen_ai.operation.name": op, "passerelle.request_id": rec.id, "passerelle.endpoint": rec.endpoint,
             "http.request.method": ctx.method, "url.path": ctx.path, "gen_ai.request.model": model,
             "passerelle.priority": rec.priority, "passerelle.tenant": rec.tenant,
             "passerelle.cause": rec.cause.value if rec.cause else "", "http.response.status_code": rec.status,
             "gen_ai.response.finish_reasons": finish_reasons(rec)}
    for name, value in (("gen_ai.request.max_tokens", rec.max_tokens),
                        ("gen_ai.usage.input_tokens", rec.prompt_tokens),
                        ("gen_ai.usage.output_tokens", rec.completion_tokens),
                        ("passerelle.backend", rec.backend or None),
                        ("passerelle.retries", rec.retries or None),
                        ("passerelle.suspensions", rec.suspensions or None)):
        if value is not None:
            attrs[name] = value
    status, message = 0, ""
    if failed:
        status, message = STATUS_ERROR, rec.error[:256]
        attrs["error.type"] = rec.cause.value if rec.cause else "error"
    events: list[Any] = []
    if record_prompts and rec.body:
        text = rec.body[: PROMPT_CHARS * 4].decode("utf-8", "replace")[:PROMPT_CHARS]
        events.append(("gen_ai.content.prompt", ns(rec.t_arrival), {"gen_ai.prompt": text}))
    spans.append((tid, root_id, ctx.parent_id, f"{op} {model}" if model else op, SERVER, ns(rec.t_arrival),
                  ns(t_end), attrs, status, message, events, state))
    return spans
