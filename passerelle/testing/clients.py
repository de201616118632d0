"""The real agent clients the tests run through the gateway: Claude Code, Codex CLI and opencode.

They are npm packages, pinned here, installed once under ``~/.cache/passerelle/clients``
(``$PASSERELLE_CACHE``) by ``make test`` (``python -m passerelle.testing.clients``) and by the
tests' session fixture when missing. The gateway itself never needs them (``make run`` does not
install them).

Example::

    bins = ensure_clients()           # {"claude": Path(".../node_modules/.bin/claude"), ...}
    subprocess.run([bins["codex"], "--version"])
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from passerelle.paths import cache_dir


@dataclass(frozen=True)
class Client:
    name: str  # the command
    package: str  # the npm package
    version: str  # pinned: a client's new release is a deliberate change here


CLIENTS = (
    Client("claude", "@anthropic-ai/claude-code", "2.1.332"),
    Client("codex", "@openai/codex", "0.171.0"),
    Client("opencode", "opencode-ai", "1.18.33"),
)
INSTALL_TIMEOUT_S = 1800.0  # npm on a slow link; the packages hold native binaries of ~100 MB each


class ClientsUnavailable(RuntimeError):
    """The clients are not installed and cannot be (no Node.js, or npm failed)."""


def clients_dir() -> Path:
    return cache_dir() / "clients"


def installed_version(client: Client, root: Path | None = None) -> str | None:
    """The version of ``client`` installed under ``root``, or None."""
    manifest = (root or clients_dir()) / "node_modules" / client.package / "package.json"
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    version = data.get("version") if isinstance(data, dict) else None
    return version if isinstance(version, str) else None


def _bin(client: Client, root: Path) -> Path:
    return root / "node_modules" / ".bin" / client.name


def _ready(client: Client, root: Path) -> bool:
    return installed_version(client, root) == client.version and _bin(client, root).exists()


def ensure_clients(root: Path | None = None, *, timeout_s: float = INSTALL_TIMEOUT_S) -> dict[str, Path]:
    """Install the pinned clients under ``root`` unless they are there already (idempotent: a
    second call reads three ``package.json`` files). Returns each command's path.

    Raises ClientsUnavailable naming what is missing (``node``, ``npm``) or npm's own error."""
    root = root or clients_dir()
    if not all(_ready(c, root) for c in CLIENTS):
        missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
        if missing:
            raise ClientsUnavailable(
                f"{' and '.join(missing)} not found on PATH: the real-client tests install Claude Code, Codex CLI "
                f"and opencode with npm into {root}. Install Node.js 18 or later with npm "
                "(Debian/Ubuntu: apt-get install nodejs npm), then run `make test` again.")
        root.mkdir(parents=True, exist_ok=True)
        # exact versions, so that what the tests ran is what this file says
        manifest = {"name": "passerelle-test-clients", "private": True,
                    "dependencies": {c.package: c.version for c in CLIENTS}}
        (root / "package.json").write_text(json.dumps(manifest, indent=2) + "\n")
        specs = [f"{c.package}@{c.version}" for c in CLIENTS]
        print(f"passerelle: installing {', '.join(specs)} into {root} (npm)", file=sys.stderr, flush=True)
        try:
            done = subprocess.run(["npm", "install", "--prefix", str(root), "--save-exact", "--no-audit",
                                   "--no-fund", "--loglevel=error", *specs],
                                  capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise ClientsUnavailable(f"npm install did not finish within {timeout_s:g} s") from None
        if done.returncode != 0:
            raise ClientsUnavailable(f"npm install {' '.join(specs)} failed ({done.returncode}):\n"
                                     f"{done.stderr[-3000:]}")
        wrong = [f"{c.package} (found {installed_version(c, root)}, want {c.version})"
                 for c in CLIENTS if not _ready(c, root)]
        if wrong:
            raise ClientsUnavailable("npm install left these clients missing or at another version: "
                                     + ", ".join(wrong))
    return {c.name: _bin(c, root) for c in CLIENTS}


def main() -> int:
    try:
        bins = ensure_clients()
    except ClientsUnavailable as exc:
        print(f"passerelle: {exc}", file=sys.stderr)
        return 1
    for c in CLIENTS:
        print(f"passerelle: {c.package} {c.version} at {bins[c.name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
