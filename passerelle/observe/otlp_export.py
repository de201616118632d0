"""Finished spans (observe/tracing.py's tuples) sent over OTLP/HTTP from a child process.

The gateway's side, :class:`SpanPipe`, never blocks the event loop: a request's spans join a
list, written every ``FLUSH_S`` (or every ``FLUSH_SPANS`` spans) as one marshal frame to a
non-blocking pipe; what the pipe cannot take waits in a buffer drained when it can. Both are
capped (``OTEL_BSP_MAX_QUEUE_SIZE`` spans waiting, ``MAX_BUFFER_BYTES`` written), spans beyond
are dropped and counted, never waited for. The child (``python -m passerelle.observe.otlp_export``)
builds ``ExportTraceServiceRequest`` messages with opentelemetry-proto and POSTs them, a batch
every ``OTEL_BSP_SCHEDULE_DELAY`` ms or every ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` spans, so the
encoding and the HTTP never take the gateway's interpreter. The child reads until the pipe closes:
:meth:`SpanPipe.shutdown` (what is buffered goes first, within ``SHUTDOWN_S``) or the gateway's
death, whichever comes first, sends what it holds, and exits; it ignores SIGINT and SIGTERM
(sent to the whole group by a terminal or systemd) so as to send what the gateway flushes last.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import marshal
import os
import select
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (the exporter's process imports no more of passerelle than this module)
    from passerelle.config import TracingConfig

log = logging.getLogger("passerelle.tracing")

FLUSH_S = 0.1  # how long finished spans wait in the gateway before they are written to the pipe
FLUSH_SPANS = 256  # or this many, whichever comes first
MAX_BUFFER_BYTES = 8 * 1024 * 1024  # written but not yet taken by the child
SHUTDOWN_S = 10.0  # at shutdown: the buffered spans written and the child's last export, within this
PIPE_BYTES = 1024 * 1024  # the pipe's own buffer, asked of Linux (F_SETPIPE_SZ)


def _env_int(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


class SpanPipe:
    """The gateway's end: spans in, the child out. ``submit`` is called on the event loop (or,
    with no loop running, it writes at once); ``shutdown`` from any thread."""

    def __init__(self, cfg: TracingConfig) -> None:
        import importlib.util

        if importlib.util.find_spec("opentelemetry.proto") is None:  # the child's need, said at start
            raise ImportError("opentelemetry-proto is missing", name="opentelemetry-proto")
        from passerelle import __version__

        self.max_spans = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.dropped = 0  # spans never sent: the buffers were full, or the child was gone
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.environ.get("PYTHONPATH")
        conf = {"endpoint": cfg.endpoint, "service_name": cfg.service_name, "version": __version__}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "passerelle.observe.otlp_export", json.dumps(conf)], stdin=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")})
        assert self.proc.stdin is not None
        self.fd = self.proc.stdin.fileno()
        with contextlib.suppress(OSError, AttributeError):
            import fcntl

            fcntl.fcntl(self.fd, 1031, PIPE_BYTES)  # F_SETPIPE_SZ: fewer trips through the writer
        os.set_blocking(self.fd, False)
        self._pending: list[Any] = []
        self._out = bytearray()
        self._frames: collections.deque[list[int]] = collections.deque()  # [bytes not yet written, spans] a frame
        self._lock = threading.Lock()  # _out and the pipe, between the loop and shutdown's thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._watching = False  # the loop waits for the pipe to take _out
        self._closed = False
        self._stopping = False  # shutdown has begun: the loop is not asked to watch the pipe any more

    def submit(self, spans: list[Any]) -> None:
        if self._closed or len(self._pending) + len(spans) > self.max_spans:
            self._drop(len(spans))
            return
        self._pending += spans
        if len(self._pending) >= FLUSH_SPANS:
            self.flush()
        elif self._timer is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                self.flush()
                return
            self._timer = self._loop.call_later(FLUSH_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self.flush()

    def _drop(self, n: int) -> None:
        if not n:
            return
        if not self.dropped:
            log.warning("traces: %d spans dropped (the exporter is behind or gone); counting", n)
        self.dropped += n

    def flush(self) -> None:
        """The waiting spans written to the pipe, as much as it takes now."""
        with self._lock:
            if not self._pending or self._closed:
                return
            batch, self._pending = self._pending, []
            data = marshal.dumps(batch)
            if len(self._out) + len(data) + 4 > MAX_BUFFER_BYTES:
                self._drop(len(batch))
                return
            self._out += len(data).to_bytes(4, "big") + data
            self._frames.append([len(data) + 4, len(batch)])
            self._write()

    def _write(self) -> None:  # under _lock
        try:
            n = os.write(self.fd, self._out)
        except BlockingIOError:
            n = 0
        except OSError as exc:  # the child is gone: nothing more can be sent
            log.warning("traces: the exporter process is gone (%s); spans are dropped", exc)
            self._closed = True
            self._unsent()
            return
        self._written(n)
        if self._out and not self._watching and self._loop is not None and not self._stopping:
            self._loop.add_writer(self.fd, self._writable)
            self._watching = True
        elif not self._out and self._watching and self._loop is not None:
            self._loop.remove_writer(self.fd)
            self._watching = False

    def _written(self, n: int) -> None:
        del self._out[:n]
        while n and self._frames:
            took = min(n, self._frames[0][0])
            self._frames[0][0] -= took
            n -= took
            if not self._frames[0][0]:
                self._frames.popleft()

    def _unsent(self) -> None:
        self._drop(sum(n for _, n in self._frames))
        self._frames.clear()
        self._out.clear()

    def _writable(self) -> None:
        with self._lock:
            if not self._closed:
                self._write()

    def _detach(self) -> None:  # on the loop: no more timer, no more writer
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watching and self._loop is not None:
            self._loop.remove_writer(self.fd)
            self._watching = False

    def shutdown(self) -> None:
        """Every waiting span written (within ``SHUTDOWN_S``), the pipe closed, the child waited for
        while it sends them; killed if it overstays."""
        deadline = time.monotonic() + SHUTDOWN_S
        self._stopping = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop or not loop.is_running():
                self._detach()
            else:
                done: concurrent.futures.Future[None] = concurrent.futures.Future()

                def detach() -> None:
                    self._detach()
                    done.set_result(None)

                loop.call_soon_threadsafe(detach)
                with contextlib.suppress(concurrent.futures.TimeoutError):
                    done.result(timeout=2.0)
        self.flush()
        with self._lock:
            self._closed = True
            while self._out and time.monotonic() < deadline:
                select.select([], [self.fd], [], max(0.0, deadline - time.monotonic()))
                try:
                    self._written(os.write(self.fd, self._out))
                except BlockingIOError:
                    continue
                except OSError:
                    break
            self._unsent()  # (what the deadline or a gone child left)
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.dropped:
            log.warning("traces: %d spans dropped in all", self.dropped)


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
    delay = _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
    batch_size = _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)
    max_spans = _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
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
