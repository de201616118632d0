"""A development tool: an HTTP endpoint that answers every inference API plausibly (scripted.py)
and writes down each request a client sends, for the corpus the tests replay
(tests/corpus/, tests/unit/test_corpus_replay.py; tests/corpus/record.py drives the clients).

Each POST becomes one file, ``<out>/<NNN>-<api>.json``::

    {"client": "claude-code", "version": "2.1.332", "api": "messages", "method": "POST",
     "path": "/v1/messages?beta=true", "headers": {...the ones that matter...}, "body": {...}}

What is kept and what is not:

* headers: only those a gateway or runtime acts on (:data:`KEPT_HEADERS`, and Open WebUI's
  ``x-openwebui-*``); never a key (``authorization``, ``x-api-key`` are not in the list);
* the body: its structure whole (every tool and every schema verbatim, every content part, tool
  call and tool result), with long prose cut to a placeholder that keeps its first words and says
  how long it was, a tool's own long description likewise (its schema is kept whole), and
  images, audio and documents replaced by tiny ones of the same media type.

    >>> shorten({"messages": [{"role": "user", "content": "word " * 100}]})["messages"][0]["content"]
    'word word word word word word word word word wor… [500 chars]'
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

from passerelle.server.routes import Access, match
from passerelle.testing.scripted import answer

KEPT_HEADERS = ("content-type", "accept", "user-agent", "anthropic-version", "anthropic-beta", "openai-beta",
                "x-claude-code-session-id", "session-id", "session_id", "conversation_id", "originator",
                "x-app", "x-priority")
PROSE_LIMIT = 160  # a longer string (outside schemas) is prose: it becomes a placeholder
TOOL_DESCRIPTION_LIMIT = 400
# Keys whose value is a schema or a tool's arguments: kept verbatim, whatever their size.
VERBATIM = frozenset({"parameters", "input_schema", "schema", "json_schema", "arguments", "input_json", "tools"})
# 1x1 images and the smallest files of each media type, for the binary parts a client sent.
TINY = {
    "image/png": ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJ"
                  "RU5ErkJggg=="),
    "image/jpeg": ("/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAMCAgICAgMCAgIDAwMDBAYEBAQEBAgGBgUGCQgKCgkICQkKDA8MCgsOCwkJDRENDg8"
                   "QEBEQCgwSExIQEw8QEBD/yQALCAABAAEBAREA/8wABgAQEAX/2gAIAQEAAD8A0s8g/9k="),
    "image/gif": "R0lGODlhAQABAIAAAAAAAP///yH5BAEAAAAALAAAAAABAAEAAAIBRAA7",
    "audio/wav": "UklGRigAAABXQVZFZm10IBAAAAABAAEAQB8AAEAfAAABAAgAZGF0YQQAAACAgICA",  # 4 samples of silence
    "application/pdf": ("JVBERi0xLjEKMSAwIG9iajw8L1R5cGUvQ2F0YWxvZy9QYWdlcyAyIDAgUj4+ZW5kb2JqCjIgMCBvYmo8PC9UeXBl"
                        "L1BhZ2VzL0tpZHNbMyAwIFJdL0NvdW50IDE+PmVuZG9iagozIDAgb2JqPDwvVHlwZS9QYWdlL1BhcmVudCAyIDAg"
                        "Ui9NZWRpYUJveFswIDAgMyAzXT4+ZW5kb2JqCnRyYWlsZXI8PC9Sb290IDEgMCBSPj4K"),
}
_ID = re.compile(r"(?<![0-9a-f])(?:[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{64})"
                 r"(?![0-9a-f])")
_ZEROS = str.maketrans("0123456789abcdef", "0000000000000000")
_BINARY_KEYS = frozenset({"data", "file_data", "image_url", "url", "audio"})


def _tiny(media_type: str) -> str:
    return TINY.get(media_type, TINY["image/png"] if media_type.startswith("image/") else
                    TINY["audio/wav"] if media_type.startswith("audio/") else TINY["application/pdf"])


def _placeholder(text: str) -> str:
    return text[:48] + f"… [{len(text)} chars]"


def _binary(key: str, value: str, parent: dict[str, Any]) -> str | None:
    """A tiny stand-in for a long base64 payload or data URL, or None when ``value`` is not one."""
    if value.startswith("data:") and ";base64," in value[:80]:
        media = value[5:value.index(";")]
        return f"data:{media};base64,{_tiny(media)}"
    if key in ("data", "file_data", "audio"):
        media = parent.get("media_type") or ({"mp3": "audio/mpeg", "wav": "audio/wav"}.get(parent.get("format", ""))
                                             or ("audio/wav" if "format" in parent else "application/pdf"))
        return _tiny(str(media))
    return None


def shorten(value: Any, key: str = "", parent: dict[str, Any] | None = None) -> Any:
    """``value`` with its prose cut and its binary parts made tiny (see the module's docstring)."""
    if isinstance(value, dict):
        return {k: _tools(v) if k == "tools" else v if k in VERBATIM else shorten(v, k, value)
                for k, v in value.items()}
    if isinstance(value, list):
        return [shorten(v, key, parent) for v in value]
    if isinstance(value, str) and len(value) > PROSE_LIMIT:
        if key in _BINARY_KEYS:
            tiny = _binary(key, value, parent or {})
            if tiny is not None:
                return tiny
        return _placeholder(value)
    return value


def _tools(tools: Any) -> Any:
    """Tools verbatim, but for a long description of the tool itself (its schema stays whole)."""
    if not isinstance(tools, list):
        return tools
    return [_tool(t) for t in tools]


def _tool(tool: Any) -> Any:
    if not isinstance(tool, dict):
        return tool
    out = dict(tool)
    if isinstance(out.get("function"), dict):  # chat's {"type": "function", "function": {...}}
        out["function"] = _tool(out["function"])
    text = out.get("description")
    if isinstance(text, str) and len(text) > TOOL_DESCRIPTION_LIMIT:
        out["description"] = _placeholder(text)
    return out


def kept_headers(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    out = {}
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1").lower()
        if name in KEPT_HEADERS or name.startswith("x-openwebui-"):
            out[name] = raw_value.decode("latin-1")
    return out


class Recorder:
    """The ASGI app: answers (scripted.py) and writes each POST to ``out`` (``NNN-api.json``)."""

    def __init__(self, out: Path, client: str, version: str, *, literal: dict[str, str] | None = None) -> None:
        self.out, self.client, self.version = out, client, version
        self.count = 0
        # Stable stand-ins, so that a re-recording's diff shows what the client changed, not its
        # fresh ids: each id (a UUID, a 64-hex device id) is numbered in order of appearance, and
        # ``literal`` strings (the throw-away folder's path) are replaced as given.
        self.literal = dict(literal or {})
        self.ids: dict[str, str] = {}
        out.mkdir(parents=True, exist_ok=True)

    def stable(self, text: str) -> str:
        for old, new in self.literal.items():
            text = text.replace(old, new)

        def number(m: re.Match[str]) -> str:
            found = m.group(0)
            if found not in self.ids:
                n = f"{len(self.ids) + 1:x}"
                self.ids[found] = found[: len(found) - len(n)].translate(_ZEROS) + n
            return self.ids[found]

        return _ID.sub(number, text)

    def api_of(self, method: str, path: str) -> str:
        try:
            route = match(method, path)
        except Exception:
            return "unknown"
        return route.target if route.access is Access.INFERENCE else "unknown"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw, method, path = b"".join(chunks), scope["method"], scope["path"]
        if method == "GET" and path.rstrip("/").endswith("/models"):
            await _respond(send, 200, "application/json", [orjson.dumps({"object": "list", "data": [
                {"id": "recorded-model", "object": "model", "created": 0, "owned_by": "recorder"}]})])
            return
        api = self.api_of(method, path)
        try:
            body = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            body = None
        if method != "POST" or not isinstance(body, dict):
            await _respond(send, 404, "application/json", [b'{"error":{"message":"not recorded","type":"not_found"}}'])
            return
        self.count += 1
        query = scope.get("query_string", b"").decode("latin-1")
        record = {"client": self.client, "version": self.version, "api": api, "method": method,
                  "path": path + (f"?{query}" if query else ""), "headers": kept_headers(scope["headers"]),
                  "body": shorten(body)}
        name = self.out / f"{self.count:03d}-{api}.json"
        text = self.stable(orjson.dumps(record, option=orjson.OPT_INDENT_2).decode())
        name.write_text(text + "\n")
        ans = answer(api, body)
        await _respond(send, ans.status, ans.content_type, ans.events or [ans.body])


async def _respond(send: Any, status: int, ctype: str, parts: list[bytes]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype.encode())]})
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})
        await asyncio.sleep(0)
    if not parts:
        await send({"type": "http.response.body", "body": b""})


@contextlib.asynccontextmanager
async def serving(recorder: Recorder, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """Serve ``recorder`` on a free port of ``host`` in this loop; yields its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(recorder, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()
