"""``passerelle agentcheck`` run as a user runs it, against a gateway in front of the scripted tool
runtime (passerelle/testing/tool_runtime.py ``--any-tool``): every corpus tool turn, streamed and
not, on the three APIs.

* The runtime answers with the APIs' own tool calls: every turn passes, and the matrix says so.
* The runtime writes the calls as Hermes markup in the text, as a runtime without a tool parser
  does, and the gateway's tool-call repair is off (its default): no turn passes, each fails for the
  markup left in the text and the missing call; that is what a client gets today.
* The same with ``[[models]] tool_calls`` set (the format, or ``auto``): every turn passes, for
  every format, on the three APIs, streamed and not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from passerelle.bench.agentcheck import default_corpus, load_turns
from passerelle.runtimes.supervisor import free_port
from tests.conftest import Gateway, Server, http_ok
from tests.waiting import wait_until


@pytest.fixture
def tool_runtime(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(*extra: str) -> Server:
        port = free_port()
        log = tmp_path / f"tool-runtime-{port}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-m", "passerelle.testing.tool_runtime", "--port", str(port),
                                     "--workdir", str(tmp_path), "--record", str(tmp_path / f"rec-{port}.jsonl"),
                                     "--model", "scripted", "--any-tool", *extra], stdout=f, stderr=subprocess.STDOUT)
        server = Server(f"http://127.0.0.1:{port}", proc, log, model="scripted")
        started.append(server)
        wait_until(lambda: http_ok(server.url + "/health"), 30, what="the scripted tool runtime")
        return server

    yield start
    for s in started:
        s.stop()


def gateway_config(url: str, tool_calls: str = "") -> str:
    repair = f'[[models]]\n    name = "scripted"\n    tool_calls = "{tool_calls}"' if tool_calls else ""
    return f"""
    [[backends]]
    name = "scripted"
    kind = "openai"
    url = "{url}"
    models = ["scripted"]
    endpoints = ["chat", "responses", "messages", "count_tokens"]
    max_concurrency = 4

    {repair}
    """


def agentcheck(gw: Gateway, out: Path, *extra: str,
               repair: str = "off") -> tuple[subprocess.CompletedProcess[str], dict]:
    proc = subprocess.run([sys.executable, "-m", "passerelle", "agentcheck", "--url", gw.url, "--model", "scripted",
                           "--runtime", "scripted", "--repair", repair, "--out", str(out), "--timeout", "60", *extra],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((out / "results.json").read_text())


def test_native_tool_calls_all_pass(tool_runtime, gateway, tmp_path: Path) -> None:
    runtime = tool_runtime()
    gw = gateway(gateway_config(runtime.url))
    corpus = default_corpus()
    assert corpus is not None
    turns = load_turns(corpus)
    proc, results = agentcheck(gw, tmp_path / "native")
    rows = results["rows"]
    assert len(rows) == 2 * len(turns)  # streamed and not
    assert {r["api"] for r in rows} == {"chat", "responses", "messages"}
    assert [r for r in rows if not r["passed"]] == []
    assert {(c["api"], c["stream"], c["pass_rate"]) for c in results["summary"]} == \
        {(api, stream, 1.0) for api in ("chat", "responses", "messages") for stream in (False, True)}
    report = (tmp_path / "native" / "report.md").read_text()
    assert "| scripted | scripted | messages | yes | off |" in report
    assert "Every turn passed." in report
    assert "| scripted | scripted | chat | no | off |" in proc.stdout  # the matrix is printed too


def test_markup_as_text_fails_without_repair(tool_runtime, gateway, tmp_path: Path) -> None:
    runtime = tool_runtime("--tool-format", "hermes")
    gw = gateway(gateway_config(runtime.url))
    _, results = agentcheck(gw, tmp_path / "hermes", "--client", "claude-code", "--client", "codex",
                            "--client", "opencode")
    rows = results["rows"]
    assert {r["turn"] for r in rows} == {"claude-code/001-messages", "codex/001-responses", "opencode/002-chat"}
    assert rows and not any(r["passed"] for r in rows)
    for row in rows:
        kinds = {f[0] for f in row["failures"]}
        assert row["calls"] == [] and "<tool_call>" in row["text"]  # what the client got, kept in the results
        # a Responses answer of text ends "completed" too; chat and Messages end as text does
        assert {"markup", "no_tool_call"} | ({"stop_reason"} if row["api"] != "responses" else set()) == kinds, row
    # --strict turns those failures into the exit status
    strict = subprocess.run([sys.executable, "-m", "passerelle", "agentcheck", "--url", gw.url, "--model", "scripted",
                             "--client", "opencode", "--stream", "no", "--out", str(tmp_path / "strict"), "--strict"],
                            capture_output=True, text=True, timeout=120)
    assert strict.returncode == 1, strict.stderr[-2000:]


@pytest.mark.parametrize(("fmt", "tool_calls"), [("hermes", "hermes"), ("qwen3-xml", "qwen3-xml"), ("mistral", "auto"),
                                                 ("llama3", "llama3"), ("harmony", "harmony"), ("native", "auto")])
def test_markup_as_text_is_repaired(tool_runtime, gateway, tmp_path: Path, fmt: str, tool_calls: str) -> None:
    """Every format, found by its name or by ``auto``; a runtime's own calls are left as they are."""
    runtime = tool_runtime(*(("--tool-format", fmt) if fmt != "native" else ()))
    gw = gateway(gateway_config(runtime.url, tool_calls))
    _, results = agentcheck(gw, tmp_path / fmt, "--client", "claude-code", "--client", "codex", "--client", "opencode",
                            "--client", "pydantic-ai", repair="on")
    rows = results["rows"]
    assert {r["api"] for r in rows} == {"chat", "responses", "messages"} and len(rows) == 12
    assert [r for r in rows if not r["passed"]] == []
    assert all(r["calls"] and "<" not in r["text"] for r in rows)  # the call delivered, no markup left
