"""Every configuration key the loader accepts is in passerelle.example.toml (set, or commented out
with its default) and named in the documentation (README.md or docs/), so that a key added to
config.py without both fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from passerelle.config import (
    _SECTIONS,
    BackendConfig,
    BoxConfig,
    ClassConfig,
    ModelConfig,
    RpcWorkerConfig,
    load_config,
)
from passerelle.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "passerelle.example.toml"
TABLES: dict[str, type] = {**_SECTIONS, "backends": BackendConfig, "classes": ClassConfig, "models": ModelConfig,
                         "boxes": BoxConfig, "rpc_workers": RpcWorkerConfig}


def accepted_keys() -> dict[str, list[str]]:
    """What the loader accepts, by table: the fields of each table's dataclass (config._build)."""
    return {table: [f.name for f in dataclasses.fields(cls)] for table, cls in TABLES.items()}


def example_keys() -> dict[str, set[str]]:
    """Keys of each table in the example, set (``key = …``) or commented out (``# key = …``)."""
    found: dict[str, set[str]] = {}
    table = None
    for line in EXAMPLE.read_text().splitlines():
        if m := re.match(r"^\s*#?\s*\[\[?\s*([a-z_]+)\s*\]\]?(\s|$)", line):
            table = m.group(1)
            found.setdefault(table, set())
        elif table is not None and (m := re.match(r"^\s*#?\s*([a-z_][a-z0-9_]*)\s*=", line)):
            found[table].add(m.group(1))
    return found


def test_the_walk_covers_every_table_the_loader_reads(tmp_path):
    (tmp_path / "p.toml").write_text("[nope]\n")
    with pytest.raises(ConfigError) as err:  # the loader names the tables it reads
        load_config(tmp_path / "p.toml", env={})
    named = str(err.value).split("expected one of:", 1)[1]
    assert {t.strip(" .") for t in named.split(",")} == set(TABLES)


def test_every_configuration_key_is_in_the_example():
    have = example_keys()
    missing = [f"[{t}] {k}" for t, keys in accepted_keys().items() for k in keys if k not in have.get(t, set())]
    assert not missing, f"passerelle.example.toml lacks {len(missing)} keys: {', '.join(missing)}"
    unknown = [f"[{t}] {k}" for t, keys in have.items() for k in keys if k not in accepted_keys().get(t, [])]
    assert not unknown, f"passerelle.example.toml shows keys the loader refuses: {', '.join(unknown)}"


def test_every_configuration_key_is_in_the_documentation():
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    missing = []
    for table, keys in accepted_keys().items():
        for key in keys:
            # `key`, `table.key`, `[table] key`, or key = … in a TOML snippet
            pattern = rf"`{key}[` =]|\b{table}\.{key}\b|\[\[?{table}\]\]?\s+`?{key}\b|^\s*{key}\s*="
            if not re.search(pattern, docs, re.M):
                missing.append(f"[{table}] {key}")
    assert not missing, f"README.md and docs/ never name {len(missing)} keys: {', '.join(missing)}"
