"""Plausible answers for every generating API, so that a real client keeps talking: the recorder
(recorder.py) answers with these while it writes down what the client sent.

The script is an agent turn. A request that offers tools and carries no tool result yet is
answered with a call of one of them (a shell-like tool first, asked to write ``hello.txt``;
otherwise the first tool), its arguments made from the tool's own JSON schema; any other request is
answered with text, or with an instance of its structured-output schema (``response_format``,
Responses' ``text.format``), so that the SDKs' ``parse`` helpers get what they validate.

    >>> example_of({"type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"},
    ...             "b": {"type": ["string", "null"]}}})
    {'a': 1, 'b': None}
    >>> answer("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}).body[:9]
    b'{"id":"ch'
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

import orjson

from passerelle.testing.answers import Answer, Call, Tool, Turn, build, count_tokens, has_tool_result, sse, tools

TEXT = "Done: hello.txt holds the greeting."
SHELL_LINE = "echo hello > hello.txt"
# A tool the script prefers to call, so a coding agent runs something harmless in its sandbox.
PREFERRED_TOOLS = ("Bash", "bash", "shell", "shell_command", "exec_command", "local_shell", "run_command",
                   "Write", "write", "get_weather")
# Values for well-known argument names; everything else comes from the schema.
KNOWN_ARGS: dict[str, Any] = {
    "command": SHELL_LINE, "cmd": SHELL_LINE, "description": "write hello.txt",
    "file_path": "hello.txt", "filePath": "hello.txt", "path": "hello.txt", "content": "hello\n",
    "city": "Paris", "location": "Paris",
}


def example_of(schema: Any, root: Any = None, depth: int = 0, name: str = "") -> Any:
    """A small instance of a JSON schema: every required property (all of them under ``strict``),
    the first enum value, the first non-null branch of ``anyOf`` / a type list, ``$ref`` followed."""
    root = schema if root is None else root
    if depth > 12 or not isinstance(schema, dict):
        return None
    if "$ref" in schema and isinstance(schema["$ref"], str) and schema["$ref"].startswith("#/"):
        target: Any = root
        for part in schema["$ref"][2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return example_of(target, root, depth + 1, name)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if "default" in schema and schema["default"] is not None:
        return schema["default"]
    for key in ("anyOf", "oneOf"):
        options = [b for b in schema.get(key) or () if isinstance(b, dict)]
        branches = [b for b in options if b.get("type") != "null"]
        if len(branches) < len(options) and name not in KNOWN_ARGS:
            return None  # nullable: the least to make (and the end of a recursive model)
        if branches:
            return example_of(branches[0], root, depth + 1, name)
    if isinstance(schema.get("allOf"), list):
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            if isinstance(part, dict):
                merged.update(part)
        return example_of({**merged, **{k: v for k, v in schema.items() if k != "allOf"}}, root, depth + 1, name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = "null" if "null" in kind and name not in KNOWN_ARGS else next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if name in KNOWN_ARGS:
        known = KNOWN_ARGS[name]
        if kind == "string" and isinstance(known, str):
            return known
        if kind == "array" and isinstance(known, str) and name in ("command", "cmd"):
            return ["bash", "-lc", known]
    if kind == "object":
        props = p if isinstance(p := schema.get("properties"), dict) else {}
        required = r if isinstance(r := schema.get("required"), list) else list(props)
        return {k: example_of(props.get(k, {}), root, depth + 1, k) for k in required if isinstance(k, str)}
    if kind == "array":
        n = m if isinstance(m := schema.get("minItems"), int) else 0
        return [example_of(schema.get("items", {}), root, depth + 1) for _ in range(min(n, 3))]
    if kind == "integer":
        low = schema.get("minimum")
        return max(1, low) if isinstance(low, int) else 1
    if kind == "number":
        return 1.0
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return {"date-time": "2026-01-01T00:00:00Z", "date": "2026-01-01", "uri": "https://example.com/",
            "email": "a@example.com"}.get(schema.get("format", ""), "x")


# -- what the request asks for ------------------------------------------------------------------
def _choose_tool(api: str, body: dict[str, Any]) -> Tool | None:
    offered = tools(body)
    choice = body.get("tool_choice")
    if not offered or choice == "none":
        return None
    kind = choice.get("type") if isinstance(choice, dict) else choice
    forced = choice.get("name") or (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    by_name = {t[1]: t for t in offered}
    if forced in by_name:
        return by_name[forced]
    if has_tool_result(api, body):
        if kind not in ("required", "any"):
            return None
        # a tool must be called again: an output tool (pydantic-ai's final_result) ends the run
        return next((t for t in offered if t[1].startswith("final_result")), offered[-1])
    return next((by_name[n] for n in PREFERRED_TOOLS if n in by_name), offered[0])


def _structured(api: str, body: dict[str, Any]) -> str | None:
    """The text of a structured answer, when the request asks for one."""
    fmt: Any = body.get("response_format") if api == "chat" else (body.get("text") or {}).get("format")
    if not isinstance(fmt, dict):
        return None
    schema = fmt.get("json_schema", {}).get("schema") if api == "chat" else fmt.get("schema")
    if fmt.get("type") == "json_schema" and isinstance(schema, dict):
        return orjson.dumps(example_of(schema)).decode()
    return "{}" if fmt.get("type") == "json_object" else None


def scripted_call(api: str, body: dict[str, Any]) -> Call | None:
    """The call the script makes for ``body``: the chosen tool, its arguments made from its schema
    (a custom tool's input a shell line); None when the request asks for no call."""
    tool = _choose_tool(api, body)
    if tool is None:
        return None
    kind, name, schema = tool
    args = SHELL_LINE if kind == "custom" else orjson.dumps(example_of(schema) if schema else {}).decode()
    return Call(name, args, "toolu_rec1" if api == "messages" else "call_rec1", custom=kind == "custom")


def _turn(api: str, body: dict[str, Any]) -> Turn:
    """The script's turn: a call of the chosen tool, else text; thinking first when the request
    asks for it."""
    call = scripted_call(api, body)
    if api == "messages":
        thinking = body.get("thinking")
        return Turn(TEXT, call, isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive"))
    # Responses: a reasoning item, which agents send back (Codex)
    return Turn(_structured(api, body) or TEXT, call, api == "responses" and isinstance(body.get("reasoning"), dict))


# -- the answers, per API -------------------------------------------------------------------------
def answer(api: str, body: dict[str, Any]) -> Answer:
    """The answer to one request of ``api`` (the gateway's endpoint names: chat, responses...)."""
    if api in ("chat", "responses", "messages"):
        return build(api, body, _turn(api, body))
    if api in ("count_tokens", "responses_input_tokens"):
        return count_tokens(body)
    if api == "completions":
        return _completions(body)
    if api == "embeddings":
        return _embeddings(body)
    return Answer(404, body=orjson.dumps({"error": {"message": f"no scripted answer for {api}",
                                                    "type": "invalid_request_error", "code": 404}}))


def _completions(body: dict[str, Any]) -> Answer:
    out = {"id": "cmpl-rec1", "object": "text_completion", "created": int(time.time()),
           "model": str(body.get("model", "m")),
           "choices": [{"index": 0, "text": TEXT, "finish_reason": "stop", "logprobs": None}],
           "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}}
    if not body.get("stream"):
        return Answer(body=orjson.dumps(out))
    return Answer(content_type="text/event-stream", events=[sse(out), b"data: [DONE]\n\n"])


def _embeddings(body: dict[str, Any]) -> Answer:
    inputs = body.get("input")
    count = len(inputs) if isinstance(inputs, list) and inputs and not isinstance(inputs[0], int) else 1
    dims = d if isinstance(d := body.get("dimensions"), int) else 8
    vector = [round(1.0 / (i + 1), 4) for i in range(dims)]
    encoded: Any = vector
    if body.get("encoding_format") == "base64":
        encoded = base64.b64encode(struct.pack(f"<{dims}f", *vector)).decode()
    return Answer(body=orjson.dumps({"object": "list", "model": str(body.get("model")),
                                     "data": [{"object": "embedding", "index": i, "embedding": encoded}
                                              for i in range(count)],
                                     "usage": {"prompt_tokens": 4, "total_tokens": 4}}))
