"""observe/tracing.py's spans, made from a finished RequestRecord as the gateway leaves it, encoded
as the exporter's child sends them (observe/otlp_export.py request_of) and decoded with
opentelemetry-proto: retries make one attempt span each (the failed one marked as an error), a
wait with no replica up is a swap, a suspension has its span, and the request's span carries the
GenAI attributes; a client's traceparent and sampling are followed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from passerelle.config import TracingConfig
from passerelle.errors import Cause
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


def record(rid: str, endpoint: str = "chat", **fields) -> tuple[RequestRecord, float]:
    """A record as the gateway starts it, and a time 1 s before now to stamp its life from."""
    t0 = time.perf_counter() - 1.0
    return RequestRecord(id=rid, endpoint=endpoint, model="m", t_arrival=t0, **fields), t0


def test_retries_swaps_and_suspensions_each_have_their_span(spans):
    tracer, exporter = spans
    rec, t0 = record("req_1", max_tokens=8)
    rec.trace = t = tracer.begin(scope())
    rec.t_queued, rec.cold = t0 + 0.01, True  # no replica up: the wait includes loading one
    first = t.traceparent()  # each attempt's header, as proxy/attempt.py sends it
    rec.backend, rec.t_sent = "b1", t0 + 0.1
    rec.attempt_ended(t0 + 0.2, "upstream_error", "The model runtime 'b1' is not reachable.")  # retried
    second = t.traceparent()
    rec.backend, rec.t_sent = "b2", t0 + 0.3
    rec.attempt_ended(t0 + 0.4, cut=True)  # suspended for a better class, then resumed
    t.traceparent()
    rec.t_sent = t0 + 0.6
    rec.prompt_tokens, rec.completion_tokens, rec.retries, rec.suspensions = 12, 8, 1, 1
    rec.finish(Cause.OK, 200)
    tracer.observe(rec)
    got = exporter.finished()
    root = next(s for s in got if s.kind == SERVER)
    assert all(s.parent == root.span_id and s.trace_id == root.trace_id for s in got if s is not root)
    assert all(root.start <= s.start <= s.end <= root.end for s in got)
    names = sorted(s.name for s in got if s is not root)
    assert names == ["chat m", "chat m", "chat m", "queue", "queue", "queue", "suspended", "swap"]
    attempts = sorted((s for s in got if s.kind == CLIENT), key=lambda s: s.start)
    assert [s.attributes["passerelle.backend"] for s in attempts] == ["b1", "b2", "b2"]
    assert [s.attributes["passerelle.attempt"] for s in attempts] == [1, 2, 3]
    assert attempts[0].status == ERROR and attempts[1].status == attempts[2].status == 0
    assert attempts[0].attributes["error.type"] == "upstream_error"
    assert attempts[1].attributes["passerelle.suspended"] is True
    assert first.split(b"-")[2].decode() == attempts[0].span_id and first.endswith(b"-01")
    assert second.split(b"-")[1].decode() == root.trace_id and second.split(b"-")[2].decode() == attempts[1].span_id
    queues = sorted((s for s in got if s.name == "queue"), key=lambda s: s.start)
    # each wait ends as its attempt is sent, and begins when the one before ended
    assert [q.end for q in queues] == [a.start for a in attempts]
    assert [q.start for q in queues[1:]] == [a.end for a in attempts[:2]]
    suspended = next(s for s in got if s.name == "suspended")
    assert (suspended.start, suspended.end) == (attempts[1].end, attempts[2].start)
    assert root.parent == ""  # no traceparent from the client: a trace of its own
    assert abs(root.start / 1e9 - (time.time() - (time.perf_counter() - t0))) < 0.5  # the wall clock's time
    a = root.attributes
    assert root.name == "chat m" and a["gen_ai.usage.input_tokens"] == 12 and a["gen_ai.usage.output_tokens"] == 8
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["passerelle.retries"] == 1


def test_an_error_ends_every_open_span_and_marks_the_request(spans):
    tracer, exporter = spans
    rec, t0 = record("req_2", "completions")
    rec.trace = tracer.begin(scope(traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"))
    rec.t_queued = t0 + 0.1  # the queue timed out: no attempt was sent
    rec.finish(Cause.QUEUE_TIMEOUT, 503, "no replica in time")
    tracer.observe(rec)
    got = {s.name: s for s in exporter.finished()}
    assert set(got) == {"queue", "text_completion m"}
    root = got["text_completion m"]
    assert got["queue"].end == root.end
    assert root.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736" and root.parent == "00f067aa0ba902b7"
    assert root.status == ERROR and root.attributes["error.type"] == "queue_timeout"
    assert root.attributes["gen_ai.response.finish_reasons"] == ("queue_timeout",)


def test_a_failed_last_attempt_and_a_stream_that_ended_suspended(spans):
    tracer, exporter = spans
    rec, t0 = record("req_3")
    rec.trace = tracer.begin(scope())
    rec.t_queued, rec.backend, rec.t_sent = t0, "b1", t0 + 0.1
    rec.attempt_ended(t0 + 0.2, cut=True)  # cut; the client left while it waited to resume
    rec.finish(Cause.CLIENT_DISCONNECT, 499, "client disconnected")
    rec2, t2 = record("req_4")
    rec2.trace = tracer.begin(scope())
    rec2.t_queued, rec2.backend, rec2.t_sent = t2, "b1", t2 + 0.1
    rec2.finish(Cause.UPSTREAM_TIMEOUT, 504, "no first token in time")
    tracer.observe(rec)
    tracer.observe(rec2)
    got = exporter.finished()
    mine = [s for s in got if s.trace_id == got[0].trace_id]
    root = next(s for s in mine if s.kind == SERVER)
    assert sorted(s.name for s in mine) == ["chat m", "chat m", "queue", "queue", "suspended"]
    assert all(s.end == root.end for s in mine if s.name in ("queue", "suspended") and s.start > root.start)
    failed = next(s for s in got if s.kind == CLIENT and s.trace_id != root.trace_id)
    assert failed.status == ERROR and failed.attributes["error.type"] == "upstream_timeout"


def test_prompts_are_recorded_only_when_configured():
    got = []
    for record_prompts in (False, True):
        exporter = Spans()
        tracer = RequestTracer(TracingConfig(enabled=True, record_prompts=record_prompts), exporter=exporter.extend)
        rec, _ = record("r")
        rec.trace = tracer.begin(scope())
        rec.body = b'{"messages": [{"content": "' + b"x" * 10000 + b'"}]}'
        rec.finish(Cause.OK, 200)
        tracer.observe(rec)
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
        rec, t0 = record("r")
        rec.trace = t = tracer.begin(scope(**({"traceparent": header} if header else {})))
        rec.t_queued = t0
        sent = t.traceparent().decode()
        rec.backend, rec.t_sent = "b1", t0 + 0.1
        rec.finish(Cause.OK, 200)
        tracer.observe(rec)
        assert sent.endswith("-01" if sampled else "-00") and (header is None or sent.split("-")[1] == tid)
        assert len(sent) == 55 and sent.split("-")[2] not in ("b7ad6b7169203331", "0" * 16)
    assert sorted(s.name for s in exporter.finished()) == ["chat m", "chat m", "queue"]  # the sampled one only
    kept = RequestTracer(TracingConfig(enabled=True, sample_ratio=1.0), exporter=exporter.extend)
    assert kept.begin(scope()).sampled


def test_traceparent_parsing():
    tid, sid = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    assert parse_traceparent(f"00-{tid}-{sid}-01") == (bytes.fromhex(tid), bytes.fromhex(sid), True)
    assert parse_traceparent(f" 00-{tid}-{sid}-02 ") == (bytes.fromhex(tid), bytes.fromhex(sid), False)
    assert parse_traceparent(f"01-{tid}-{sid}-01-later") is not None  # a later version's extra field
    for bad in (f"00-{tid}-{sid}-01-extra", f"ff-{tid}-{sid}-01", f"00-{'0' * 32}-{sid}-01",
                f"00-{tid}-{'0' * 16}-01", f"00-{tid.upper()}-{sid}-01", f"00-{tid[:-1]}-{sid}-01", "", "garbage",
                f"00-{tid}-{sid}-0x", f"00-{tid[:30]} 1-{sid}-01"):
        assert parse_traceparent(bad) is None, bad


async def test_the_gateway_records_each_attempt_and_sends_its_traceparent():
    """Through the gateway (in process): a replica that cannot be reached, then one that answers.
    The spans, made from the finished record alone, show both attempts and their waits; the
    traceparent the runtime got is the span of the attempt it served."""
    from tests.inprocess import fake_runtime, gateway

    exporter = Spans()
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with fake_runtime() as fake, gateway(fake.backend_config("dead", url="http://127.0.0.1:9"),
                                               fake.backend_config("alive"),
                                               tracing=TracingConfig(enabled=True)) as gw:
        assert gw.app.gateway.tracer is not None
        gw.app.gateway.tracer.export = exporter.extend  # (in place of the exporter's process)
        for b in gw.app.registry.backends:  # both look healthy: the dead one is found out by the request
            b.stats.up = True
        for _ in range(4):
            assert (await gw.post("/v1/chat/completions", chat)).status == 200
        sent = list(fake.runtime.traceparents)
    retried = next(r for r in gw.records if r.retries == 1)
    got = exporter.finished()
    mine = [s for s in got if s.trace_id == retried.trace.trace_id.hex()]
    assert sorted(s.name for s in mine) == ["chat fake-model"] * 3 + ["queue"] * 2
    attempts = sorted((s for s in mine if s.kind == CLIENT), key=lambda s: s.start)
    assert [s.attributes["passerelle.backend"] for s in attempts] == ["dead", "alive"]
    assert attempts[0].status == ERROR and attempts[0].attributes["error.type"] == "upstream_error"
    assert attempts[1].status == 0 and attempts[0].end <= attempts[1].start
    assert f"00-{retried.trace.trace_id.hex()}-{attempts[1].span_id}-01" in sent
    assert all(r.body == b"" for r in gw.records)  # (the body is let go once the record is accounted)


async def test_an_exporter_restart_whose_timer_fires_early_is_set_again():
    """The loop's clock may lag ``time.monotonic()`` (uvloop reads it once an iteration), so the
    backoff's timer can fire before the restart is due. It is set again, not dropped: with no span
    to flush, nothing else would ever start the exporter again."""
    import asyncio

    from passerelle.observe.span_pipe import SpanPipe
    from tests.waiting import until

    pipe = SpanPipe(TracingConfig(enabled=True, endpoint="http://127.0.0.1:9"))
    try:
        pipe._loop = asyncio.get_running_loop()
        old = pipe.proc
        old.kill()
        await until(lambda: pipe._down and pipe._restart is not None, 10, "the killed exporter seen gone")
        pipe._restart.cancel()
        pipe._restart_at = time.monotonic() + 0.2  # the timer fires 0.2 s before the restart is due
        pipe._restart_due()
        assert pipe._restart is not None and pipe.restarts == 0  # set again; nothing started early
        await until(lambda: pipe.restarts == 1, 5, "the exporter started again once due")
        assert pipe.proc is not old and pipe.proc.returncode is None
    finally:
        pipe.shutdown()
