"""agentcheck's side of the corpus and its report: which recorded requests are tool turns (new
corpus folders picked up as they appear), how a recorded request is replayed (its model and stream
replaced, its credentials never sent), the matrix, and the command's refusals."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from passerelle.bench import agentcheck, agentcheck_cli, agentcheck_report
from passerelle.bench.tool_schema import problems
from passerelle.cli import main
from passerelle.testing import tool_runtime
from passerelle.testing.tool_call_text import FORMATS

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def write(corpus: Path, name: str, api: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    path = corpus / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"client": path.parent.name, "api": api, "path": "/v1/x",
                                "headers": headers or {}, "body": body}))


def test_the_tool_turns_of_any_client_folder(tmp_path: Path) -> None:
    user = {"role": "user", "content": "ls"}
    write(tmp_path, "new-front-end/001-chat.json", "chat", {"messages": [user], "tools": TOOLS})
    write(tmp_path, "new-front-end/002-chat.json", "chat", {"messages": [user, {"role": "tool", "content": "x"}],
                                                            "tools": TOOLS})  # after the result: text expected
    write(tmp_path, "new-front-end/003-chat.json", "chat", {"messages": [user], "tools": TOOLS, "tool_choice": "none"})
    write(tmp_path, "new-front-end/004-chat.json", "chat", {"messages": [user], "tools": []})
    write(tmp_path, "other/001-embeddings.json", "embeddings", {"input": "x", "tools": TOOLS})
    write(tmp_path, "other/002-messages.json", "messages",
          {"messages": [user], "tools": [{"name": "bash", "input_schema": {"type": "object"}}]})
    write(tmp_path, "other/003-responses.json", "responses",
          {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}],
           "tools": [{"type": "function", "name": "bash", "parameters": {}}]})
    (tmp_path / "other" / "broken.json").write_text("{")
    turns = agentcheck.load_turns(tmp_path)
    assert [(t.name, t.api, t.client) for t in turns] == [("new-front-end/001-chat", "chat", "new-front-end"),
                                                          ("other/002-messages", "messages", "other")]
    assert [t.name for t in agentcheck.load_turns(tmp_path, ("chat",))] == ["new-front-end/001-chat"]


def test_the_repository_corpus_has_tool_turns_of_every_agent() -> None:
    corpus = agentcheck.default_corpus()
    assert corpus is not None
    turns = agentcheck.load_turns(corpus)
    assert {"claude-code/001-messages", "codex/001-responses", "opencode/002-chat"} <= {t.name for t in turns}
    assert {t.api for t in turns} == set(agentcheck.APIS)


def test_prepare_replaces_the_model_and_the_stream_and_bounds_the_output() -> None:
    turn = agentcheck.Turn("c", "c/1", "chat", {"model": "recorded", "stream": True, "max_tokens": 32000,
                                                 "stream_options": {"include_usage": True}, "messages": []}, {})
    body = agentcheck.prepare(turn, "mine", False, max_tokens=256)
    assert (body["model"], body["stream"], body["max_tokens"], "stream_options" in body) == ("mine", False, 256, False)
    assert turn.body["model"] == "recorded"  # the recorded turn is left as it was
    streamed = agentcheck.prepare(turn, "mine", True)
    assert (streamed["max_tokens"], streamed["stream_options"]) == (32000, {"include_usage": True})
    responses = agentcheck.Turn("c", "c/2", "responses", {"input": "x"}, {})
    assert agentcheck.prepare(responses, "m", True, max_tokens=64)["max_output_tokens"] == 64


def test_a_bounded_messages_turn_drops_a_thinking_budget_it_no_longer_fits() -> None:
    """anthropic-python/006 thinks with budget_tokens 2048 of max_tokens 4096: bounded to 64, the
    request was invalid (a runtime answered 400 "budget_tokens must be < max_tokens"), not the model."""
    thinking = {"type": "enabled", "budget_tokens": 2048}
    turn = agentcheck.Turn("c", "c/3", "messages", {"max_tokens": 4096, "thinking": thinking, "messages": []}, {})
    assert "thinking" not in agentcheck.prepare(turn, "m", False, max_tokens=64)
    assert agentcheck.prepare(turn, "m", False, max_tokens=3000)["thinking"] == thinking
    assert agentcheck.prepare(turn, "m", False)["thinking"] == thinking


@pytest.fixture
def echo() -> Iterator[tuple[str, list[dict[str, str]]]]:
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append({k.lower(): v for k, v in self.headers.items()} | {"path": self.path})
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    server.shutdown()
    thread.join(5)
    server.server_close()


def test_ask_replays_the_clients_headers_but_never_a_credential(echo: tuple[str, list[dict[str, str]]]) -> None:
    url, seen = echo
    recorded = {"user-agent": "claude-cli/2.1", "anthropic-version": "2023-06-01", "x-api-key": "recorded",
                "authorization": "Bearer recorded", "x-openwebui-user-jwt": "eyJ", "content-length": "9"}
    turn = agentcheck.Turn("c", "c/1", "messages", {}, recorded)
    assert agentcheck.ask(url, turn, {"model": "m"}, "k1", 10) == (200, b"{}")
    assert agentcheck.ask(url, turn, {"model": "m"}, None, 10) == (200, b"{}")
    with_key, without = seen
    assert with_key["path"] == "/v1/messages"
    assert (with_key["user-agent"], with_key["anthropic-version"]) == ("claude-cli/2.1", "2023-06-01")
    assert (with_key["x-api-key"], with_key["authorization"]) == ("k1", "Bearer k1")
    assert not {"x-api-key", "authorization", "x-openwebui-user-jwt"} & set(without)


def test_run_asks_each_turn_streamed_and_not_repeat_times(echo: tuple[str, list[dict[str, str]]]) -> None:
    url, seen = echo
    turn = agentcheck.Turn("c", "c/1", "chat", {"messages": [], "tools": TOOLS}, {})
    rows = agentcheck.run([agentcheck.Target(url, "off")], "m", [turn], (False, True), repeat=3, timeout=10)
    assert [(r["stream"], r["sample"]) for r in rows] == [(False, 0), (False, 1), (False, 2), (True, 0), (True, 1),
                                                          (True, 2)]
    assert len(seen) == 6 and not any(r["passed"] for r in rows)  # "{}" is no answer a client can read


def test_ask_says_when_nothing_answers() -> None:
    turn = agentcheck.Turn("c", "c/1", "chat", {}, {})
    status, body = agentcheck.ask("http://127.0.0.1:9", turn, {}, None, 5)
    assert status == 0 and body.startswith(b"no answer")


def test_the_matrix_counts_each_cell_and_its_failures() -> None:
    def row(api: str, passed: bool, *kinds: str) -> dict[str, Any]:
        return {"runtime": "r", "model": "m", "api": api, "stream": False, "repair": "off", "client": "c",
                "turn": "c/1", "passed": passed, "failures": [[k, "why"] for k in kinds]}

    rows = [row("chat", True), row("chat", False, "markup", "no_tool_call"), row("messages", False, "arguments")]
    cells = {c["api"]: c for c in agentcheck_report.summarize(rows)}
    assert (cells["chat"]["passed"], cells["chat"]["turns"], cells["chat"]["pass_rate"]) == (1, 2, 0.5)
    assert cells["chat"]["failures"] == {"markup": 1, "no_tool_call": 1}
    table = agentcheck_report.matrix_markdown(rows)
    assert "| r | m | chat | no | off | 1/2 | 50 % | 1 | 1 |" in table
    assert "| r | m | messages | no | off | 0/1 | 0 % |  |  | 1 |" in table
    pivot = agentcheck_report.pivot_markdown([*rows, {**rows[0], "repair": "on"}])
    assert "| runtime | model | API | JSON, repair off | JSON, repair on |" in pivot
    assert "| r | m | chat | 1/2 | 1/1 |" in pivot and "| r | m | messages | 0/1 |  |" in pivot


def test_the_command_refuses_without_a_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """An installed copy has no tests/ folder: the command asks for --corpus rather than guess."""
    monkeypatch.setattr(agentcheck, "default_corpus", lambda: None)
    assert main(["agentcheck", "--url", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path)]) == 2
    assert "give --corpus DIR" in capsys.readouterr().err
    assert main(["agentcheck", "--url", "http://127.0.0.1:9", "--model", "m", "--corpus", str(tmp_path)]) == 2
    assert "holds no tool-using turn" in capsys.readouterr().err
    assert main(["agentcheck", "--url", "u", "--model", "m", "--api", "embeddings"]) == 2
    assert main(["agentcheck", "--model", "m"]) == 2
    assert main(["agentcheck", "--url", "u", "--model", "m", "--repeat", "0"]) == 2


def test_merge_reports_earlier_runs_as_one_matrix(tmp_path: Path) -> None:
    rows = [{"runtime": "r", "model": "m", "api": "chat", "stream": s, "repair": rep, "client": "c", "turn": "c/1",
             "passed": rep == "on", "failures": [] if rep == "on" else [["markup", "x"]]}
            for s in (False, True) for rep in ("on", "off")]
    agentcheck_report.write(tmp_path / "a", rows[:2], "a")
    agentcheck_report.write(tmp_path / "b", rows[2:], "b")
    assert main(["agentcheck", "--merge", str(tmp_path / "a" / "results.json"), str(tmp_path / "b" / "results.json"),
                 "--out", str(tmp_path / "all")]) == 0
    merged = json.loads((tmp_path / "all" / "results.json").read_text())
    assert len(merged["rows"]) == 4 and len(merged["summary"]) == 4
    assert agentcheck_cli.STREAMS["both"] == (False, True)


@pytest.mark.parametrize(("schema", "value", "ok"), [
    ({"type": ["string", "null"]}, None, True),
    ({"type": "number"}, 3, True),
    ({"type": "integer"}, 3.0, True),
    ({"type": "integer"}, 3.5, False),
    ({"enum": ["a", "b"]}, "c", False),
    ({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}, ["x", 1], False),
    ({"$defs": {"p": {"type": "string"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}},
     {"a": 1}, False),
    ({"type": "array", "minItems": 1}, [], False),
    ({"type": "object", "additionalProperties": {"type": "string"}}, {"x": "y"}, True),
    ({"type": "string", "format": "unknown-keyword-ignored"}, "x", True),
])
def test_tool_schema(schema: dict[str, Any], value: Any, ok: bool) -> None:
    assert (problems(schema, value) == []) == ok


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_tool_runtime_writes_a_call_as_markup(fmt: str, tmp_path: Path) -> None:
    body = {"messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}]}
    assert tool_runtime.decide("chat", body, tmp_path).call is None  # not one of the agents' tools
    native = tool_runtime.decide("chat", body, tmp_path, any_tool=True)
    assert native.call is not None and json.loads(native.call.arguments) == {"city": "Paris"}
    as_text = tool_runtime.decide("chat", body, tmp_path, any_tool=True, tool_format=fmt)
    assert as_text.call is None and "get_weather" in as_text.text and "Paris" in as_text.text
