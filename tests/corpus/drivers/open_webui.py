"""Drive a real Open WebUI headless against the recorder, so that what it sends is recorded.

Run by tests/corpus/record.py (``open-webui``), with ``RECORDER_URL`` and ``OPEN_WEBUI_BIN`` (the
``open-webui`` command of its own virtualenv). Open WebUI is started on a free port with its data
in the throw-away folder, pointed at the recorder for chat and for RAG embeddings, with user
headers forwarded and the task header of docs/clients.md; then, through its own HTTP API (no
browser): the first user signs up (the admin), lists the models, chats (streamed), chats with a
tool given in the request (native function calling, its default), asks for each background task
(title, tags, follow-ups, retrieval queries, autocomplete), uploads a document (embedded for RAG)
and chats with it attached.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

RECORDER = os.environ["RECORDER_URL"]
BIN = os.environ["OPEN_WEBUI_BIN"]
MODEL = "recorded-model"
EMBED = "recorded-embedding"
START_S = 420.0  # its first start migrates its database and builds its indexes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(base: str, method: str, path: str, body: Any = None, token: str = "", *,
         raw: bytes | None = None, ctype: str = "application/json", timeout: float = 120.0) -> Any:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", ctype)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def step(name: str, fn: Any) -> Any:
    """One step; a failure is printed and the next step still runs (each records on its own)."""
    try:
        out = fn()
        print(f"ok   {name}", flush=True)
        return out
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        detail = exc.read().decode(errors="replace")[:300] if isinstance(exc, urllib.error.HTTPError) else ""
        print(f"FAIL {name}: {exc} {detail}", flush=True)
        return None


def saved_chat_with_builtin_tools(base: str, token: str) -> None:
    """A turn as the browser sends it: in a saved chat, with a session, so that Open WebUI offers
    the model its built-in tools (native function calling), runs the one called and sends the result
    back; the answer goes to the browser's socket, so the turn is awaited through its task list."""
    chat = call(base, "POST", "/api/v1/chats/new", {"chat": {
        "title": "New Chat", "models": [MODEL], "messages": [], "history": {"messages": {}, "currentId": None}}},
        token)
    user_id, reply_id = str(uuid.uuid4()), str(uuid.uuid4())
    call(base, "POST", "/api/chat/completions", {
        "model": MODEL, "stream": True, "chat_id": chat["id"], "id": reply_id, "session_id": "corpus-session",
        "params": {"function_calling": "native"}, "features": {}, "parent_id": user_id,
        "messages": [{"id": user_id, "role": "user", "content": "Search my notes for the word passerelle."}]},
        token)
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        if not call(base, "GET", f"/api/tasks/chat/{chat['id']}", token=token).get("task_ids"):
            return
        time.sleep(0.5)
    raise ValueError("the chat's task did not end within 120 s")


def main() -> int:
    work = Path.cwd()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ,
           "DATA_DIR": str(work / "owui-data"), "WEBUI_SECRET_KEY": "corpus-not-a-secret", "PORT": str(port),
           "OPENAI_API_BASE_URL": f"{RECORDER}/v1", "OPENAI_API_KEY": "dummy-not-a-key",
           "ENABLE_OLLAMA_API": "false", "ENABLE_FORWARD_USER_INFO_HEADERS": "true",
           "OPENAI_API_CONFIGS": json.dumps({"0": {"headers": {"X-OpenWebUI-Task": "{{TASK}}"}}}),
           "RAG_EMBEDDING_ENGINE": "openai", "RAG_OPENAI_API_BASE_URL": f"{RECORDER}/v1",
           "RAG_OPENAI_API_KEY": "dummy-not-a-key", "RAG_EMBEDDING_MODEL": EMBED,
           "ENABLE_AUTOCOMPLETE_GENERATION": "true", "ENABLE_FOLLOW_UP_GENERATION": "true",
           "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "ANONYMIZED_TELEMETRY": "false",
           "DO_NOT_TRACK": "true", "SCARF_NO_ANALYTICS": "true", "ENABLE_VERSION_UPDATE_CHECK": "false",
           "WEBUI_AUTH": "true", "ENABLE_SIGNUP": "true", "ENABLE_WEBSOCKET_SUPPORT": "false"}
    signed = bool(os.environ.get("OPEN_WEBUI_JWT_SECRET"))
    if signed:  # its signed identity (X-OpenWebUI-User-Jwt) instead of the plain headers
        env["FORWARD_USER_INFO_HEADER_JWT_SECRET"] = os.environ["OPEN_WEBUI_JWT_SECRET"]
    log = (work / "open-webui.log").open("wb")
    proc = subprocess.Popen([BIN, "serve", "--host", "127.0.0.1", "--port", str(port)], env=env, cwd=work,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_S
        while True:
            try:
                call(base, "GET", "/health", timeout=5)
                break
            except (urllib.error.URLError, OSError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    print("Open WebUI did not start:\n" + (work / "open-webui.log").read_text(errors="replace")[-3000:])
                    return 1
                time.sleep(1.0)
        print(f"ok   started on {base}", flush=True)
        token = call(base, "POST", "/api/v1/auths/signup",
                     {"name": "Ada Admin", "email": "ada@example.org", "password": "corpus-password-1"})["token"]
        step("models", lambda: call(base, "GET", "/api/models", token=token))
        if signed:
            step("chat (signed identity)", lambda: call(base, "POST", "/api/chat/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "stream": True}, token))
            step("task: title (signed identity)", lambda: call(base, "POST", "/api/v1/tasks/title/completions", {
                "model": MODEL, "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant",
                                                                                  "content": "Hi"}]}, token))
            return 0
        chat_id = str(uuid.uuid4())
        hello = [{"role": "user", "content": "Why is the sky blue? Answer in one sentence."}]
        answer = [*hello, {"role": "assistant", "content": "Because air scatters blue light more than red."}]
        step("chat (streamed)", lambda: call(base, "POST", "/api/chat/completions",
                                             {"model": MODEL, "messages": hello, "stream": True}, token))
        tool = {"type": "function", "function": {
            "name": "get_weather", "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "The city's name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
        step("chat with a native tool", lambda: call(
            base, "POST", "/api/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
             "tools": [tool], "stream": True, "params": {"function_calling": "native"}}, token))
        lyon = [{"role": "user", "content": "And in Lyon?"}]
        called = step("chat with a native tool, not streamed", lambda: call(
            base, "POST", "/api/chat/completions", {"model": MODEL, "messages": lyon, "tools": [tool],
                                                    "stream": False}, token))
        calls = (((called or {}).get("choices") or [{}])[0].get("message") or {}).get("tool_calls") \
            if isinstance(called, dict) else None
        if calls:  # the API caller runs the tool and sends its result back
            step("the tool's result sent back", lambda: call(
                base, "POST", "/api/chat/completions",
                {"model": MODEL, "tools": [tool], "stream": True, "messages": [
                    *lyon, {"role": "assistant", "content": "", "tool_calls": calls},
                    {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temperature": 21}'}]},
                token))
        step("chat in a saved chat with its built-in tools (as the browser sends it)",
             lambda: saved_chat_with_builtin_tools(base, token))
        for name, path, extra in (
                ("title", "/api/v1/tasks/title/completions", {}),
                ("tags", "/api/v1/tasks/tags/completions", {}),
                ("follow-ups", "/api/v1/tasks/follow_up/completions", {}),
                ("retrieval queries", "/api/v1/tasks/queries/completions", {"type": "retrieval"}),
                ("autocomplete", "/api/v1/tasks/auto/completions",
                 {"prompt": "Why is the sky", "type": "search query"})):
            step(f"task: {name}", lambda path=path, extra=extra: call(
                base, "POST", path, {"model": MODEL, "messages": answer, "chat_id": chat_id, **extra}, token))
        boundary = "corpusboundary"
        doc = ("The passerelle gateway schedules requests by class. " * 40).encode()
        form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"notes.txt\"\r\n"
                "Content-Type: text/plain\r\n\r\n").encode() + doc + f"\r\n--{boundary}--\r\n".encode()
        uploaded = step("upload a document (RAG embeddings)", lambda: call(
            base, "POST", "/api/v1/files/?process=true&process_in_background=false", raw=form,
            ctype=f"multipart/form-data; boundary={boundary}", token=token, timeout=300))
        if isinstance(uploaded, dict) and uploaded.get("id"):
            step("chat with the document", lambda: call(
                base, "POST", "/api/chat/completions",
                {"model": MODEL, "stream": True,
                 "messages": [{"role": "user", "content": "What does the gateway schedule by?"}],
                 "files": [{"type": "file", "id": uploaded["id"], "name": "notes.txt"}]}, token, timeout=300))
        version = call(base, "GET", "/api/version")
        print(f"open-webui {version}")
        return 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
