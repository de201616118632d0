"""An OTLP/HTTP traces endpoint that takes every export and answers 200, counting spans: a collector
for measuring what ``[tracing]`` costs the gateway without a real one (whose own CPU would compete
on the same machine).

    .venv/bin/python bench/otlp_sink.py --port 4318 &
    .venv/bin/python bench/overhead.py --no-litellm --concurrency 1,64 \\
        --also-toml $'[tracing]\\nenabled = true\\nendpoint = "http://127.0.0.1:4318/v1/traces"'

Prints the spans received every 10 s (decoding needs opentelemetry-proto, the dev extra).
"""

from __future__ import annotations

import argparse
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

RESPONSE = ExportTraceServiceResponse().SerializeToString()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=4318)
    args = p.parse_args()
    count = [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the exporter's session expects

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            req = ExportTraceServiceRequest.FromString(body)
            n = sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
            with lock:
                count[0] += n
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(RESPONSE)))
            self.end_headers()
            self.wfile.write(RESPONSE)

        def log_message(self, *a: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"OTLP/HTTP sink on http://127.0.0.1:{server.server_address[1]}/v1/traces", flush=True)
    try:
        while True:
            time.sleep(10)
            print(f"spans received: {count[0]}", flush=True)
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
