"""observe/tracing.py's spans, encoded as the exporter's child sends them (observe/otlp_export.py
request_of) and decoded with opentelemetry-proto: retries make one attempt span each (the failed
one marked as an error), a wait with no replica up is a swap, a suspension has its span, and the
request's span carries the GenAI attributes; a client's traceparent and sampling are followed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from passerelle.config import TracingConfig
from passerelle.errors import Cause, UpstreamError
from passerelle.observe.otlp_export import request_of
from passerelle.observe.record import RequestRecord
from passerelle.observe.tracing import RequestTracer, finish_reasons, operation_of, parse_traceparent

SERVER, CLIENT, ERROR = 2, 3, 2  # OTLP's Span.SpanKind and Status.StatusCode values


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def decode(tuples: list) -> list[SimpleNamespace]:
    """The spans as a collector gets them: encoded, serialized and parsed back."""
    sent = request_of(tuples, {"service.name": "passerelle"}, "0").SerializeToString()
    req = ExportTraceServiceRequest.FromString(sent)
    (rs,) = req.resource_spans
    assert {a.key: _value(a.value) for a in rs.resource.attributes}["service.name"] == "passerelle"
    return [SimpleNamespace(name=s.name, kind=s.kind, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                            parent=s.parent_span_id.hex(), status=s.status.code, start=s.start_time_unix_nano,
                            end=s.end_time_unix_nano, attributes={a.key: _value(a.value) for a in s.attributes},
                            events=[(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events])
            for ss in rs.scope_spans for s in ss.spans]


class Spans(list):
    def finished(self) -> list[SimpleNamespace]:
        return decode(list(self))


@pytest.fixture
def spans():
    exporter = Spans()
    tracer = RequestTracer(TracingConfig(enabled=True), exporter=exporter.extend)
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
    got = exporter.finished()
    root = next(s for s in got if s.kind == SERVER)
    assert all(s.parent == root.span_id and s.trace_id == root.trace_id for s in got if s is not root)
    assert all(root.start <= s.start <= s.end <= root.end for s in got)
    names = sorted(s.name for s in got if s is not root)
    assert names == ["chat m", "chat m", "chat m", "queue", "queue", "queue", "suspended", "swap"]
    attempts = [s for s in got if s.kind == CLIENT]
    assert [s.attributes["passerelle.backend"] for s in attempts] == ["b1", "b2", "b2"]
    assert attempts[0].status == ERROR and attempts[1].status == attempts[2].status == 0
    assert attempts[0].attributes["error.type"] == "UpstreamError"
    assert attempts[1].attributes["passerelle.suspended"] is True
    assert first.split(b"-")[2].decode() == attempts[0].span_id and first.endswith(b"-01")
    assert second.split(b"-")[1].decode() == root.trace_id
    assert root.parent == ""  # no traceparent from the client: a trace of its own
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
    got = {s.name: s for s in exporter.finished()}
    assert set(got) == {"queue", "text_completion m"}
    root = got["text_completion m"]
    assert root.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" and root.parent == "00f067aa0ba902b7"
    assert root.status == ERROR and root.attributes["error.type"] == "queue_timeout"
    assert root.attributes["gen_ai.response.finish_reasons"] == ("queue_timeout",)


def test_prompts_are_recorded_only_when_configured():
    got = []
    for record in (False, True):
        exporter = Spans()
        tracer = RequestTracer(TracingConfig(enabled=True, record_prompts=record), exporter=exporter.extend)
        rec = RequestRecord(id="r", endpoint="chat", model="m")
        t = tracer.begin(scope(), rec)
        t.prompt(b'{"messages": [{"content": "' + b"x" * 10000 + b'"}]}')
        rec.finish(Cause.OK, 200)
        t.end(rec)
        got += exporter.finished()
        tracer.shutdown()
    off, on = got
    assert not off.events
    assert on.events[0][0] == "gen_ai.content.prompt" and len(on.events[0][1]["gen_ai.prompt"]) == 4096


def test_names():
    assert operation_of("messages") == "chat" and operation_of("embeddings") == "embeddings"
    rec = RequestRecord(id="r", endpoint="chat", max_tokens=10, completion_tokens=3)
    rec.finish(Cause.OK, 200)
    assert finish_reasons(rec) == ["stop"]


def test_a_client_traceparent_decides_sampling_and_is_followed_when_not_sampled():
    exporter = Spans()
    tracer = RequestTracer(TracingConfig(enabled=True, sample_ratio=0.0), exporter=exporter.extend)
    tid = "0af7651916cd43dd8448eb211c80319c"
    for header, sampled in ((f"00-{tid}-b7ad6b7169203331-00", False), (f"00-{tid}-b7ad6b7169203331-01", True),
                            (None, False)):  # ratio 0: a trace of the gateway's own is never kept
        rec = RequestRecord(id="r", endpoint="chat", model="m")
        t = tracer.begin(scope(**({"traceparent": header} if header else {})), rec)
        t.queue_started(swap=False)
        t.queue_ended("b1")
        sent = t.attempt_started("b1", "m").decode()
        t.attempt_ended(None)
        rec.finish(Cause.OK, 200)
        t.end(rec)
        assert sent.endswith("-01" if sampled else "-00") and (header is None or sent.split("-")[1] == tid)
        assert len(sent) == 55 and sent.split("-")[2] not in ("b7ad6b7169203331", "0" * 16)
    assert sorted(s.name for s in exporter.finished()) == ["chat m", "chat m", "queue"]  # the sampled one only
    kept = RequestTracer(TracingConfig(enabled=True, sample_ratio=1.0), exporter=exporter.extend)
    assert kept.begin(scope(), RequestRecord(id="r", endpoint="chat")).sampled


def test_traceparent_parsing():
    tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    assert parse_traceparent(f"00-{tid}-{sid}-01") == (bytes.fromhex(tid), bytes.fromhex(sid), True)
    assert parse_traceparent(f" 00-{tid}-{sid}-02 ") == (bytes.fromhex(tid), bytes.fromhex(sid), False)
    assert parse_traceparent(f"01-{tid}-{sid}-01-later") is not None  # a later version's extra field
    for bad in (f"00-{tid}-{sid}-01-extra", f"ff-{tid}-{sid}-01", f"00-{'0' * 32}-{sid}-01",
                f"00-{tid}-{'0' * 16}-01", f"00-{tid.upper()}-{sid}-01", f"00-{tid[:-1]}-{sid}-01", "", "garbage",
                f"00-{tid}-{sid}-0x", f"00-{tid[:30]} 1-{sid}-01"):
        assert parse_traceparent(bad) is None, bad
