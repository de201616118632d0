"""A runtime scripted to make an agent run a tool: the other half of a tool round trip.

``python -m passerelle.testing.tool_runtime --port P --workdir DIR --record FILE`` serves chat
completions, Responses and Messages (streamed or not, and ``count_tokens``). On a request that
offers a tool it knows (Claude Code's ``Write``/``Bash``, Codex's ``shell``/``shell_command``/
``exec_command``, opencode's ``write``/``bash``) and carries no tool result yet, it answers with a
call to that tool that writes ``hello.txt`` with :data:`CONTENT` in ``--workdir``, in the API's
own tool-call shape; once the conversation carries a tool result, and on any other request, it
answers with plain text. Every request is appended to ``--record`` as one JSON line
(``{"path", "body", "answer"}``) for the test to read: which tools were offered, what came back.

Tests start it like the fake runtime (a subprocess on a free loopback port) and put it behind the
gateway as an ``openai`` backend with ``endpoints = ["chat", "responses", "messages",
"count_tokens"]``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FILENAME = "hello.txt"
CONTENT = "hello from passerelle"
FINAL_TEXT = "I wrote hello.txt."
PLAIN_TEXT = "Hello from the scripted runtime."
MAX_BODY = 64 * 1024 * 1024
_ids = itertools.count(1)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]
    id: str  # the call's id: Messages' tool_use id, chat's tool_calls id, Responses' call_id

    def record(self) -> dict[str, Any]:
        return {"tool": self.name, "arguments": self.arguments, "call_id": self.id}


# -- what to answer ---------------------------------------------------------------------------
def tool_names(body: dict[str, Any]) -> list[str]:
    """The tools a request offers, by name: chat's ``{"function": {"name"}}``, Responses' and
    Messages' ``{"name"}`` (function and custom tools alike)."""
    out = []
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        name = tool.get("name")
        if not isinstance(name, str) and isinstance(tool.get("function"), dict):
            name = tool["function"].get("name")
        if isinstance(name, str):
            out.append(name)
    return out


def has_tool_result(api: str, body: dict[str, Any]) -> bool:
    """Does the conversation already carry a tool's result?"""
    if api == "chat":
        return any(isinstance(m, dict) and m.get("role") == "tool" for m in body.get("messages") or [])
    if api == "responses":
        items = body.get("input")
        return isinstance(items, list) and any(
            isinstance(i, dict) and str(i.get("type", "")).endswith("_output") for i in items)
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(c, dict) and c.get("type") == "tool_result" for c in content):
            return True
    return False


def tool_call(names: list[str], workdir: Path) -> Call | None:
    """The call that writes hello.txt with one of the offered tools."""
    target = workdir / FILENAME
    script = f"printf %s {shlex.quote(CONTENT)} > {shlex.quote(str(target))}"
    calls: dict[str, dict[str, Any]] = {
        "Write": {"file_path": str(target), "content": CONTENT},  # Claude Code
        "write": {"filePath": str(target), "content": CONTENT},  # opencode
        "shell": {"command": ["bash", "-lc", script], "workdir": str(workdir)},  # Codex
        "shell_command": {"command": script, "workdir": str(workdir)},  # Codex
        "exec_command": {"cmd": script, "workdir": str(workdir)},  # Codex (unified exec)
        "Bash": {"command": script, "description": "Write hello.txt"},  # Claude Code
        "bash": {"command": script, "description": "Write hello.txt"},  # opencode
    }
    for name, args in calls.items():
        if name in names:
            return Call(name, args, f"call_{next(_ids)}")
    return None


def decide(api: str, body: dict[str, Any], workdir: Path) -> Call | str:
    """A tool call, or the text to answer."""
    if has_tool_result(api, body):
        return FINAL_TEXT
    call = tool_call(tool_names(body), workdir)
    return call if call is not None else PLAIN_TEXT


# -- the answer in each API's words ---------------------------------------------------------------
def _sse(event: str | None, data: Any) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def chat_answer(model: str, answer: Call | str, stream: bool,
                usage_chunk: bool) -> Iterator[bytes] | dict[str, Any]:
    rid, created = f"chatcmpl-{next(_ids)}", int(time.time())
    usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    if isinstance(answer, str):
        message: dict[str, Any] = {"role": "assistant", "content": answer}
        finish = "stop"
    else:
        call = {"id": answer.id, "type": "function",
                "function": {"name": answer.name, "arguments": json.dumps(answer.arguments)}}
        message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    if not stream:
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return _sse(None, {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})

    def events() -> Iterator[bytes]:
        yield chunk({"role": "assistant", "content": ""})
        if isinstance(answer, str):
            yield chunk({"content": answer})
        else:
            call = message["tool_calls"][0]
            yield chunk({"tool_calls": [{"index": 0, "id": call["id"], "type": "function",
                                         "function": {"name": answer.name, "arguments": ""}}]})
            yield chunk({"tool_calls": [{"index": 0, "function": {"arguments": call["function"]["arguments"]}}]})
        yield chunk({}, finish)
        if usage_chunk:
            yield _sse(None, {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                              "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    return events()


def responses_answer(model: str, answer: Call | str,
                     stream: bool) -> Iterator[bytes] | dict[str, Any]:
    rid = f"resp_{next(_ids)}"
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}
    if isinstance(answer, str):
        item: dict[str, Any] = {"type": "message", "id": f"msg_{next(_ids)}", "status": "completed",
                                "role": "assistant",
                                "content": [{"type": "output_text", "text": answer, "annotations": []}]}
    else:
        item = {"type": "function_call", "id": f"fc_{next(_ids)}", "call_id": answer.id,
                "name": answer.name, "arguments": json.dumps(answer.arguments), "status": "completed"}
    done = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "completed", "model": model,
            "output": [item], "usage": usage}
    if not stream:
        return done

    def events() -> Iterator[bytes]:
        seq = itertools.count()
        pending = {**done, "status": "in_progress", "output": [], "usage": None}
        yield _sse("response.created", {"type": "response.created", "sequence_number": next(seq), "response": pending})
        yield _sse("response.in_progress", {"type": "response.in_progress", "sequence_number": next(seq),
                                            "response": pending})
        base = {"output_index": 0, "item_id": item["id"]}
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield _sse("response.output_item.added", {
                "type": "response.output_item.added", "sequence_number": next(seq), "output_index": 0,
                "item": {**item, "status": "in_progress", "content": []}})
            part = {"type": "output_text", "text": "", "annotations": []}
            yield _sse("response.content_part.added", {"type": "response.content_part.added", **base,
                                                       "content_index": 0, "sequence_number": next(seq), "part": part})
            yield _sse("response.output_text.delta", {"type": "response.output_text.delta", **base, "content_index": 0,
                                                      "sequence_number": next(seq), "delta": text, "logprobs": []})
            yield _sse("response.output_text.done", {"type": "response.output_text.done", **base, "content_index": 0,
                                                     "sequence_number": next(seq), "text": text, "logprobs": []})
            yield _sse("response.content_part.done", {"type": "response.content_part.done", **base, "content_index": 0,
                                                      "sequence_number": next(seq), "part": {**part, "text": text}})
        else:
            yield _sse("response.output_item.added", {
                "type": "response.output_item.added", "sequence_number": next(seq), "output_index": 0,
                "item": {**item, "arguments": "", "status": "in_progress"}})
            yield _sse("response.function_call_arguments.delta", {
                "type": "response.function_call_arguments.delta", **base, "sequence_number": next(seq),
                "delta": item["arguments"]})
            yield _sse("response.function_call_arguments.done", {
                "type": "response.function_call_arguments.done", **base, "sequence_number": next(seq),
                "arguments": item["arguments"]})
        yield _sse("response.output_item.done", {"type": "response.output_item.done", "sequence_number": next(seq),
                                                 "output_index": 0, "item": item})
        yield _sse("response.completed", {"type": "response.completed", "sequence_number": next(seq),
                                          "response": done})

    return events()


def messages_answer(model: str, answer: Call | str,
                    stream: bool) -> Iterator[bytes] | dict[str, Any]:
    mid = f"msg_{next(_ids)}"
    if isinstance(answer, str):
        block: dict[str, Any] = {"type": "text", "text": answer}
        stop = "end_turn"
    else:
        block = {"type": "tool_use", "id": answer.id, "name": answer.name, "input": answer.arguments}
        stop = "tool_use"
    whole = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [block],
             "stop_reason": stop, "stop_sequence": None, "usage": {"input_tokens": 10, "output_tokens": 5}}
    if not stream:
        return whole

    def events() -> Iterator[bytes]:
        start = {**whole, "content": [], "stop_reason": None, "usage": {"input_tokens": 10, "output_tokens": 1}}
        yield _sse("message_start", {"type": "message_start", "message": start})
        if block["type"] == "text":
            yield _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}})
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            yield _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {**block, "input": {}}})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
        yield _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                     "usage": {"output_tokens": 5}})
        yield _sse("message_stop", {"type": "message_stop"})

    return events()


# -- the server ---------------------------------------------------------------------------------
_APIS = {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the record file is the log

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path in ("/health", "/v1/models"):
            self._json(200, {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "test"}
                                                        for m in self.server.models]})
        else:
            self._json(404, {"error": {"message": f"no route {path}", "type": "not_found"}})

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._json(413, {"error": {"message": "body too large", "type": "invalid_request_error"}})
            return
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._json(400, {"error": {"message": "expected a JSON object", "type": "invalid_request_error"}})
            return
        if path == "/v1/messages/count_tokens":
            self._record(path, body, "count")
            self._json(200, {"input_tokens": max(1, len(raw) // 4)})
            return
        api = _APIS.get(path)
        if api is None:
            self._json(404, {"error": {"message": f"no route {path}", "type": "not_found"}})
            return
        answer = decide(api, body, self.server.workdir)
        self._record(path, body, answer if isinstance(answer, str) else answer.record())
        model, stream = str(body.get("model", "")), body.get("stream") is True
        if api == "chat":
            include = isinstance(body.get("stream_options"), dict) and body["stream_options"].get("include_usage")
            out = chat_answer(model, answer, stream, bool(include))
        elif api == "responses":
            out = responses_answer(model, answer, stream)
        else:
            out = messages_answer(model, answer, stream)
        if isinstance(out, dict):
            self._json(200, out)
        else:
            self._stream(out)

    def _record(self, path: str, body: dict[str, Any], answer: Any) -> None:
        line = json.dumps({"path": path, "body": body, "answer": answer}) + "\n"
        with self.server.lock, open(self.server.record, "a") as f:
            f.write(line)

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: Iterator[bytes]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for ev in events:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], *, workdir: Path, record: Path, models: list[str]) -> None:
        super().__init__(addr, _Handler)
        self.workdir, self.record, self.models = workdir, record, models
        self.lock = threading.Lock()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m passerelle.testing.tool_runtime", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workdir", type=Path, required=True, help="where the tool call writes hello.txt")
    p.add_argument("--record", type=Path, required=True, help="JSON lines file: every request and its answer")
    p.add_argument("--model", action="append", default=[], help="model id listed by /v1/models (repeatable)")
    args = p.parse_args(argv)
    server = _Server((args.host, args.port), workdir=args.workdir.resolve(), record=args.record,
                     models=args.model or ["scripted"])
    print(f"tool runtime on http://{args.host}:{server.server_address[1]}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
