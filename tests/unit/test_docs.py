"""The README and docs/ against the code: the README stays a front door with the set-up contract
first, every link between the pages lands on a file and a heading, every passerelle configuration
shown loads, the agents' recipes are the ones tests/integration/test_real_clients.py runs, and
``passerelle --help`` names the model a bare ``serve`` serves."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from passerelle.bench.workload import Workload, load_scenario
from passerelle.cli import build_parser
from passerelle.config import _SECTIONS, EmbeddedConfig, load_config
from tests.integration import test_real_clients as real

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
URL = "http://127.0.0.1:8080"  # the address every example uses
TABLES = {*_SECTIONS, "backends", "classes", "models", "boxes", "rpc_workers"}  # a configuration's top-level tables


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fence = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            out.append(line)
    return out


def blocks(page: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", page.read_text(), re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in prose(page.read_text()):
        if m := re.match(r"^#{1,6}\s+(.*?)\s*$", line):
            s = slug(m.group(1))
            seen[s] = seen.get(s, 0) + 1
    return {s if i == 0 else f"{s}-{i}" for s, n in seen.items() for i in range(n)}


def test_slug_is_githubs():
    assert slug("Coding agents: Claude Code, Codex CLI, opencode") == "coding-agents-claude-code-codex-cli-opencode"
    assert slug("Serving: no configuration, `--upstream`, a file") == "serving-no-configuration---upstream-a-file"


def test_the_readme_is_a_front_door_with_the_two_commands_first():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; details go to docs/"
    first_block = README.read_text().split("```sh\n", 1)[1].split("```", 1)[0]
    assert first_block.splitlines()[0].startswith("make run ") and first_block.splitlines()[1].startswith("make test ")
    assert not any(line.startswith("## ") for line in lines[:lines.index("```sh")]), "the commands come first"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_lands_on_a_file_and_a_heading(page: Path):
    broken = []
    for line in prose(page.read_text()):
        for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z]+:", target):
                continue  # another site
            path, _, anchor = target.partition("#")
            to = (page.parent / path).resolve() if path else page
            if not to.exists():
                broken.append(f"{target}: no such file")
            elif anchor and to.suffix == ".md" and anchor not in anchors(to):
                broken.append(f"{target}: {to.name} has no heading #{anchor}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def toml_examples() -> dict[str, list[tuple[str, str]]]:
    """The TOML blocks of the pages, by what reads them: a passerelle configuration (it names one of
    the loader's tables), a ``passerelle bench`` scenario (its ``[[class]]`` tables), or another
    program's file (Codex's config.toml)."""
    found: dict[str, list[tuple[str, str]]] = {"config": [], "scenario": [], "other": []}
    for page in PAGES:
        for i, text in enumerate(blocks(page, "toml")):
            top = set(tomllib.loads(text))
            kind = "config" if top & set(TABLES) else "scenario" if "class" in top else "other"
            found[kind].append((f"{page.name}#{i}", text))
    return found


EXAMPLES = toml_examples()


MODULE = re.compile(r"(?<![\w./-])((?:passerelle/|tests/|bench/)?[a-z_]+(?:/[a-z_]+)*/[a-z_]+\.py)\b")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_module_a_page_names_exists(page: Path):
    # A page that names a module a change moved or removed sends its reader to nothing.
    gone = sorted({m for m in MODULE.findall(page.read_text())
                   if not any((ROOT / base / m).is_file() for base in ("", "passerelle", "tests"))})
    assert not gone, f"{page.name} names modules that do not exist: {gone}"


def test_the_examples_are_found():
    assert len(EXAMPLES["config"]) >= 8 and any(n.startswith("README.md") for n, _ in EXAMPLES["config"])
    assert EXAMPLES["scenario"] and [n for n, _ in EXAMPLES["other"]] == ["clients.md#1"]


# Programs a configuration may launch by name that `make setup` does not put on PATH: vLLM is
# installed apart (runtimes-vllm.md). llama-server is not among them: after `make setup` it is
# "{llama-server}", the cached build, and a page that launches "llama-server" fails here.
INSTALLED_APART = ("vllm",)


@pytest.mark.parametrize(("name", "text"), EXAMPLES["config"], ids=[n for n, _ in EXAMPLES["config"]])
def test_every_configuration_shown_loads(name: str, text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for program in INSTALLED_APART:
        (bin_dir / program).write_text("#!/bin/sh\n")
        (bin_dir / program).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    (tmp_path / "gw.toml").write_text(text)
    load_config(tmp_path / "gw.toml", env={})


@pytest.mark.parametrize(("name", "text"), EXAMPLES["scenario"], ids=[n for n, _ in EXAMPLES["scenario"]])
def test_every_bench_scenario_shown_loads(name: str, text: str, tmp_path: Path):
    (tmp_path / "scenario.toml").write_text(text)
    classes = tomllib.loads(text)["class"]
    for c in classes:  # a trace as `passerelle usage --export-trace` writes it, beside the scenario
        if "trace" in c:
            (tmp_path / c["trace"]).write_text('{"t": 0, "prompt_tokens": 64, "output_tokens": 16}\n')
    keys = {c["api_key_env"]: "psk_x" for c in classes if "api_key_env" in c}
    load_scenario(tmp_path / "scenario.toml", Workload(), env=keys)


def test_the_agent_recipes_are_the_ones_the_real_clients_run():
    page = ROOT / "docs" / "clients.md"
    exports = dict(pair.split("=", 1) for block in blocks(page, "sh") for line in block.splitlines()
                   if line.startswith("export ") for pair in line.split()[1:])
    key = exports["ANTHROPIC_AUTH_TOKEN"]
    assert real.claude_env(URL, key).items() <= exports.items()
    assert {**real.OPENCODE_ENV, real.KEY_ENV: key}.items() <= exports.items()
    codex = next(b for b in blocks(page, "toml") if "model_provider" in b)
    assert tomllib.loads(codex) == tomllib.loads(real.codex_config(URL))
    # opencode sends the model's name as it is: the recipe names what the default gateway serves
    (opencode,) = blocks(page, "json")
    assert json.loads(opencode) == json.loads(real.opencode_config(URL, EmbeddedConfig().served_id))


def test_help_names_the_model_a_bare_serve_serves():
    text = " ".join(build_parser().format_help().split())
    assert f"default: an embedded llama-server with {EmbeddedConfig().served_id};" in text
