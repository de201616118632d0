"""OpenTelemetry traces (observe/tracing.py) from a real gateway process to a real OTLP/HTTP
receiver, decoded with opentelemetry-proto: one trace per request with its queue and attempt
spans, a client's traceparent honoured, and the traceparent the runtime got belongs to the trace."""

from __future__ import annotations

import gzip
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.conftest import upstream_config, wait_until
from tests.waiting import until

MODEL = "fake-model"


class Receiver:
    """An OTLP/HTTP traces endpoint: every span it is sent, decoded, with its resource."""

    def __init__(self) -> None:
        spans = self.spans = []  # type: list[dict]
        lock = self.lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                with lock:
                    for rs in req.resource_spans:
                        res = {a.key: _value(a.value) for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                spans.append({"name": s.name, "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                                              "parent": s.parent_span_id.hex(), "kind": s.kind, "resource": res,
                                              "start": s.start_time_unix_nano, "end": s.end_time_unix_nano,
                                              "status": s.status.code,
                                              "attrs": {a.key: _value(a.value) for a in s.attributes},
                                              "events": [e.name for e in s.events]})
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def traced(backend_url: str, receiver_url: str, extra: str = "") -> str:
    return upstream_config(backend_url, model=MODEL, kind="openai") + f"""
    [tracing]
    enabled = true
    endpoint = "{receiver_url}"
    {extra}
    """


ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export every 0.1 s rather than every 5 s


def chat(gw, headers: dict[str, str] | None = None, stream: bool = False) -> httpx.Response:
    r = httpx.post(gw.url + "/v1/chat/completions", headers=headers or {}, timeout=30, json={
        "model": MODEL, "max_tokens": 4, "stream": stream, "messages": [{"role": "user", "content": "secret prompt"}]})
    assert r.status_code == 200, r.text
    return r


def test_one_trace_with_queue_and_attempt_spans_joined_by_the_runtime(gateway, fake_backend, receiver):
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(traced(fake.url, receiver.url), env=ENV)
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = chat(gw, {"traceparent": f"00-{client_trace}-{client_span}-01"}, stream=True)
    rid = r.headers["x-request-id"]

    def complete() -> list[dict] | None:
        spans = receiver.trace(client_trace)
        return spans if any(s["attrs"].get("passerelle.request_id") == rid for s in spans) else None

    spans = wait_until(complete, 30, what="the request's trace at the receiver")
    root = next(s for s in spans if s["attrs"].get("passerelle.request_id") == rid)
    assert root["parent"] == client_span and root["name"] == f"chat {MODEL}"
    assert root["kind"] == 2  # SERVER
    a = root["attrs"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] == 4
    assert a["gen_ai.response.finish_reasons"] == ["length"] and a["passerelle.cause"] == "ok"
    assert root["resource"]["service.name"] == "passerelle"
    assert not root["events"]  # prompts are not recorded unless asked
    children = {s["name"]: s for s in spans if s["parent"] == root["span_id"]}
    assert set(children) == {"queue", f"chat {MODEL}"}, children.keys()
    attempt = children[f"chat {MODEL}"]
    assert attempt["kind"] == 3 and attempt["attrs"]["passerelle.backend"] == "b1"  # CLIENT
    assert children["queue"]["end"] <= attempt["start"] <= attempt["end"] <= root["end"]
    # the runtime was sent the attempt's span as its parent, in the client's trace
    got = httpx.get(fake.url + "/fake/stats", timeout=5).json()["traceparents"]
    assert f"00-{client_trace}-{attempt['span_id']}-01" in got


def test_a_request_without_traceparent_starts_a_trace_and_prompts_may_be_recorded(gateway, fake_backend, receiver):
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(traced(fake.url, receiver.url, "record_prompts = true"), env=ENV)
    rid = chat(gw).headers["x-request-id"]

    def root() -> dict | None:
        with receiver.lock:
            return next((s for s in receiver.spans if s["attrs"].get("passerelle.request_id") == rid), None)

    span = wait_until(root, 30, what="the request's span")
    assert span["parent"] == "" and span["events"] == ["gen_ai.content.prompt"]
    sent = httpx.get(fake.url + "/fake/stats", timeout=5).json()["traceparents"]
    assert len(sent) == 1 and sent[0].split("-")[1] == span["trace_id"]


def test_a_sampled_out_client_trace_is_not_exported_but_still_propagated(gateway, fake_backend, receiver):
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(traced(fake.url, receiver.url), env=ENV)
    tid = "0af7651916cd43dd8448eb211c80319c"
    chat(gw, {"traceparent": f"00-{tid}-b7ad6b7169203331-00"})
    sampled = chat(gw, {"traceparent": f"00-{'1' * 32}-b7ad6b7169203331-01"}).headers["x-request-id"]
    wait_until(lambda: any(s["attrs"].get("passerelle.request_id") == sampled for s in receiver.trace("1" * 32)),
               30, what="the sampled request's span")
    assert receiver.trace(tid) == []  # the client said "not sampled": followed
    sent = httpx.get(fake.url + "/fake/stats", timeout=5).json()["traceparents"]
    assert any(t.startswith(f"00-{tid}-") and t.endswith("-00") for t in sent)


def test_opentelemetry_is_not_imported_when_tracing_is_off(tmp_path):
    import subprocess
    import sys

    script = """
import asyncio, sys
from tests.inprocess import fake_runtime, gateway
async def main():
    async with fake_runtime(ttft_ms=1, itl_ms=1) as fake, gateway(fake.backend_config()) as gw:
        r = await gw.post("/v1/chat/completions", {"model": "fake-model", "max_tokens": 2,
                          "messages": [{"role": "user", "content": "x"}]})
        assert r.status == 200, r.status
        assert gw.app.gateway.tracer is None and gw.records[0].trace is None
asyncio.run(main())
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PASSERELLE_STATE": str(tmp_path)})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def one_request(tracer, rid: str) -> None:
    """A finished request's record, as the gateway leaves it, to the tracer's listener: 3 spans
    (the request, its wait in the queue, its attempt)."""
    from passerelle.errors import Cause
    from passerelle.observe.record import RequestRecord

    rec = RequestRecord(id=rid, endpoint="chat", model=MODEL)
    rec.trace = tracer.begin({"method": "POST", "path": "/v1/chat/completions", "headers": []})
    rec.t_queued = rec.t_arrival
    rec.trace.traceparent()
    rec.backend, rec.t_sent = "b1", time.perf_counter()
    rec.finish(Cause.OK, 200)
    tracer.observe(rec)


def test_shutdown_sends_what_the_exporter_holds(receiver, monkeypatch):
    """With a schedule delay of a minute nothing is sent before shutdown: shutdown (from a thread,
    as the app calls it) writes what waits in the gateway and the child sends it before exiting."""
    import asyncio

    from passerelle.config import TracingConfig
    from passerelle.observe.tracing import RequestTracer

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    tracer = RequestTracer(TracingConfig(enabled=True, endpoint=receiver.url))

    async def main() -> None:
        for i in range(3):
            one_request(tracer, f"req_{i}")  # on the loop: waits for the flush timer
        await asyncio.to_thread(tracer.shutdown)

    asyncio.run(main())
    assert tracer.pipe is not None and tracer.pipe.proc.returncode == 0 and tracer.pipe.dropped == 0
    with receiver.lock:
        got = sorted(s["attrs"]["passerelle.request_id"] for s in receiver.spans if s["kind"] == 2)
    assert got == ["req_0", "req_1", "req_2"]


def test_spans_beyond_the_cap_or_never_sent_are_dropped_and_counted(receiver, monkeypatch):
    import asyncio

    from passerelle.config import TracingConfig
    from passerelle.observe.tracing import RequestTracer

    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "10")  # 3 spans a request: the 4th within one flush is over
    tracer = RequestTracer(TracingConfig(enabled=True, endpoint=receiver.url))
    pipe = tracer.pipe
    assert pipe is not None

    async def burst() -> None:
        for i in range(4):
            one_request(tracer, f"req_{i}")
        assert pipe.dropped == 3
        await until(lambda: not pipe._pending, 10, "the flush timer to write the waiting spans to the child")

    asyncio.run(burst())
    pipe.proc.kill()
    pipe.proc.wait()
    one_request(tracer, "after")  # no loop: the dead child is noticed; the spans wait for the next one
    assert pipe.dropped == 3 and len(pipe._pending) == 3
    tracer.shutdown()  # stopping: no new child, so what waited for one is dropped and counted
    assert pipe.dropped == 6 and pipe.restarts == 0


def test_the_exporter_process_ends_with_the_gateway(tmp_path, receiver):
    """SIGKILL of the gateway's process: its exporter child sees the pipe close and exits."""
    import signal
    import subprocess
    import sys

    script = f"""
import sys, time
from passerelle.config import TracingConfig
from passerelle.observe.tracing import RequestTracer
tracer = RequestTracer(TracingConfig(enabled=True, endpoint={receiver.url!r}))
print(tracer.pipe.proc.pid, flush=True)
time.sleep(60)
"""
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            child = int(proc.stdout.readline())
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

            def gone() -> bool:
                try:
                    with open(f"/proc/{child}/stat") as f:
                        return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # (a zombie: its parent died first)
                except FileNotFoundError:
                    return True

            wait_until(gone, 10, what="the exporter process to exit")
        finally:
            proc.kill()


def test_spans_the_exporter_could_not_take_are_counted_in_metrics(gateway, fake_backend, receiver):
    """Spans dropped at the gateway's cap show in /metrics, not only in the log."""
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    # 3 spans a request, 4 waiting at most: the second request within one flush is over the cap
    gw = gateway(traced(fake.url, receiver.url), env={**ENV, "OTEL_BSP_MAX_QUEUE_SIZE": "4"})

    def dropped() -> float:
        return counter(gw, "passerelle_trace_spans_dropped_total")

    assert dropped() == 0
    with httpx.Client(timeout=30) as client:
        for _ in range(20):  # back to back: several within one 0.1 s flush
            r = client.post(gw.url + "/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
    assert wait_until(lambda: dropped() >= 3 or None, 30, what="dropped spans in /metrics")


def counter(gw, name: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[1])


def children_of(pid: int) -> dict[int, tuple[str, str]]:
    """The processes whose parent is ``pid``, from /proc: their state letter (Z: a zombie, dead but
    never waited for) and their command line (empty for a zombie)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # (gone meanwhile)
            continue
        if int(fields[1]) == pid:
            out[int(entry)] = (fields[0], cmdline)
    return out


def test_a_killed_exporter_is_reaped_and_started_again(gateway, fake_backend, receiver):
    """kill -9 of the exporter's process while the gateway serves with tracing on: the gateway
    reaps it at once (no zombie), starts a new one after its backoff (counted in /metrics), and
    the spans of the requests made after that reach the collector."""
    import signal

    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(traced(fake.url, receiver.url), env=ENV)
    pid = gw.proc.pid

    def root_of(rid: str) -> dict | None:
        with receiver.lock:
            return next((s for s in receiver.spans if s["attrs"].get("passerelle.request_id") == rid), None)

    before = chat(gw).headers["x-request-id"]
    wait_until(lambda: root_of(before), 30, what="the first request's span")
    (old,) = [p for p, (_, cmd) in children_of(pid).items() if "passerelle.observe.otlp_export" in cmd]
    assert counter(gw, "passerelle_trace_exporter_restarts_total") == 0
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: old not in children_of(pid), 10, what="the killed exporter to be reaped")

    def restarted() -> list[int] | None:
        new = [p for p, (_, cmd) in children_of(pid).items() if "passerelle.observe.otlp_export" in cmd]
        return new if new and counter(gw, "passerelle_trace_exporter_restarts_total") == 1 else None

    (new,) = wait_until(restarted, 30, what="a new exporter process")
    assert new != old
    after = [chat(gw, stream=stream).headers["x-request-id"] for stream in (False, True)]
    for rid in after:
        wait_until(lambda rid=rid: root_of(rid), 30, what="the spans of a request made after the restart")
    assert not [p for p, (state, _) in children_of(pid).items() if state == "Z"], children_of(pid)
    assert "starting a new one in 1 s" in gw.log_text()


def test_the_backoff_doubles_while_the_exporter_keeps_dying(receiver, monkeypatch):
    """Each death in a row waits twice as long before the next start (a child that cannot run is
    not started in a tight loop); every dead child is reaped."""
    import asyncio
    import signal

    from passerelle.config import TracingConfig
    from passerelle.observe import span_pipe
    from passerelle.observe.tracing import RequestTracer

    monkeypatch.setattr(span_pipe, "RESTART_MIN_S", 0.2)
    tracer = RequestTracer(TracingConfig(enabled=True, endpoint=receiver.url))
    pipe = tracer.pipe
    assert pipe is not None
    gaps: list[float] = []

    async def main() -> None:
        one_request(tracer, "req_0")  # (the pipe learns its loop)
        for _ in range(3):
            old = pipe.proc
            os.kill(old.pid, signal.SIGKILL)
            died = time.monotonic()
            await until(lambda old=old: pipe.proc is not old, 10, "the exporter started again", interval=0.01)
            gaps.append(time.monotonic() - died)
            assert old.returncode == -signal.SIGKILL and not os.path.exists(f"/proc/{old.pid}")  # reaped
        one_request(tracer, "req_1")
        await asyncio.to_thread(tracer.shutdown)

    asyncio.run(main())
    assert pipe.restarts == 3
    assert 0.2 <= gaps[0] < gaps[1] < gaps[2] and gaps[1] >= 0.4 and gaps[2] >= 0.8, gaps
    with receiver.lock:
        assert "req_1" in {s["attrs"].get("passerelle.request_id") for s in receiver.spans}
