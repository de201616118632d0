"""OpenTelemetry traces of requests, after the GenAI semantic conventions, sent over OTLP/HTTP.

One span per request (kind SERVER, named ``"{operation} {model}"``), its children for the wait in
passerelle's queue (``queue``), a wait for a runtime to start or be swapped in (``swap``), each
try on a runtime (``"{operation} {model}"``, kind CLIENT, one per attempt), and the time a
stream spent suspended for a better class (``suspended``). A client's W3C ``traceparent`` makes
the request's span its child (and its sampled flag is followed); each attempt sends its own
``traceparent`` to the runtime, so a runtime that traces (vLLM) joins the trace.

Off (``[tracing] enabled = false``, the default) nothing here is built and nothing of
OpenTelemetry is imported: the request path checks ``rec.trace is None`` and goes on. The
OpenTelemetry SDK and exporter come with the ``otel`` extra.

Example::

    tracer = RequestTracer(cfg.tracing)        # imports the SDK, starts the exporter's thread
    trace = tracer.begin(scope, rec)           # in Gateway.handle
    trace.queue_started(); trace.queue_ended(backend.name)
    header = trace.attempt_started(backend.name)  # b"00-<trace>-<span>-01", sent upstream
    trace.attempt_ended(error=None)
    trace.end(rec)                             # in Gateway.account
"""

from __future__ import annotations

from typing import Any

from passerelle.config import TracingConfig
from passerelle.errors import Cause, ConfigError
from passerelle.observe.record import RequestRecord

# GenAI operation names (gen_ai.operation.name) by the gateway's endpoint
_OPERATIONS = {"chat": "chat", "responses": "chat", "messages": "chat", "completions": "text_completion",
               "infill": "text_completion", "embeddings": "embeddings"}
PROMPT_CHARS = 4096  # a recorded prompt (record_prompts) is cut to this


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


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return str(v.decode("latin-1"))
    return None


def start_tracer(cfg: TracingConfig, source: str = "") -> RequestTracer:
    """The tracer for ``[tracing]``; a ConfigError naming the extra when OpenTelemetry is missing."""
    try:
        return RequestTracer(cfg)
    except ImportError as exc:
        raise ConfigError(f"[tracing] enabled needs OpenTelemetry ({exc.name} is missing): "
                          "pip install 'passerelle[otel]'", file=source or None, key="tracing.enabled") from None


class RequestTracer:
    """The tracer provider, exporter and sampler for ``[tracing]``; :meth:`begin` opens a request's
    trace."""

    def __init__(self, cfg: TracingConfig, exporter: Any = None) -> None:
        """``exporter``: a span exporter to use in place of OTLP/HTTP (spans then go one by one)."""
        # imported here only: with tracing off, none of this is loaded
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from passerelle import __version__

        self.cfg = cfg
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name, "service.version": __version__}),
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
        self.provider.add_span_processor(
            SimpleSpanProcessor(exporter) if exporter is not None
            else BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.endpoint, timeout=10)))
        self.tracer = self.provider.get_tracer("passerelle", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.SpanKind, self.Status, self.StatusCode = SpanKind, Status, StatusCode
        self.in_context = set_span_in_context

    def begin(self, scope: dict[str, Any], rec: RequestRecord) -> RequestTrace:
        carrier = {k: v for k in ("traceparent", "tracestate") if (v := _header(scope, k.encode())) is not None}
        parent = self.propagator.extract(carrier) if carrier else None
        op = operation_of(rec.endpoint)
        span = self.tracer.start_span(op, context=parent, kind=self.SpanKind.SERVER, attributes={
            "gen_ai.operation.name": op, "passerelle.request_id": rec.id, "passerelle.endpoint": rec.endpoint,
            "http.request.method": scope.get("method", "POST"), "url.path": scope.get("path", "")})
        return RequestTrace(self, span, op)

    def shutdown(self) -> None:
        """Send what is buffered, then stop the exporter's thread."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans; every method is called from the request's own task."""

    __slots__ = ("_attempt", "_attempts", "_queue", "_suspended", "_swap", "context", "op", "span", "traceparent",
                 "tracer")

    def __init__(self, tracer: RequestTracer, span: Any, op: str) -> None:
        self.tracer, self.span, self.op = tracer, span, op
        self.context = tracer.in_context(span)
        self._queue: Any = None
        self._swap: Any = None
        self._attempt: Any = None
        self._suspended: Any = None
        self._attempts = 0
        self.traceparent = b""  # the current attempt's, sent to the runtime

    def _child(self, name: str, **attributes: Any) -> Any:
        return self.tracer.tracer.start_span(name, context=self.context, attributes=attributes or None)

    def prompt(self, body: bytes) -> None:
        """The request body as a span event, when [tracing] record_prompts says so."""
        if not self.tracer.cfg.record_prompts:
            return
        text = body[: PROMPT_CHARS * 4].decode("utf-8", "replace")[:PROMPT_CHARS]
        self.span.add_event("gen_ai.content.prompt", {"gen_ai.prompt": text})

    def queue_started(self, *, swap: bool) -> None:
        """Queued for a replica; ``swap``: none is up, the wait includes starting or swapping one in."""
        self._queue = self._child("queue")
        if swap:
            self._swap = self._child("swap")

    def queue_ended(self, backend: str) -> None:
        if self._swap is not None:
            self._swap.set_attribute("passerelle.backend", backend)
            self._swap.end()
            self._swap = None
        if self._queue is not None:
            self._queue.set_attribute("passerelle.backend", backend)
            self._queue.end()
            self._queue = None
        if self._suspended is not None:
            self._suspended.end()
            self._suspended = None

    def attempt_started(self, backend: str, model: str) -> bytes:
        """A try on ``backend``: its span, and the ``traceparent`` header value to send with it."""
        self._attempts += 1
        self._attempt = span = self.tracer.tracer.start_span(
            f"{self.op} {model}", context=self.context, kind=self.tracer.SpanKind.CLIENT, attributes={
                "gen_ai.operation.name": self.op, "gen_ai.request.model": model, "passerelle.backend": backend,
                "passerelle.attempt": self._attempts})
        ctx = span.get_span_context()
        self.traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}".encode()
        return self.traceparent

    def attempt_ended(self, error: BaseException | None, *, suspended: bool = False) -> None:
        span, self._attempt = self._attempt, None
        if span is None:
            return
        if suspended:
            span.set_attribute("passerelle.suspended", True)
        elif error is not None:
            span.set_status(self.tracer.Status(self.tracer.StatusCode.ERROR, str(error)[:256]))
            span.set_attribute("error.type", type(error).__name__)
        span.end()

    def suspended(self) -> None:
        """Cut for a better class: waiting to resume (ends when a replica is granted again)."""
        self._suspended = self._child("suspended")

    def end(self, rec: RequestRecord) -> None:
        for span in (self._attempt, self._swap, self._queue, self._suspended):
            if span is not None:
                span.end()
        s = self.span
        op = self.op
        model = rec.model
        s.update_name(f"{op} {model}" if model else op)
        attrs: dict[str, Any] = {"gen_ai.request.model": model, "passerelle.priority": rec.priority,
                                 "passerelle.tenant": rec.tenant, "passerelle.cause": rec.cause.value if rec.cause
                                 else "", "http.response.status_code": rec.status,
                                 "gen_ai.response.finish_reasons": finish_reasons(rec)}
        for name, value in (("gen_ai.request.max_tokens", rec.max_tokens),
                            ("gen_ai.usage.input_tokens", rec.prompt_tokens),
                            ("gen_ai.usage.output_tokens", rec.completion_tokens),
                            ("passerelle.backend", rec.backend or None),
                            ("passerelle.retries", rec.retries or None),
                            ("passerelle.suspensions", rec.suspensions or None)):
            if value is not None:
                attrs[name] = value
        s.set_attributes(attrs)
        if rec.cause is not Cause.OK:
            s.set_status(self.tracer.Status(self.tracer.StatusCode.ERROR, rec.error[:256]))
            s.set_attribute("error.type", rec.cause.value if rec.cause else "error")
        s.end()
