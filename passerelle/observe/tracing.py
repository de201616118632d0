"""OpenTelemetry traces of requests, after the GenAI semantic conventions, sent over OTLP/HTTP.

One span per request (kind SERVER, named ``"{operation} {model}"``), its children for the wait in
passerelle's queue (``queue``), a wait for a runtime to start or be swapped in (``swap``), each
try on a runtime (``"{operation} {model}"``, kind CLIENT, one per attempt), and the time a
stream spent suspended for a better class (``suspended``). A client's W3C ``traceparent`` makes
the request's span its child (and its sampled flag is followed); each attempt sends its own
``traceparent`` to the runtime, so a runtime that traces (vLLM) joins the trace.

The request path records only plain data: random ids, ``time.time_ns()`` stamps and a small dict
of attributes per span; a finished request's spans are tuples (``SPAN_FIELDS``) handed to the
exporter (observe/otlp_export.py), which encodes and sends them from a child process, so that
neither OpenTelemetry's span objects nor the protobuf encoding and the HTTP run on the event
loop's interpreter. The sampler (parent-based, else by trace id ratio) and the W3C
``traceparent`` are the few lines below: the SDK's propagator and sampler cost ~12 µs a request
against ~1.3 µs.

Off (``[tracing] enabled = false``, the default) nothing here is built and nothing of
OpenTelemetry is imported: the request path checks ``rec.trace is None`` and goes on. The
exporter's child needs the ``otel`` extra (opentelemetry-proto).

Example::

    tracer = RequestTracer(cfg.tracing)        # starts the exporter's child process
    trace = tracer.begin(scope, rec)           # in Gateway.handle
    trace.queue_started(swap=False); trace.queue_ended(backend.name)
    header = trace.attempt_started(backend.name, model)  # b"00-<trace>-<span>-01", sent upstream
    trace.attempt_ended(error=None)
    trace.end(rec)                             # in Gateway.account: the spans go to the exporter
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable
from typing import Any

from passerelle.config import TracingConfig
from passerelle.errors import Cause, ConfigError
from passerelle.observe.record import RequestRecord

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
    """The sampler and the exporter for ``[tracing]``; :meth:`begin` opens a request's trace."""

    def __init__(self, cfg: TracingConfig, exporter: Callable[[list[Span]], None] | None = None) -> None:
        """``exporter``: called with each request's finished spans, in place of the OTLP/HTTP child."""
        self.cfg = cfg
        self._bound = round(cfg.sample_ratio * (1 << 64))  # a new trace is kept when its low 64 bits are under it
        self.pipe = None
        if exporter is None:
            from passerelle.observe.otlp_export import SpanPipe

            self.pipe = SpanPipe(cfg)
            exporter = self.pipe.submit
        self.export = exporter

    def begin(self, scope: dict[str, Any], rec: RequestRecord) -> RequestTrace:
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
        return RequestTrace(self, trace_id, parent_id, sampled, state, rec.id, rec.endpoint,
                            scope.get("method", "POST"), scope.get("path", ""))

    def shutdown(self) -> None:
        """Send what is buffered (within a deadline), then stop the exporter's child."""
        if self.pipe is not None:
            self.pipe.shutdown()


def _span_id() -> bytes:
    return (_getrandbits(64) or 1).to_bytes(8, "big")


class RequestTrace:
    """One request's spans as plain data; every method is called from the request's own task.
    An open span is a list ``[span_id, name, kind, start_ns, attributes]``; a sampled-out trace
    records nothing but still sends ``traceparent`` (flag 00) to the runtime."""

    __slots__ = ("_attempt", "_attempts", "_queue", "_suspended", "_swap", "attributes", "events", "op", "parent_id",
                 "sampled", "span_id", "spans", "start_ns", "state", "trace_id", "traceparent", "tracer")

    def __init__(self, tracer: RequestTracer, trace_id: bytes, parent_id: bytes, sampled: bool, state: str,
                 request_id: str, endpoint: str, method: str, path: str) -> None:
        self.tracer, self.trace_id, self.parent_id, self.sampled, self.state = (
            tracer, trace_id, parent_id, sampled, state)
        self.span_id = _span_id()
        self.start_ns = time.time_ns()
        self.op = op = operation_of(endpoint)
        self.attributes: dict[str, Any] = {
            "gen_ai.operation.name": op, "passerelle.request_id": request_id, "passerelle.endpoint": endpoint,
            "http.request.method": method, "url.path": path} if sampled else {}
        self.spans: list[Span] = []
        self.events: list[Any] = []
        self._queue: list[Any] | None = None
        self._swap: list[Any] | None = None
        self._attempt: list[Any] | None = None
        self._suspended: list[Any] | None = None
        self._attempts = 0
        self.traceparent = b""  # the current attempt's, sent to the runtime

    def _open(self, name: str, kind: int = INTERNAL, attributes: dict[str, Any] | None = None) -> list[Any] | None:
        if not self.sampled:
            return None
        return [_span_id(), name, kind, time.time_ns(), attributes if attributes is not None else {}]

    def _close(self, span: list[Any], status: int = 0, message: str = "") -> None:
        self.spans.append((self.trace_id, span[0], self.span_id, span[1], span[2], span[3], time.time_ns(), span[4],
                           status, message, [], self.state))

    def prompt(self, body: bytes) -> None:
        """The request body as a span event, when [tracing] record_prompts says so."""
        if not self.tracer.cfg.record_prompts or not self.sampled:
            return
        text = body[: PROMPT_CHARS * 4].decode("utf-8", "replace")[:PROMPT_CHARS]
        self.events.append(("gen_ai.content.prompt", time.time_ns(), {"gen_ai.prompt": text}))

    def queue_started(self, *, swap: bool) -> None:
        """Queued for a replica; ``swap``: none is up, the wait includes starting or swapping one in."""
        self._queue = self._open("queue")
        if swap:
            self._swap = self._open("swap")

    def queue_ended(self, backend: str) -> None:
        if self._swap is not None:
            self._swap[4]["passerelle.backend"] = backend
            self._close(self._swap)
            self._swap = None
        if self._queue is not None:
            self._queue[4]["passerelle.backend"] = backend
            self._close(self._queue)
            self._queue = None
        if self._suspended is not None:
            self._close(self._suspended)
            self._suspended = None

    def attempt_started(self, backend: str, model: str) -> bytes:
        """A try on ``backend``: its span, and the ``traceparent`` header value to send with it."""
        self._attempts += 1
        span_id = _span_id()
        if self.sampled:
            self._attempt = [span_id, f"{self.op} {model}", CLIENT, time.time_ns(), {
                "gen_ai.operation.name": self.op, "gen_ai.request.model": model, "passerelle.backend": backend,
                "passerelle.attempt": self._attempts}]
        self.traceparent = b"00-%s-%s-%s" % (self.trace_id.hex().encode(), span_id.hex().encode(),
                                              b"01" if self.sampled else b"00")
        return self.traceparent

    def attempt_ended(self, error: BaseException | None, *, suspended: bool = False) -> None:
        span, self._attempt = self._attempt, None
        if span is None:
            return
        if suspended:
            span[4]["passerelle.suspended"] = True
        elif error is not None:
            span[4]["error.type"] = type(error).__name__
            self._close(span, STATUS_ERROR, str(error)[:256])
            return
        self._close(span)

    def suspended(self) -> None:
        """Cut for a better class: waiting to resume (ends when a replica is granted again)."""
        self._suspended = self._open("suspended")

    def end(self, rec: RequestRecord) -> None:
        if not self.sampled:
            return
        for span in (self._attempt, self._swap, self._queue, self._suspended):
            if span is not None:
                self._close(span)
        model = rec.model
        attrs = self.attributes
        attrs.update({"gen_ai.request.model": model, "passerelle.priority": rec.priority,
                      "passerelle.tenant": rec.tenant, "passerelle.cause": rec.cause.value if rec.cause else "",
                      "http.response.status_code": rec.status, "gen_ai.response.finish_reasons": finish_reasons(rec)})
        for name, value in (("gen_ai.request.max_tokens", rec.max_tokens),
                            ("gen_ai.usage.input_tokens", rec.prompt_tokens),
                            ("gen_ai.usage.output_tokens", rec.completion_tokens),
                            ("passerelle.backend", rec.backend or None),
                            ("passerelle.retries", rec.retries or None),
                            ("passerelle.suspensions", rec.suspensions or None)):
            if value is not None:
                attrs[name] = value
        status, message = 0, ""
        if rec.cause is not Cause.OK:
            status, message = STATUS_ERROR, rec.error[:256]
            attrs["error.type"] = rec.cause.value if rec.cause else "error"
        self.spans.append((self.trace_id, self.span_id, self.parent_id, f"{self.op} {model}" if model else self.op,
                           SERVER, self.start_ns, time.time_ns(), attrs, status, message, self.events, self.state))
        spans, self.spans = self.spans, []
        self.tracer.export(spans)
