"""The tool runtime's script (passerelle/testing/tool_runtime.py): which of an agent's tools it
calls, with what, and that the call it records is the one the shared answer builders send."""

from __future__ import annotations

import json
from pathlib import Path

import orjson

from passerelle.testing import tool_runtime
from passerelle.testing.answers import build

BASH = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}


def test_the_agents_tool_is_called_then_the_run_ends_with_text(tmp_path: Path) -> None:
    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "Write hello.txt."}],
            "tools": [{"name": "Bash", "input_schema": BASH}, {"name": "Write", "input_schema": BASH}]}
    turn = tool_runtime.decide("messages", body, tmp_path)
    record = tool_runtime.record_of(turn)
    assert record["tool"] == "Write"  # the file-writing tool before the shell
    assert record["arguments"] == {"file_path": str(tmp_path / "hello.txt"), "content": tool_runtime.CONTENT}
    [block] = orjson.loads(build("messages", body, turn).body)["content"]
    assert (block["type"], block["id"], block["input"]) == ("tool_use", record["call_id"], record["arguments"])
    body["messages"] += [{"role": "assistant", "content": [block]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": block["id"], "content": "ok"}]}]
    assert tool_runtime.record_of(tool_runtime.decide("messages", body, tmp_path)) == tool_runtime.FINAL_TEXT


def test_codex_and_opencode_get_their_tools_in_their_apis(tmp_path: Path) -> None:
    codex = {"model": "m", "stream": True, "input": "Write hello.txt.", "tools": [
        {"type": "custom", "name": "apply_patch"}, {"type": "function", "name": "exec_command", "parameters": BASH}]}
    turn = tool_runtime.decide("responses", codex, tmp_path)
    assert turn.call is not None and turn.call.name == "exec_command"
    assert json.loads(turn.call.arguments)["workdir"] == str(tmp_path)
    events = b"".join(build("responses", codex, turn).events)
    assert b'"type":"response.function_call_arguments.done"' in events and turn.call.id.encode() in events
    opencode = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "write", "parameters": BASH}}]}
    assert tool_runtime.record_of(tool_runtime.decide("chat", opencode, tmp_path))["tool"] == "write"
    unknown = {**opencode, "tools": [{"type": "function", "function": {"name": "lookup", "parameters": BASH}}]}
    assert tool_runtime.record_of(tool_runtime.decide("chat", unknown, tmp_path)) == tool_runtime.PLAIN_TEXT
