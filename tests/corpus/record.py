"""Re-record the corpus: run each real client against the recorder (passerelle/testing/recorder.py)
and write what it sends to tests/corpus/<client>/NNN-<api>.json.

    /work/main/.venv/bin/python -m tests.corpus.record                       # every client
    /work/main/.venv/bin/python -m tests.corpus.record codex claude-code     # some of them
    ... --agents-python /tmp/agents-venv/bin/python                          # the agent frameworks' venv

A client's folder is emptied and written anew, so a new client version replaces its old requests
(see docs/corpus.md). The CLI clients are the ones `make setup` installs with npm
(~/.cache/passerelle/clients/node_modules/.bin); the agent frameworks (openai-agents, pydantic-ai,
langchain-openai, langchain-anthropic) run from a separate virtualenv given by --agents-python.
Each client runs in a throw-away folder and home, with a dummy key, and talks only to the recorder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from passerelle.testing.recorder import Recorder, serving

HERE = Path(__file__).resolve().parent
DRIVERS = HERE / "drivers"
BIN = Path.home() / ".cache" / "passerelle" / "clients" / "node_modules" / ".bin"
TASK = "Create a file named hello.txt containing the word hello. Use your shell tool, then say done."
TIMEOUT_S = 240
TIMEOUT_S_OF = {"open-webui": 900, "open-webui-jwt": 900}  # its first start migrates a database and loads its RAG parts


@dataclass(frozen=True)
class Run:
    """One client session: how to find its version, and the command with its environment."""

    client: str
    version: Callable[[argparse.Namespace], str]
    command: Callable[[str, Path, argparse.Namespace], tuple[list[str], dict[str, str]]]


def _first_line(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else "unknown"


def _package_version(python: str, package: str) -> str:
    return _first_line([python, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"])


def _base_env(home: Path) -> dict[str, str]:
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TERM") if k in os.environ}
    return {**keep, "HOME": str(home), "NO_PROXY": "127.0.0.1,localhost", "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1"}


def _claude(model: str) -> Callable[[str, Path, argparse.Namespace], tuple[list[str], dict[str, str]]]:
    def command(url: str, work: Path, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
        env = {**_base_env(work / "home"), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "dummy-not-a-key"}
        return [str(BIN / "claude"), "-p", TASK, "--model", model, "--allowedTools", "Bash", "Write", "Read",
                "--output-format", "json"], env
    return command


def _codex(url: str, work: Path, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    home = work / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "gpt-5-codex"\nmodel_provider = "recorder"\napproval_policy = "never"\n'
        'sandbox_mode = "danger-full-access"\n\n[model_providers.recorder]\nname = "recorder"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "RECORDER_API_KEY"\n')
    env = {**_base_env(work / "home"), "CODEX_HOME": str(home), "RECORDER_API_KEY": "dummy-not-a-key"}
    return [str(BIN / "codex"), "exec", "--skip-git-repo-check", TASK], env


def _opencode(npm: str, model: str) -> Callable[[str, Path, argparse.Namespace], tuple[list[str], dict[str, str]]]:
    """opencode with a provider of the AI SDK package ``npm`` (openai-compatible: chat; openai:
    Responses; anthropic: Messages) whose base URL is the recorder."""
    def command(url: str, work: Path, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
        config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
                  "model": f"recorder/{model}",
                  "provider": {"recorder": {"npm": npm, "name": "Recorder",
                                            "options": {"baseURL": f"{url}/v1", "apiKey": "dummy-not-a-key"},
                                            "models": {model: {"name": model, "tool_call": True}}}}}
        (work / "opencode.json").write_text(json.dumps(config))
        return [str(BIN / "opencode"), "run", TASK], _base_env(work / "home")
    return command


def _continue(url: str, work: Path, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    (work / "config.yaml").write_text(
        "name: recorder\nversion: 0.0.1\nschema: v1\nmodels:\n  - name: recorded\n    provider: openai\n"
        f"    model: gpt-4o\n    apiBase: {url}/v1\n    apiKey: dummy-not-a-key\n"
        "    roles: [chat, edit, apply]\n    capabilities: [tool_use]\n")
    return [str(args.continue_bin), "-p", TASK, "--config", str(work / "config.yaml"), "--auto"], \
        _base_env(work / "home")


def _python_driver(script: str, python: Callable[[argparse.Namespace], str]) \
        -> Callable[[str, Path, argparse.Namespace], tuple[list[str], dict[str, str]]]:
    def command(url: str, work: Path, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
        env = {**_base_env(work / "home"), "RECORDER_URL": url, "OPENAI_API_KEY": "dummy-not-a-key",
               "ANTHROPIC_API_KEY": "dummy-not-a-key", "OPENAI_AGENTS_DISABLE_TRACING": "1"}
        return [python(args), str(DRIVERS / script)], env
    return command


# the secret of the recorded signed identity (tests/unit/test_openwebui.py verifies those tokens)
OPEN_WEBUI_JWT_SECRET = "corpus-open-webui-jwt-secret-not-a-secret"


def _open_webui(signed: bool) -> Callable[[str, Path, argparse.Namespace], tuple[list[str], dict[str, str]]]:
    """Open WebUI from its own virtualenv (``--open-webui-python``), driven through its HTTP API;
    ``signed``: with its signed identity (a shorter session)."""
    def command(url: str, work: Path, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
        env = {**_base_env(work / "home"), "RECORDER_URL": url,
               "OPEN_WEBUI_BIN": str(Path(args.open_webui_python).parent / "open-webui"),
               **({"OPEN_WEBUI_JWT_SECRET": OPEN_WEBUI_JWT_SECRET} if signed else {})}
        return [sys.executable, str(DRIVERS / "open_webui.py")], env
    return command


def _shared(args: argparse.Namespace) -> str:
    return sys.executable


def _agents(args: argparse.Namespace) -> str:
    return str(args.agents_python)


def _claude_version(args: argparse.Namespace) -> str:
    return _first_line([str(BIN / "claude"), "--version"]).split()[0]


def _opencode_version(args: argparse.Namespace) -> str:
    return _first_line([str(BIN / "opencode"), "--version"])


RUNS = (
    Run("claude-code", _claude_version, _claude("claude-sonnet-4-5")),
    Run("claude-code-haiku", _claude_version, _claude("claude-haiku-4-5")),
    Run("codex", lambda a: _first_line([str(BIN / "codex"), "--version"]).split()[-1], _codex),
    Run("opencode", _opencode_version, _opencode("@ai-sdk/openai-compatible", "recorded-model")),
    Run("opencode-responses", _opencode_version, _opencode("@ai-sdk/openai", "gpt-5")),
    Run("opencode-anthropic", _opencode_version, _opencode("@ai-sdk/anthropic", "claude-sonnet-4-5")),
    Run("continue", lambda a: _first_line([str(a.continue_bin), "--version"]), _continue),
    Run("openai-python", lambda a: _package_version(sys.executable, "openai"),
        _python_driver("openai_sdk.py", _shared)),
    Run("anthropic-python", lambda a: _package_version(sys.executable, "anthropic"),
        _python_driver("anthropic_sdk.py", _shared)),
    Run("openai-agents", lambda a: _package_version(_agents(a), "openai-agents"),
        _python_driver("openai_agents.py", _agents)),
    Run("pydantic-ai", lambda a: _package_version(_agents(a), "pydantic-ai-slim"),
        _python_driver("pydantic_ai_agent.py", _agents)),
    Run("langchain", lambda a: _package_version(_agents(a), "langchain-openai"),
        _python_driver("langchain_tools.py", _agents)),
    Run("open-webui", lambda a: _package_version(a.open_webui_python, "open-webui"), _open_webui(False)),
    Run("open-webui-jwt", lambda a: _package_version(a.open_webui_python, "open-webui"), _open_webui(True)),
)


async def record(run: Run, args: argparse.Namespace) -> tuple[int, int, str]:
    """Record one client; returns (requests written, its exit status, the tail of its output)."""
    out = args.out / run.client
    shutil.rmtree(out, ignore_errors=True)
    version = run.version(args)
    with tempfile.TemporaryDirectory(prefix=f"corpus-{run.client}-") as tmp:
        work = Path(tmp)
        recorder = Recorder(out, run.client, version, literal={str(work): "/tmp/corpus-work"})
        (work / "home").mkdir()
        async with serving(recorder) as url:
            cmd, env = run.command(url, work, args)
            proc = await asyncio.create_subprocess_exec(*cmd, cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
            try:
                output, _ = await asyncio.wait_for(proc.communicate(), TIMEOUT_S_OF.get(run.client, TIMEOUT_S))
            except TimeoutError:
                proc.kill()
                output, _ = await proc.communicate()
    if recorder.count == 0:
        shutil.rmtree(out, ignore_errors=True)
    return recorder.count, proc.returncode or 0, output.decode(errors="replace")[-2000:]


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("clients", nargs="*", help=f"of: {', '.join(r.client for r in RUNS)} (default: all)")
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--agents-python", default=os.environ.get("AGENTS_PYTHON", "/tmp/corpus-venv/bin/python"),
                        help="a python with openai-agents, pydantic-ai-slim[openai,anthropic], langchain-openai "
                             "and langchain-anthropic installed")
    parser.add_argument("--continue-bin", default=os.environ.get("CONTINUE_BIN",
                                                                 "/tmp/continue-cli/node_modules/.bin/cn"),
                        help="Continue's CLI (npm @continuedev/cli, installed apart: "
                             "npm install --prefix /tmp/continue-cli @continuedev/cli)")
    parser.add_argument("--open-webui-python", default=os.environ.get(
        "OPEN_WEBUI_PYTHON", str(Path.home() / ".cache" / "passerelle" / "owui-venv" / "bin" / "python")),
                        help="the python of a virtualenv with open-webui installed (python3.11 -m venv "
                             "~/.cache/passerelle/owui-venv && .../pip install 'open-webui==0.12.*')")
    parser.add_argument("--verbose", action="store_true", help="print the tail of each client's output")
    args = parser.parse_args(argv)
    unknown = set(args.clients) - {r.client for r in RUNS}
    if unknown:
        parser.error(f"unknown clients: {', '.join(sorted(unknown))}")
    failed = 0
    for run in RUNS:
        if args.clients and run.client not in args.clients:
            continue
        count, status, tail = await record(run, args)
        print(f"{run.client}: {count} requests, exit {status}")
        if args.verbose:
            print("    " + tail.replace("\n", "\n    "))
        if status != 0 or count == 0:
            failed += 1
            print("    " + tail.replace("\n", "\n    "))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
