"""The agent loop through the gateway, run by the real clients: Claude Code, Codex CLI and opencode
(npm packages pinned in passerelle/testing/clients.py, installed by ``make test``).

Each client runs headless as docs/clients.md's recipes say (tests/unit/test_docs.py holds that page
to the recipes below), with its HOME in a temporary folder, a passerelle key, and every proxy
variable pointing at a sinkhole that records any connection it is asked for: a client that tried
anything but the gateway (its vendor's API, an update check, telemetry, a plugin download) fails
the test.

* A turn in front of the embedded llama-server (``llama``): ``passerelle serve`` with the default
  runtime and catalogue, only with a context per slot that holds an agent's prompt (Claude Code's
  first request is about 4,200 tokens with its tools, Codex's more). Claude Code and Codex ask for
  their own model names, served by the embedded model's ``claude-*`` and ``gpt-*`` aliases.
* A tool round trip in front of a runtime scripted to call that client's file-writing or shell
  tool (passerelle/testing/tool_runtime.py): the client runs the tool, which writes hello.txt in
  its working folder, and sends the tool's result back through the gateway for a final answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from passerelle.config import EmbeddedConfig
from passerelle.runtimes.supervisor import free_port
from passerelle.testing import tool_runtime
from passerelle.testing.clients import CLIENTS, ClientsUnavailable, ensure_clients
from tests.conftest import Gateway, http_ok, wait_until

pytestmark = pytest.mark.clients

CLIENT_TIMEOUT_S = 600  # one client's whole run; a CPU runtime on a busy 2-core machine is slow
KEY_ENV = "PASSERELLE_API_KEY"  # where the Codex and opencode recipes read the key from


# -- docs/clients.md's recipes -----------------------------------------------------------------
def claude_env(url: str, key: str) -> dict[str, str]:
    """Claude Code: the gateway's root URL, the key as a Bearer token, no telemetry."""
    return {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": key, "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def codex_config(url: str) -> str:
    """Codex CLI's ``$CODEX_HOME/config.toml``: a provider of its own, so nothing falls back to
    the public API; one of Codex's own model names (it chooses its tools and prompts by the name;
    the gateway serves it by a ``gpt-*`` alias); time for a CPU runtime to read an agent's first
    prompt (minutes before the first token); no update check, plugin sync or analytics."""
    return f"""\
model = "gpt-5.5"
model_provider = "passerelle"
check_for_update_on_startup = false

[model_providers.passerelle]
name = "passerelle"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "{KEY_ENV}"
stream_idle_timeout_ms = 900000

[features]
plugins = false

[analytics]
enabled = false
"""


def opencode_config(url: str, model: str) -> str:
    """opencode's ``~/.config/opencode/opencode.json``: an OpenAI-compatible provider (chat)."""
    return json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"passerelle": {"npm": "@ai-sdk/openai-compatible", "name": "passerelle",
                                    "options": {"baseURL": f"{url}/v1", "apiKey": f"{{env:{KEY_ENV}}}",
                                                "setCacheKey": True},  # (its session named: promptCacheKey)
                                    "models": {model: {"name": model}}}},
        "model": f"passerelle/{model}", "autoupdate": False, "share": "disabled"}, indent=2)


OPENCODE_ENV = {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1"}


# -- running a client --------------------------------------------------------------------------
class Sinkhole:
    """A proxy that lets nothing through: it records the request line of every connection
    (``CONNECT api.anthropic.com:443 HTTP/1.1``) and answers 403."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    line = conn.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
                except OSError as exc:
                    line = f"(a connection that sent nothing: {exc})"
                self.seen.append(line)
                with contextlib.suppress(OSError):
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@dataclass
class Box:
    """One client's world: a working folder, a HOME, the sinkhole as every proxy."""

    work: Path
    home: Path
    sink: Sinkhole

    def env(self, **extra: str) -> dict[str, str]:
        env = {"PATH": os.environ["PATH"], "HOME": str(self.home), "LANG": "C.UTF-8", "TERM": "dumb",
               "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            env[var] = self.sink.url
        return {**env, **extra}

    def run(self, argv: list[str | Path], env: dict[str, str], timeout: float = CLIENT_TIMEOUT_S) -> str:
        """Run a client to its end in the working folder; its stdout. Fails the test on a non-zero
        exit or past ``timeout`` (the client and whatever it started are killed)."""
        proc = subprocess.Popen([str(a) for a in argv], cwd=self.work, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"{argv[0]} did not finish within {timeout:g} s\n--- stdout\n{out[-3000:]}\n"
                                 f"--- stderr\n{err[-3000:]}") from None
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind
        assert proc.returncode == 0, f"{argv[0]} exited {proc.returncode}\n--- stdout\n{out[-3000:]}\n" \
                                     f"--- stderr\n{err[-3000:]}"
        return out


@pytest.fixture(scope="session")
def bins() -> dict[str, Path]:
    try:
        return ensure_clients()
    except ClientsUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def box(tmp_path) -> Iterator[Box]:
    sink = Sinkhole()
    (tmp_path / "work").mkdir()
    (tmp_path / "home").mkdir()
    try:
        yield Box(work=tmp_path / "work", home=tmp_path / "home", sink=sink)
    finally:
        sink.close()


TENANT = "agent"


@pytest.fixture
def key(tmp_path) -> str:
    """A passerelle key in the state folder the ``gateway`` fixture gives the gateway, made before
    the gateway starts (a running gateway reads new keys within a second)."""
    done = subprocess.run([sys.executable, "-m", "passerelle", "keys", "create", "--tenant", TENANT],
                          env={**os.environ, "PASSERELLE_STATE": str(tmp_path / "state")},
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip()


def run_claude(box: Box, bins: dict[str, Path], gw: Gateway, key: str, prompt: str) -> str:
    # acceptEdits: file edits in the working folder run without asking (-p cannot ask)
    return box.run([bins["claude"], "-p", prompt, "--permission-mode", "acceptEdits"],
                   box.env(**claude_env(gw.url, key)))


def run_codex(box: Box, bins: dict[str, Path], gw: Gateway, key: str, prompt: str) -> str:
    codex_home = box.home / ".codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(codex_config(gw.url))
    # exec never asks for approval; workspace-write lets its commands write in the working folder only
    return box.run([bins["codex"], "exec", "--skip-git-repo-check", "--sandbox", "workspace-write", prompt],
                   box.env(CODEX_HOME=str(codex_home), **{KEY_ENV: key}))


def run_opencode(box: Box, bins: dict[str, Path], gw: Gateway, key: str, model: str, prompt: str) -> str:
    config_dir = box.home / ".config" / "opencode"
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "opencode.json").write_text(opencode_config(gw.url, model))
    # opencode installs its plugin SDK from npm into each configuration folder when it starts (a
    # background job; a failure is a warning). A lock file naming it stands for that install, so
    # the run stays off the network and any other connection it tries shows in the sinkhole.
    (config_dir / "node_modules").mkdir(exist_ok=True)
    (config_dir / "package-lock.json").write_text(json.dumps(
        {"packages": {"": {"dependencies": {"@opencode-ai/plugin": "*"}}}}))
    return box.run([bins["opencode"], "run", prompt], box.env(**OPENCODE_ENV, **{KEY_ENV: key}))


def check_traffic(gw: Gateway, box: Box, endpoint: str, *, may_leave: bool = False) -> list[dict]:
    """Every request the client sent reached the gateway, with its key, and was answered ``ok`` —
    or, with ``may_leave``, was still waiting when the client left (in front of a one-slot runtime,
    opencode's request for a session title waits behind the turn, and opencode exits, closing it,
    once the turn is done); at least one request on ``endpoint`` was answered ``ok``; the client
    tried no other address. The gateway's access log lines of the requests answered ``ok``."""
    assert box.sink.seen == [], f"the client tried to reach something else than the gateway: {box.sink.seen}"
    lines = gw.access_log()
    assert lines, "no request reached the gateway"
    for r in lines:
        allowed = {(200, "ok"), (499, "client_disconnect")} if may_leave else {(200, "ok")}
        assert (r["status"], r["cause"]) in allowed, r
        assert r["tenant"] == TENANT, r
    done = [r for r in lines if r["status"] == 200]
    assert any(r["endpoint"] == endpoint for r in done), lines
    return done


# -- a turn in front of the embedded llama-server ----------------------------------------------
EMBEDDED_MODEL = EmbeddedConfig().served_id
STOPS = [".", "!", "?", "\n"]
EMBEDDED_FOR_AGENTS = f"""
[embedded]
slots = 1
ctx_per_slot = 16384   # an agent's first prompt, with its tools, is 4,000 to 7,000 tokens
threads = 1            # one core for the runtime, the other for the gateway, the client and the test
embeddings = false
rerank = false

# The embedded default's names for the agents ([embedded] aliases), and an answer that ends at its
# first sentence or line: the agents ask for up to 32,000 tokens, which a small model on one core
# writes for an hour, and take an answer cut by a token limit for an error (Claude Code exits 1 on
# stop_reason max_tokens), so the limit is a stop sequence (Messages names it stop_sequences).
# Greedy: sampled at the agents' temperature, a 135M model behind a 5,000-token agent prompt can
# write thousands of tokens without a full stop or a line break (measured: 3,916 tokens, 8 minutes).
[[models]]
name = "{EMBEDDED_MODEL}"
aliases = {json.dumps(list(EmbeddedConfig().aliases))}
set = {{ temperature = 0, stop = {json.dumps(STOPS)}, stop_sequences = {json.dumps(STOPS)} }}
# SmolLM2's template drops tools, so a request with tools is refused (400) unless the entry says to
# serve it without them (with an X-Passerelle-Warning header): the agents send their tools every turn.
tools = "ignore"
"""


@pytest.fixture
def embedded(gateway, key) -> Gateway:
    return gateway(EMBEDDED_FOR_AGENTS, timeout=600)


def check_turn(gw: Gateway, box: Box, endpoint: str, out: str) -> None:
    assert out.strip(), "the client printed no answer"
    lines = check_traffic(gw, box, endpoint, may_leave=True)
    assert {r["model"] for r in lines} == {EMBEDDED_MODEL}
    assert all(r["completion_tokens"] >= 1 for r in lines if r["endpoint"] == endpoint)


@pytest.mark.llama
@pytest.mark.timeout(CLIENT_TIMEOUT_S + 300)
def test_claude_code_completes_a_turn_in_front_of_the_embedded_runtime(embedded, box, bins, key):
    out = run_claude(box, bins, embedded, key, "Say hello in one short sentence.")
    check_turn(embedded, box, "messages", out)


@pytest.mark.llama
@pytest.mark.timeout(CLIENT_TIMEOUT_S + 300)
def test_codex_completes_a_turn_in_front_of_the_embedded_runtime(embedded, box, bins, key):
    out = run_codex(box, bins, embedded, key, "Say hello in one short sentence.")
    check_turn(embedded, box, "responses", out)


@pytest.mark.llama
@pytest.mark.timeout(CLIENT_TIMEOUT_S + 300)
def test_opencode_completes_a_turn_in_front_of_the_embedded_runtime(embedded, box, bins, key):
    out = run_opencode(box, bins, embedded, key, EMBEDDED_MODEL, "Say hello in one short sentence.")
    check_turn(embedded, box, "chat", out)


# -- a tool round trip in front of a scripted runtime ------------------------------------------
@dataclass
class Scripted:
    url: str
    record: Path
    proc: subprocess.Popen

    def requests(self) -> list[dict]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]


@pytest.fixture
def scripted(box, tmp_path) -> Iterator[Scripted]:
    port = free_port()
    record = tmp_path / "runtime-requests.jsonl"
    with open(tmp_path / "tool-runtime.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "passerelle.testing.tool_runtime", "--port", str(port),
                                 "--workdir", str(box.work), "--record", str(record), "--model", "scripted"],
                                stdout=log, stderr=subprocess.STDOUT)
    runtime = Scripted(f"http://127.0.0.1:{port}", record, proc)
    try:
        wait_until(lambda: http_ok(runtime.url + "/health"), 30, what="the scripted runtime")
        yield runtime
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture
def tool_gateway(gateway, scripted, key) -> Gateway:
    """The gateway before the scripted runtime, serving it under the names the clients ask for."""
    return gateway(f"""
    [[backends]]
    name = "scripted"
    kind = "openai"
    url = "{scripted.url}"
    models = ["scripted"]
    endpoints = ["chat", "responses", "messages", "count_tokens"]
    max_concurrency = 4

    [[models]]
    name = "scripted"
    aliases = ["claude-*", "gpt-*"]
    """)


def round_trip(scripted: Scripted, path: str, tool: str) -> tuple[dict, dict]:
    """The request answered with the tool call, and the agent's next turn, which carries its result."""
    reqs = [r for r in scripted.requests() if r["path"] == path]
    i = next((i for i, r in enumerate(reqs) if isinstance(r["answer"], dict)), None)
    assert i is not None, f"no request on {path} offered a tool the runtime knows: {[r['answer'] for r in reqs]}"
    assert reqs[i]["answer"]["tool"] == tool
    # the agent loop's next turn offers its tools again; a side request made meanwhile (opencode
    # asks for a title in parallel) offers none, so it is not the one that carries the result
    after = next((r for r in reqs[i + 1:] if r["body"].get("tools")), None)
    assert after is not None, "the client did not come back with the tool's result"
    return reqs[i], after


def check_file(box: Box) -> None:
    assert (box.work / tool_runtime.FILENAME).read_text() == tool_runtime.CONTENT


@pytest.mark.timeout(CLIENT_TIMEOUT_S + 120)
def test_claude_code_runs_a_tool_and_sends_its_result_back_through_the_gateway(tool_gateway, scripted, box, bins, key):
    out = run_claude(box, bins, tool_gateway, key, "Write hello.txt.")
    check_file(box)
    assert tool_runtime.FINAL_TEXT in out
    call, after = round_trip(scripted, "/v1/messages", "Write")
    results = [c for m in after["body"]["messages"] if m["role"] == "user" and isinstance(m["content"], list)
               for c in m["content"] if c.get("type") == "tool_result"]
    assert [r["tool_use_id"] for r in results] == [call["answer"]["call_id"]]
    assert results[0].get("is_error") is not True, results[0]
    lines = check_traffic(tool_gateway, box, "messages")
    assert len([r for r in lines if r["endpoint"] == "messages"]) == len(
        [r for r in scripted.requests() if r["path"] == "/v1/messages"])


@pytest.mark.timeout(CLIENT_TIMEOUT_S + 120)
def test_codex_runs_a_tool_and_sends_its_result_back_through_the_gateway(tool_gateway, scripted, box, bins, key):
    out = run_codex(box, bins, tool_gateway, key, "Write hello.txt.")
    check_file(box)
    assert tool_runtime.FINAL_TEXT in out
    call, after = round_trip(scripted, "/v1/responses", "exec_command")
    outputs = [i for i in after["body"]["input"] if isinstance(i, dict) and i.get("type") == "function_call_output"]
    assert [o["call_id"] for o in outputs] == [call["answer"]["call_id"]]
    # the function call itself goes back too, as Responses wants it before its output
    calls = [i for i in after["body"]["input"] if isinstance(i, dict) and i.get("type") == "function_call"]
    assert [(c["call_id"], c["name"]) for c in calls] == [(call["answer"]["call_id"], "exec_command")]
    lines = check_traffic(tool_gateway, box, "responses")
    assert len([r for r in lines if r["endpoint"] == "responses"]) == len(
        [r for r in scripted.requests() if r["path"] == "/v1/responses"])


@pytest.mark.timeout(CLIENT_TIMEOUT_S + 120)
def test_opencode_runs_a_tool_and_sends_its_result_back_through_the_gateway(tool_gateway, scripted, box, bins, key):
    out = run_opencode(box, bins, tool_gateway, key, "scripted", "Write hello.txt.")
    check_file(box)
    assert tool_runtime.FINAL_TEXT in out
    call, after = round_trip(scripted, "/v1/chat/completions", "write")
    results = [m for m in after["body"]["messages"] if m.get("role") == "tool"]
    assert [m["tool_call_id"] for m in results] == [call["answer"]["call_id"]]
    lines = check_traffic(tool_gateway, box, "chat")
    assert len([r for r in lines if r["endpoint"] == "chat"]) == len(
        [r for r in scripted.requests() if r["path"] == "/v1/chat/completions"])
    # the turns that carry tools name opencode's session (promptCacheKey): one session, kept
    # together (affinity, a held slot and saved KV on llama-server), hashed in the log
    turns = [r for r in lines if r["endpoint"] == "chat" and r.get("session")]
    assert len(turns) >= 2 and len({r["session"] for r in turns}) == 1, lines


def test_the_pinned_clients_are_the_ones_installed(bins, box):
    """What ran is what clients.py pins (and docs/clients.md names)."""
    for c in CLIENTS:
        done = subprocess.run([bins[c.name], "--version"], capture_output=True, text=True, timeout=120,
                              env=box.env())
        assert c.version in done.stdout, (c, done.stdout, done.stderr)
