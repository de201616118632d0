"""The installer of the real clients the tests run (passerelle/testing/clients.py): pinned,
idempotent, and a clear error without Node.js. npm itself is stood in for by a script."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from passerelle.testing.clients import CLIENTS, ClientsUnavailable, ensure_clients, installed_version

FAKE_NPM = """#!{python}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
Path(os.environ["NPM_CALLS"]).open("a").write(json.dumps(args) + "\\n")
root = Path(args[args.index("--prefix") + 1])
for spec in args:
    if "@" in spec[1:] and not spec.startswith("-"):
        name, version = spec.rsplit("@", 1)
        folder = root / "node_modules" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "package.json").write_text(json.dumps({{"name": name, "version": version}}))
        bins = root / "node_modules" / ".bin"
        bins.mkdir(parents=True, exist_ok=True)
        command = {{"@anthropic-ai/claude-code": "claude", "@openai/codex": "codex", "opencode-ai": "opencode"}}[name]
        (bins / command).write_text("#!/bin/sh\\n")
"""


def install(root: Path, version_of=lambda c: c.version) -> None:
    for c in CLIENTS:
        folder = root / "node_modules" / c.package
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "package.json").write_text(json.dumps({"name": c.package, "version": version_of(c)}))
        (root / "node_modules" / ".bin").mkdir(exist_ok=True)
        (root / "node_modules" / ".bin" / c.name).write_text("#!/bin/sh\n")


@pytest.fixture
def npm(tmp_path, monkeypatch) -> Path:
    """A stand-in `npm` (and `node`) first on PATH; the calls it got, one JSON line each."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("npm", FAKE_NPM.format(python=sys.executable)), ("node", "#!/bin/sh\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "npm-calls.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("NPM_CALLS", str(calls))
    return calls


def test_installs_the_pinned_versions_once(tmp_path, npm):
    root = tmp_path / "clients"
    bins = ensure_clients(root)
    assert bins == {c.name: root / "node_modules" / ".bin" / c.name for c in CLIENTS}
    [call] = [json.loads(line) for line in npm.read_text().splitlines()]
    assert call[:2] == ["install", "--prefix"] and "--save-exact" in call
    assert {f"{c.package}@{c.version}" for c in CLIENTS} <= set(call)
    manifest = json.loads((root / "package.json").read_text())
    assert manifest["dependencies"] == {c.package: c.version for c in CLIENTS}  # exact, no ^ range
    ensure_clients(root)  # installed: npm is not asked again
    assert len(npm.read_text().splitlines()) == 1


def test_a_client_at_another_version_is_reinstalled(tmp_path, npm):
    root = tmp_path / "clients"
    install(root, version_of=lambda c: "0.0.1" if c.name == "codex" else c.version)
    ensure_clients(root)
    assert len(npm.read_text().splitlines()) == 1
    assert all(installed_version(c, root) == c.version for c in CLIENTS)


def test_installed_clients_need_no_node(tmp_path, monkeypatch):
    root = tmp_path / "clients"
    install(root)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert set(ensure_clients(root)) == {"claude", "codex", "opencode"}


def test_without_node_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(ClientsUnavailable) as err:
        ensure_clients(tmp_path / "clients")
    message = str(err.value)
    assert "node and npm not found" in message and "apt-get install nodejs npm" in message


def test_an_npm_failure_is_reported_with_its_output(tmp_path, npm):
    (npm.parent / "bin" / "npm").write_text("#!/bin/sh\necho 'E404 no such package' >&2\nexit 1\n")
    with pytest.raises(ClientsUnavailable) as err:
        ensure_clients(tmp_path / "clients")
    assert "failed (1)" in str(err.value) and "E404 no such package" in str(err.value)
