"""What one answer assembled from a stream costs the gateway in memory (llama-server's
non-streamed requests: the gateway asks for a stream and builds the answer, proxy/assemble.py).

The gateway's app runs in this process, in front of a runtime of this script's own (a loopback
server that streams ``--mib`` MiB of text in events of 64 KiB, as a chat or Messages stream); one
non-streamed request is sent, its body counted and dropped by the client. Printed: the answer's
size, the peak of Python allocations during the request above the idle baseline (tracemalloc),
and the growth of the process's peak RSS over a warm-up with a 1 MiB answer (ru_maxrss, in a run
without tracemalloc).

    python bench/assembled_memory.py --mib 24              # chat
    python bench/assembled_memory.py --mib 24 --api messages
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import resource
import tracemalloc
from typing import Any

from passerelle.cli import build_app
from passerelle.config import BackendConfig, Config, LimitsConfig

PIECE = ('The "river" carried small boats \\ past old mills é\n' * 1300)[:65536]
PIECE_JSON = json.dumps(PIECE, ensure_ascii=False).encode()


def stream(api: str, mib: int) -> list[bytes]:
    n = mib * 1024 * 1024 // len(PIECE)
    if api == "messages":
        head = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","type":"message",'
                b'"role":"assistant","model":"big","content":[],"usage":{"input_tokens":3}}}\n\n'
                b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
                b'"content_block":{"type":"text","text":""}}\n\n')
        event = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                 b'"delta":{"type":"text_delta","text":%s}}\n\n' % PIECE_JSON)
        tail = (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
                b'"usage":{"output_tokens":1}}\n\nevent: message_stop\ndata: {"type":"message_stop"}\n\n')
    else:
        head = b""
        event = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":%s}}]}\n\n' % PIECE_JSON
        tail = b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    return [head, *([event] * n), tail]


async def runtime(warm: list[bytes], events: list[bytes]) -> asyncio.Server:
    """Answers its first request with ``warm`` (a small answer: the warm-up), the next with ``events``."""
    answered = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                answered += 1
                for ev in warm if answered == 1 else events:
                    if ev:
                        writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                        await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def measure(api: str, mib: int, trace: bool) -> tuple[int, int, int]:
    server = await runtime(stream(api, 1), stream(api, mib))
    port = server.sockets[0].getsockname()[1]
    endpoints = ("chat", "messages")
    cfg = Config(backends=(BackendConfig(name="big", kind="llama-server", url=f"http://127.0.0.1:{port}",
                                         models=("big",), max_concurrency=1, endpoints=endpoints),),
                 limits=LimitsConfig(max_answer_bytes=4 * mib * 1024 * 1024 + (1 << 20)))
    app = build_app(cfg)
    await app.startup()
    path = "/v1/messages" if api == "messages" else "/v1/chat/completions"
    body = json.dumps({"model": "big", "max_tokens": 10, "messages": [{"role": "user", "content": "Go."}]}).encode()
    size = 0
    status = 0

    async def one() -> None:
        nonlocal size, status
        sent = False
        done = asyncio.Event()

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal size, status
            if message["type"] == "http.response.start":
                status = message["status"]
            else:
                size += len(message.get("body", b""))
                if not message.get("more_body"):
                    done.set()

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8080)}
        await app(scope, receive, send)

    try:
        await one()  # warm-up, with a small answer: the peak RSS that follows is the large answer's
        size = 0
        gc.collect()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if trace:
            tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0] if trace else 0
        await one()
        peak = tracemalloc.get_traced_memory()[1] - base if trace else 0
        if trace:
            tracemalloc.stop()
        rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
        if status != 200:
            raise SystemExit(f"HTTP {status}")
        return size, peak, rss
    finally:
        await app.shutdown()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=24, help="text of the answer, in MiB (default 24)")
    parser.add_argument("--api", choices=("chat", "messages"), default="chat")
    args = parser.parse_args()
    size, _, rss = asyncio.run(measure(args.api, args.mib, trace=False))
    _, peak, _ = asyncio.run(measure(args.api, args.mib, trace=True))
    mib = 1024 * 1024
    print(f"{args.api}: answer {size / mib:.1f} MiB; peak allocations {peak / mib:.1f} MiB "
          f"(x{peak / size:.2f}); peak RSS growth {rss / mib:.1f} MiB (x{rss / size:.2f})")


if __name__ == "__main__":
    main()
