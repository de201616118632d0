"""A runtime scripted to make an agent run a tool: the other half of a tool round trip.

``python -m passerelle.testing.tool_runtime --port P --workdir DIR --record FILE`` serves chat
completions, Responses and Messages (streamed or not, and ``count_tokens``). On a request that
offers a tool it knows (Claude Code's ``Write``/``Bash``, Codex's ``shell``/``shell_command``/
``exec_command``, opencode's ``write``/``bash``) and carries no tool result yet, it answers with a
call to that tool that writes ``hello.txt`` with :data:`CONTENT` in ``--workdir``, in the API's
own tool-call shape; once the conversation carries a tool result, and on any other request, it
answers with plain text. Every request is appended to ``--record`` as one JSON line
(``{"path", "body", "answer"}``) for the test to read: which tools were offered, what came back.
The answers themselves are answers.py's, the same as the corpus recorder's script gives.

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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from passerelle.testing.answers import Answer, Call, Turn, build, count_tokens, has_tool_result, tools
from passerelle.testing.scripted import scripted_call
from passerelle.testing.tool_call_text import FORMATS, as_text

FILENAME = "hello.txt"
CONTENT = "hello from passerelle"
FINAL_TEXT = "I wrote hello.txt."
PLAIN_TEXT = "Hello from the scripted runtime."
MAX_BODY = 64 * 1024 * 1024
_ids = itertools.count(1)


# -- what to answer ---------------------------------------------------------------------------
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
            return Call(name, json.dumps(args), f"call_{next(_ids)}")
    return None


def decide(api: str, body: dict[str, Any], workdir: Path, *, tool_format: str | None = None,
           any_tool: bool = False) -> Turn:
    """A call of the agent's tool, or the text to answer. ``any_tool``: a request offering any tool
    gets a call: scripted.py's choice of tool, its arguments made from the tool's own schema
    (another client's ``Write`` is not Claude Code's). ``tool_format``: the call is written as that
    format's markup in the text, as a runtime without a tool parser answers (tool_call_text.py), and
    the answer ends as plain text."""
    tag = str(next(_ids))
    if has_tool_result(api, body):
        return Turn(FINAL_TEXT, tag=tag)
    if any_tool:
        made = scripted_call(api, body)
        call = None if made is None else Call(made.name, made.arguments, f"call_{tag}", custom=made.custom)
    else:
        call = tool_call([name for _, name, _ in tools(body)], workdir)
    if call is not None and tool_format is not None and not call.custom:
        return Turn(as_text(tool_format, call.name, call.arguments), tag=tag)
    return Turn(PLAIN_TEXT, call, tag=tag)


def record_of(turn: Turn) -> Any:
    """What the record file says was answered: the text, or the tool, its arguments and call id."""
    if turn.call is None:
        return turn.text
    return {"tool": turn.call.name, "arguments": json.loads(turn.call.arguments), "call_id": turn.call.id}


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
            self._answer(count_tokens(body))
            return
        api = _APIS.get(path)
        if api is None:
            self._json(404, {"error": {"message": f"no route {path}", "type": "not_found"}})
            return
        turn = decide(api, body, self.server.workdir, tool_format=self.server.tool_format,
                      any_tool=self.server.any_tool)
        self._record(path, body, record_of(turn))
        self._answer(build(api, body, turn))

    def _record(self, path: str, body: dict[str, Any], answer: Any) -> None:
        line = json.dumps({"path": path, "body": body, "answer": answer}) + "\n"
        with self.server.lock, open(self.server.record, "a") as f:
            f.write(line)

    def _json(self, status: int, obj: Any) -> None:
        self._answer(Answer(status, body=json.dumps(obj).encode()))

    def _answer(self, answer: Answer) -> None:
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.content_type)
        if answer.content_type != "text/event-stream":
            self.send_header("Content-Length", str(len(answer.body)))
            self.end_headers()
            self.wfile.write(answer.body)
            return
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for ev in answer.events:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], *, workdir: Path, record: Path, models: list[str],
                 tool_format: str | None = None, any_tool: bool = False) -> None:
        super().__init__(addr, _Handler)
        self.workdir, self.record, self.models = workdir, record, models
        self.tool_format, self.any_tool = tool_format, any_tool
        self.lock = threading.Lock()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m passerelle.testing.tool_runtime", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workdir", type=Path, required=True, help="where the tool call writes hello.txt")
    p.add_argument("--record", type=Path, required=True, help="JSON lines file: every request and its answer")
    p.add_argument("--model", action="append", default=[], help="model id listed by /v1/models (repeatable)")
    p.add_argument("--tool-format", choices=sorted(FORMATS),
                   help="write each call as this format's markup in the answer's text (as a runtime without "
                        "a tool parser does) instead of the API's own tool call")
    p.add_argument("--any-tool", action="store_true",
                   help="call a tool of any request that offers one (arguments made from its schema), not only "
                        "the agents' file-writing and shell tools")
    args = p.parse_args(argv)
    server = _Server((args.host, args.port), workdir=args.workdir.resolve(), record=args.record,
                     models=args.model or ["scripted"], tool_format=args.tool_format, any_tool=args.any_tool)
    print(f"tool runtime on http://{args.host}:{server.server_address[1]}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
