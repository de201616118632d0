"""observe/tracing.py's spans, exported to memory: retries make one attempt span each (the failed one
marked as an error), a wait with no replica up is a swap, a suspension has its span, and the
request's span carries the GenAI attributes."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from passerelle.config import TracingConfig
from passerelle.errors import Cause, UpstreamError
from passerelle.observe.record import RequestRecord
from passerelle.observe.tracing import RequestTracer, finish_reasons, operation_of


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(TracingConfig(enabled=True), exporter=exporter)
    yield tracer, exporter
    tracer.shutdown()


def scope(**headers: str) -> dict:
    return {"method": "POST", "path": "/v1/chat/completions",
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}


def test_retries_swaps_and_suspensions_each_have_their_span(spans):
    tracer, exporter = spans
    rec = RequestRecord(id="req_1", endpoint="chat", model="m", max_tokens=8)
    t = tracer.begin(scope(), rec)
    t.queue_started(swap=True)  # no replica up: the wait includes loading one
    t.queue_ended("b1")
    first = t.attempt_started("b1", "m")
    t.attempt_ended(UpstreamError("The model runtime 'b1' is not reachable."))
    t.queue_started(swap=False)
    t.queue_ended("b2")
    second = t.attempt_started("b2", "m")
    t.attempt_ended(None, suspended=True)
    t.suspended()
    t.queue_started(swap=False)
    t.queue_ended("b2")
    t.attempt_started("b2", "m")
    t.attempt_ended(None)
    rec.prompt_tokens, rec.completion_tokens, rec.retries, rec.suspensions = 12, 8, 1, 1
    rec.finish(Cause.OK, 200)
    t.end(rec)
    got = exporter.get_finished_spans()
    root = next(s for s in got if s.kind is SpanKind.SERVER)
    assert all(s.parent.span_id == root.context.span_id for s in got if s is not root)
    names = sorted(s.name for s in got if s is not root)
    assert names == ["chat m", "chat m", "chat m", "queue", "queue", "queue", "suspended", "swap"]
    attempts = [s for s in got if s.kind is SpanKind.CLIENT]
    assert [s.attributes["passerelle.backend"] for s in attempts] == ["b1", "b2", "b2"]
    assert attempts[0].status.status_code is StatusCode.ERROR
    assert attempts[0].attributes["error.type"] == "UpstreamError"
    assert attempts[1].attributes["passerelle.suspended"] is True
    assert first.split(b"-")[2].decode() == format(attempts[0].context.span_id, "016x")
    assert second.split(b"-")[1].decode() == format(root.context.trace_id, "032x")
    a = root.attributes
    assert root.name == "chat m" and a["gen_ai.usage.input_tokens"] == 12 and a["gen_ai.usage.output_tokens"] == 8
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["passerelle.retries"] == 1


def test_an_error_ends_every_open_span_and_marks_the_request(spans):
    tracer, exporter = spans
    rec = RequestRecord(id="req_2", endpoint="completions", model="m")
    t = tracer.begin(scope(traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), rec)
    t.queue_started(swap=False)  # the queue timed out: queue_ended never came
    rec.finish(Cause.QUEUE_TIMEOUT, 503, "no replica in time")
    t.end(rec)
    got = {s.name: s for s in exporter.get_finished_spans()}
    assert set(got) == {"queue", "text_completion m"}
    root = got["text_completion m"]
    assert format(root.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert root.status.status_code is StatusCode.ERROR
    assert root.attributes["gen_ai.response.finish_reasons"] == ("queue_timeout",)


def test_prompts_are_recorded_only_when_configured():
    got = []
    for record in (False, True):
        exporter = InMemorySpanExporter()
        tracer = RequestTracer(TracingConfig(enabled=True, record_prompts=record), exporter=exporter)
        rec = RequestRecord(id="r", endpoint="chat", model="m")
        t = tracer.begin(scope(), rec)
        t.prompt(b'{"messages": [{"content": "' + b"x" * 10000 + b'"}]}')
        rec.finish(Cause.OK, 200)
        t.end(rec)
        got += exporter.get_finished_spans()
        tracer.shutdown()
    off, on = got
    assert not off.events
    assert len(on.events[0].attributes["gen_ai.prompt"]) == 4096


def test_names():
    assert operation_of("messages") == "chat" and operation_of("embeddings") == "embeddings"
    rec = RequestRecord(id="r", endpoint="chat", max_tokens=10, completion_tokens=3)
    rec.finish(Cause.OK, 200)
    assert finish_reasons(rec) == ["stop"]
