"""A runtime that leaves tool calls as text: its answers, on every API, and a server that says them.

The text is what a model writes when the runtime's parser missed its tool-call format (Hermes'
``<tool_call>``, Qwen3's XML...); :func:`stream` puts it in a runtime's stream as the deltas given
(so a test chooses where the text is cut), in content or in reasoning; :func:`body` in a whole
answer. :func:`scripted_runtime` serves one answer per request from a script, its bytes written in
the pieces the script gives (one HTTP chunk each, a loop pass between them), on a loopback socket
of the test's own loop.

    async with scripted_runtime(lambda path, body: Reply(chunks=stream("chat", ["Hi"]))) as url:
        ...  # a BackendConfig(kind="openai", url=url, models=("m",)) behind the gateway
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from passerelle.testing.answers import sse

USAGE = {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}


def stream(api: str, deltas: list[str], *, where: str = "content", model: str = "m") -> list[bytes]:
    """A runtime's stream of ``api`` whose text arrives as ``deltas``: chat ``content`` (or
    ``reasoning_content``/``reasoning`` with ``where``), a Responses message, a Messages text block."""
    text = "".join(deltas)
    if api == "chat":
        head = {"id": "chatcmpl-t", "object": "chat.completion.chunk", "created": 1, "model": model}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

        return [chunk({"role": "assistant", "content": ""}), *(chunk({where: d}) for d in deltas),
                chunk({}, "stop"), sse({**head, "choices": [], "usage": USAGE}), b"data: [DONE]\n\n"]
    if api == "responses":
        seq = iter(range(1 << 20))

        def ev(kind: str, **fields: Any) -> bytes:
            return sse({"type": kind, "sequence_number": next(seq), **fields}, kind)

        base = {"id": "resp_t", "object": "response", "created_at": 1, "model": model, "status": "in_progress",
                "output": []}
        msg = {"id": "msg_t", "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        where_ = {"item_id": "msg_t", "output_index": 0, "content_index": 0}
        done = {**msg, "status": "completed", "content": [part]}
        return [ev("response.created", response=base), ev("response.in_progress", response=base),
                ev("response.output_item.added", output_index=0, item=msg),
                ev("response.content_part.added", **where_, part={**part, "text": ""}),
                *(ev("response.output_text.delta", **where_, delta=d, logprobs=[]) for d in deltas),
                ev("response.output_text.done", **where_, text=text, logprobs=[]),
                ev("response.content_part.done", **where_, part=part),
                ev("response.output_item.done", output_index=0, item=done),
                ev("response.completed", response={**base, "status": "completed", "output": [done],
                                                   "usage": {"input_tokens": 12, "output_tokens": 30,
                                                             "total_tokens": 42}})]
    message: dict[str, Any] = {"id": "msg_t", "type": "message", "role": "assistant", "model": model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 12, "output_tokens": 1}}
    return [sse({"type": "message_start", "message": message}, "message_start"),
            sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                "content_block_start"),
            *(sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": d}},
                  "content_block_delta") for d in deltas),
            sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            sse({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                 "usage": {"output_tokens": 30}}, "message_delta"),
            sse({"type": "message_stop"}, "message_stop")]


def body(api: str, text: str, *, where: str = "content", model: str = "m") -> bytes:
    """A runtime's whole answer of ``api`` whose text is ``text``."""
    if api == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text if where == "content" else None}
        if where != "content":
            message[where] = text
        return orjson.dumps({"id": "chatcmpl-t", "object": "chat.completion", "created": 1, "model": model,
                             "choices": [{"index": 0, "message": message, "finish_reason": "stop",
                                          "logprobs": None}], "usage": USAGE})
    if api == "responses":
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return orjson.dumps({"id": "resp_t", "object": "response", "created_at": 1, "model": model,
                             "status": "completed", "output": [
                                 {"id": "msg_t", "type": "message", "role": "assistant", "status": "completed",
                                  "content": [part]}],
                             "usage": {"input_tokens": 12, "output_tokens": 30, "total_tokens": 42}})
    return orjson.dumps({"id": "msg_t", "type": "message", "role": "assistant", "model": model,
                         "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                         "stop_sequence": None, "usage": {"input_tokens": 12, "output_tokens": 30}})


@dataclass
class Reply:
    """One scripted answer: a stream's events (``chunks``, written as they are cut), or a JSON body."""

    chunks: list[bytes] = field(default_factory=list)
    json: bytes = b""
    status: int = 200


Script = Callable[[str, dict[str, Any]], Reply]


async def _serve(script: Script, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            path = lines[0].split(" ")[1]
            length = next((int(line.split(":", 1)[1]) for line in lines[1:]
                           if line.lower().startswith("content-length:")), 0)
            raw = await reader.readexactly(length) if length else b""
            if not raw:  # (health checks, the model list)
                models = b'{"object":"list","data":[{"id":"m","object":"model","owned_by":"t"}]}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(models), models))
                await writer.drain()
                continue
            reply = script(path, orjson.loads(raw))
            if not reply.chunks:
                writer.write(b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                             % (reply.status, len(reply.json)) + reply.json)
                await writer.drain()
                continue
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in reply.chunks:
                if piece:
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
                    await asyncio.sleep(0)  # (each piece its own read, as far as the loop goes)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def scripted_runtime(script: Script) -> AsyncIterator[str]:
    """A runtime answering every request with ``script(path, body)``; yields its base URL."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await _serve(script, reader, writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for writer in writers:  # (the gateway keeps its connections open: closed here)
            writer.close()
        await server.wait_closed()
