"""Scripted misbehaviours of the fake runtime: a runtime written to break the gateway, on purpose.

A request picks one with a ``"fake_fault": NAME`` field in its JSON body (the gateway passes bodies
through), or the whole server with ``passerelle fake-backend --fault NAME [--fault-rate F]``:

==================  ======================================================================
``never-answer``    reads the request, then says nothing, ever (the connection stays open)
``continue-forever`` ``100 Continue`` every ``drip_ms``, never a final answer
``head-then-silence`` a 200 head (an event stream, or JSON with a length), then nothing
``drip``            a 200 head, then one byte every ``drip_ms`` of an event (or body) that never ends
``reset-mid-chunk`` a few tokens, half a chunk, then a TCP reset
``huge-event``      an event stream whose next event is ``fault_bytes`` long, with no newline
``huge-body``       a 200 JSON answer of ``fault_bytes``, chunked (no length to refuse it by)
``huge-error``      a 500 answer of ``fault_bytes``, with its length
``redirect``        302 to another host
``html``            200 ``text/html``: a proxy's error page in place of an answer
``after-done``      a complete stream, then events after ``[DONE]``, then silence with the body unended
``second-response`` a complete answer (a stream, or JSON) and a second, unasked response in the same write
``html-error``      500 ``text/html``: a proxy's error page in place of the runtime's error
``big-answer``      a stream of ``fault_bytes`` of text in events of 64 KiB (chat, completions or
                    Messages events), then its end: a large answer, well-formed
``big-answer-stall`` the same text, then silence: the answer never ends
==================  ======================================================================

Large bodies are written as the reader takes them (flow control), so the fake's own memory stays
small whatever ``fault_bytes`` says.

Example::

    curl -s localhost:9000/v1/chat/completions -d '{"model":"fake-model","messages":[],
         "fake_fault":"redirect"}'      # HTTP/1.1 302 Found, Location: http://example.invalid/...
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from typing import Any, Protocol

FAULTS = ("never-answer", "continue-forever", "head-then-silence", "drip", "reset-mid-chunk", "huge-event",
          "huge-body", "huge-error", "redirect", "html", "after-done", "second-response", "html-error",
          "big-answer", "big-answer-stall")

_PIECE = 1 << 16


class Conn(Protocol):
    """What a fault needs of the fake's connection (fake_runtime.Connection)."""

    transport: asyncio.Transport | None
    closed: bool

    def start_stream(self) -> None: ...

    async def write_chunk(self, data: bytes) -> None: ...

    async def write_raw(self, data: bytes) -> None: ...

    def respond(self, status: int, body: bytes, keep_alive: bool, content_type: bytes = ...) -> None: ...

    def end_stream(self, keep_alive: bool) -> None: ...


def _chunk(text: str, chat: bool) -> bytes:
    if chat:
        return b'data: {"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}\n\n' % text.encode()
    return b'data: {"choices":[{"index":0,"text":"%s","finish_reason":null}]}\n\n' % text.encode()


async def _forever() -> None:
    await asyncio.get_running_loop().create_future()


def _reset(conn: Conn) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a graceful FIN."""
    transport = conn.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
    conn.closed = True


async def misbehave(conn: Conn, fault: str, *, chat: bool, stream: bool, fault_bytes: int, drip_ms: float,
                    api: str = "") -> None:
    """Play ``fault`` on ``conn`` (one of FAULTS). Returns, or waits until the connection closes.
    ``api``: "messages" for Anthropic's events, else OpenAI chunks (chat or completions)."""
    drip = drip_ms / 1000
    if fault.startswith("big-answer"):
        await _big_answer(conn, fault_bytes, chat=chat, messages=api == "messages", end=fault == "big-answer")
        if fault != "big-answer":
            await _forever()
        return
    if fault == "never-answer":
        await _forever()
    elif fault == "continue-forever":
        while True:
            await conn.write_raw(b"HTTP/1.1 100 Continue\r\n\r\n")
            await asyncio.sleep(drip)
    elif fault == "head-then-silence":
        if stream:
            conn.start_stream()
        else:
            await conn.write_raw(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        await _forever()
    elif fault == "drip":
        if stream:
            conn.start_stream()
            await conn.write_chunk(_chunk("a", chat))
            await conn.write_chunk(b'data: {"choices":[{"index":0,"delta":{"content":"')
            while True:
                await asyncio.sleep(drip)
                await conn.write_chunk(b"b")
        await conn.write_raw(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
        while True:
            await asyncio.sleep(drip)
            await conn.write_raw(b" ")
    elif fault == "reset-mid-chunk":
        conn.start_stream()
        for word in ("one", "two", "three"):
            await conn.write_chunk(_chunk(word, chat))
        half = _chunk("four", chat)
        await conn.write_raw(b"%x\r\n%s" % (len(half), half[: len(half) // 2]))
        _reset(conn)
    elif fault == "huge-event":
        conn.start_stream()
        await conn.write_chunk(_chunk("a", chat))
        await conn.write_chunk(b'data: {"choices":[{"index":0,"delta":{"content":"')
        await _fill(conn, fault_bytes, chunked=True)
        await _forever()  # a huge event that never ends: no newline, no end of body
    elif fault == "huge-body":  # chunked: no length to refuse it by, only the bytes as they come
        await conn.write_raw(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                             b"\r\n")
        await conn.write_chunk(b'{"choices":[{"index":0,"message":{"role":"assistant","content":"')
        await _fill(conn, fault_bytes, chunked=True)
        await conn.write_raw(b'5\r\n"}}]}\r\n0\r\n\r\n')
    elif fault == "huge-error":
        await conn.write_raw(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
                             b"Content-Length: %d\r\n\r\n" % fault_bytes)
        await _fill(conn, fault_bytes, chunked=False)
    elif fault == "redirect":
        await conn.write_raw(b"HTTP/1.1 302 Found\r\nLocation: http://example.invalid/v1/chat/completions\r\n"
                             b"Content-Length: 0\r\n\r\n")
    elif fault == "html":
        page = b"<html><body><h1>502 Bad Gateway</h1>nginx</body></html>"
        conn.respond(200, page, True, b"text/html")
    elif fault == "after-done":
        conn.start_stream()
        await conn.write_chunk(_chunk("a", chat) + _chunk("b", chat) + b"data: [DONE]\n\n")
        await conn.write_chunk(_chunk("after", chat) + b'data: {"error":{"message":"after the end"}}\n\n')
        await _forever()
    elif fault == "second-response":
        extra = b'{"unasked":"second answer"}'
        unasked = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            len(extra), extra)
        if stream:
            conn.start_stream()
            done = _chunk("a", chat) + b"data: [DONE]\n\n"
            await conn.write_raw(b"%x\r\n%s\r\n0\r\n\r\n%s" % (len(done), done, unasked))
        else:
            msg = b'{"role":"assistant","content":"a"}' if chat else b'"a"'
            body = b'{"choices":[{"index":0,"%s":%s,"finish_reason":"stop"}]}' % (b"message" if chat else b"text", msg)
            await conn.write_raw(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s%s"
                                 % (len(body), body, unasked))
        await _forever()
    elif fault == "html-error":
        page = b"<html><body><h1>500 Internal Server Error</h1>nginx</body></html>"
        conn.respond(500, page, True, b"text/html")
    else:
        raise ValueError(f"unknown fault {fault!r}; expected one of {', '.join(FAULTS)}")


# 64 KiB of text with what JSON must escape (quotes, a newline, a backslash) and a non-ASCII letter
_TEXT = ('The "river" carried small boats \\ past old mills é\n' * 1300)[:_PIECE]
_TEXT_JSON = json.dumps(_TEXT, ensure_ascii=False).encode()  # (quoted)


async def _big_answer(conn: Conn, size: int, *, chat: bool, messages: bool, end: bool) -> None:
    conn.start_stream()
    if messages:
        await conn.write_chunk(
            b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_big","type":"message",'
            b'"role":"assistant","model":"fake-model","content":[],"stop_reason":null,"usage":{"input_tokens":3,'
            b'"output_tokens":0}}}\n\nevent: content_block_start\ndata: {"type":"content_block_start","index":0,'
            b'"content_block":{"type":"text","text":""}}\n\n')
        event = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":'
                 b'{"type":"text_delta","text":%s}}\n\n' % _TEXT_JSON)
        tail = (b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
                b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
                b'"usage":{"output_tokens":%d}}\n\nevent: message_stop\ndata: {"type":"message_stop"}\n\n'
                % (size // 4))
    else:
        field = b'"delta":{"content":%s}' if chat else b'"text":%s'
        event = b'data: {"id":"big","choices":[{"index":0,%s,"finish_reason":null}]}\n\n' % (field % _TEXT_JSON)
        last = b'"delta":{}' if chat else b'"text":""'
        tail = (b'data: {"id":"big","choices":[{"index":0,%s,"finish_reason":"stop"}]}\n\n'
                b'data: {"id":"big","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n'
                b"data: [DONE]\n\n" % (last, size // 4))
    for _ in range(max(1, size // len(_TEXT))):
        await conn.write_chunk(event)
    if end:
        await conn.write_chunk(tail)
        conn.end_stream(True)


async def _fill(conn: Conn, size: int, *, chunked: bool) -> None:
    piece = b"x" * _PIECE
    sent = 0
    while sent < size:
        part = piece if size - sent >= _PIECE else piece[: size - sent]
        await (conn.write_chunk(part) if chunked else conn.write_raw(part))
        sent += len(part)


def fault_of(body: dict[str, Any]) -> str:
    value = body.get("fake_fault")
    return value if isinstance(value, str) else ""
