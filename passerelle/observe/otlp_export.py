"""The trace exporter's child process: finished spans (observe/tracing.py's tuples) from a pipe,
sent over OTLP/HTTP.

The gateway's end of the pipe, which starts this process and starts it again when it dies, is
observe/span_pipe.py. This process (``python -m passerelle.observe.otlp_export``) reads marshal
frames of span tuples from its stdin, builds ``ExportTraceServiceRequest`` messages with
opentelemetry-proto and POSTs them, a batch every ``OTEL_BSP_SCHEDULE_DELAY`` ms or every
``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` spans (at most ``OTEL_BSP_MAX_QUEUE_SIZE`` held; more are
dropped and counted in its log), so the encoding and the HTTP never take the gateway's
interpreter. It reads until the pipe closes: the gateway's shutdown (what is buffered goes first,
within ``SHUTDOWN_S``) or the gateway's death, whichever comes first, sends what it holds, and
exits; it ignores SIGINT and SIGTERM (sent to the whole group by a terminal or systemd) so as to
send what the gateway flushes last.
"""

from __future__ import annotations

import contextlib
import json
import marshal
import os
import select
import sys
import time
from typing import Any

SHUTDOWN_S = 10.0  # at the gateway's shutdown: the buffered spans written and the last export, within this


def env_int(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


# --- the child -------------------------------------------------------------------------------------
def _value(v: Any) -> Any:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue

    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, (list, tuple)):
        return AnyValue(array_value=ArrayValue(values=[_value(x) for x in v]))
    return AnyValue(string_value=str(v))


_KEY_VALUES: dict[tuple[str, Any, type], Any] = {}  # built KeyValue messages, by (key, value, type)


def _attributes(attrs: dict[str, Any]) -> list[Any]:
    """The attributes as KeyValue messages; most (operation, model, backend, cause) recur from
    span to span, and a cached message copied in costs a third of one built (measured)."""
    from opentelemetry.proto.common.v1.common_pb2 import KeyValue

    out = []
    for k, v in attrs.items():
        if isinstance(v, list):
            v = tuple(v)
        key = (k, v, type(v))
        kv = _KEY_VALUES.get(key)
        if kv is None:
            if len(_KEY_VALUES) >= 4096:  # (ids and counts never recur: start afresh)
                _KEY_VALUES.clear()
            kv = _KEY_VALUES[key] = KeyValue(key=k, value=_value(v))
        out.append(kv)
    return out


def request_of(spans: list[Any], resource: dict[str, Any], version: str) -> Any:
    """The ``ExportTraceServiceRequest`` carrying these span tuples (one resource, one scope)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    req = ExportTraceServiceRequest()
    rs = req.resource_spans.add()
    rs.resource.attributes.extend(_attributes(resource))
    ss = rs.scope_spans.add()
    ss.scope.name, ss.scope.version = "passerelle", version
    for trace_id, span_id, parent, name, kind, start, end, attrs, status, message, events, state in spans:
        s = ss.spans.add(trace_id=trace_id, span_id=span_id, parent_span_id=parent, name=name, kind=kind,
                         start_time_unix_nano=start, end_time_unix_nano=end, trace_state=state)
        s.attributes.extend(_attributes(attrs))
        if status:
            s.status.code, s.status.message = status, message
        for ev_name, ev_time, ev_attrs in events:
            e = s.events.add(name=ev_name, time_unix_nano=ev_time)
            e.attributes.extend(_attributes(ev_attrs))
    return req


def _key_values(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` (OTEL_EXPORTER_OTLP_HEADERS, OTEL_RESOURCE_ATTRIBUTES), values URL-decoded."""
    from urllib.parse import unquote

    pairs = (p.split("=", 1) for p in text.split(",") if "=" in p)
    return {k.strip(): unquote(v.strip()) for k, v in pairs}


class _Poster:
    """POSTs to the collector over one kept-alive connection, a fresh one after a failure."""

    def __init__(self, endpoint: str) -> None:
        from urllib.parse import urlsplit

        self.url = urlsplit(endpoint)
        self.timeout = float(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", 10))
        self.headers = {**_key_values(os.environ.get("OTEL_EXPORTER_OTLP_HEADERS", "")),
                        **_key_values(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "")),
                        "Content-Type": "application/x-protobuf"}
        self.conn: Any = None
        self.failures = 0

    def post(self, body: bytes, timeout: float) -> None:
        import http.client

        for attempt in (1, 2):  # a kept-alive connection the collector closed: once more, afresh
            try:
                if self.conn is None:
                    cls = http.client.HTTPSConnection if self.url.scheme == "https" else http.client.HTTPConnection
                    self.conn = cls(self.url.netloc, timeout=min(timeout, self.timeout))
                self.conn.request("POST", self.url.path or "/", body, self.headers)
                resp = self.conn.getresponse()
                resp.read()
                if resp.status >= 300:
                    raise OSError(f"HTTP {resp.status}")
                self.failures = 0
                return
            except (OSError, http.client.HTTPException) as exc:
                with contextlib.suppress(Exception):
                    self.conn.close()
                self.conn = None
                if attempt == 2 or isinstance(exc, TimeoutError):
                    self.failures += 1
                    if self.failures in (1, 10, 100) or self.failures % 1000 == 0:
                        print(f"passerelle: traces: export to {self.url.geturl()} failed ({exc}); "
                              f"{self.failures} in a row, their spans dropped", file=sys.stderr, flush=True)
                    return


def main(conf: dict[str, Any]) -> None:
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    resource: dict[str, Any] = {**_key_values(os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")),
                                "service.name": conf["service_name"], "service.version": conf["version"]}
    delay = env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
    batch_size = env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)
    max_spans = env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
    poster = _Poster(conf["endpoint"])
    fd = sys.stdin.buffer.fileno()
    held: list[Any] = []
    buf = bytearray()
    dropped = 0
    due = 0.0
    eof = False

    def send(deadline: float) -> None:
        nonlocal held
        while held and time.monotonic() < deadline:
            batch, held = held[:batch_size], held[batch_size:]
            poster.post(request_of(batch, resource, conf["version"]).SerializeToString(),
                        max(0.1, deadline - time.monotonic()))

    while not eof:
        readable, _, _ = select.select([fd], [], [], max(0.0, due - time.monotonic()) if held else None)
        was_empty = not held
        if readable:
            chunk = os.read(fd, 1 << 20)
            eof = not chunk
            buf += chunk
            pos = 0  # (the frames read, then cut off at once: one move of the rest, not one a frame)
            while len(buf) - pos >= 4 and len(buf) - pos >= 4 + (n := int.from_bytes(buf[pos:pos + 4], "big")):
                spans = marshal.loads(buf[pos + 4:pos + 4 + n])
                pos += 4 + n
                if len(held) + len(spans) > max_spans:
                    dropped += len(spans)
                else:
                    held += spans
            del buf[:pos]
        now = time.monotonic()
        if was_empty:
            due = now + delay  # the first span held waits at most the schedule's delay
        if held and (len(held) >= batch_size or now >= due):
            send(now + poster.timeout)
            due = time.monotonic() + delay
    send(time.monotonic() + SHUTDOWN_S - 1.0)  # the gateway is stopping: the rest, then exit
    if dropped:
        print(f"passerelle: traces: {dropped} spans dropped (the collector was behind)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
