"""``passerelle keys audit`` prints client text (the admin API's actor header, labels, owners,
values written by an older version) escaped: no control character, ANSI escape or line separator
reaches the terminal, so no row can forge another or drive the terminal."""

from __future__ import annotations

import re

from passerelle.cli import main
from passerelle.tenants.keys import KeyStore

HOSTILE = "\x1b[2J\x1b]0;pwned\x07\x9b31m\nFORGED 2026-01-01 cli:root create k\u2028\u202eevil"


def test_keys_audit_escapes_client_text(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PASSERELLE_STATE", str(tmp_path))
    store = KeyStore(tmp_path / "passerelle.db")
    key, _ = store.create("team", actor=f"admin API from 127.0.0.1 ({HOSTILE})", label=HOSTILE, owner=HOSTILE)
    store.update(key.id, actor="cli:alice", models=(HOSTILE,))
    capsys.readouterr()
    assert main(["keys", "audit"]) == 0
    out = capsys.readouterr().out
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e]", out), repr(out)
    lines = out.splitlines()
    assert len(lines) == 2 and "FORGED" not in "".join(line.split("  ")[0] for line in lines)
    assert "\\x1b[2J" in lines[0] and "\\x9b31m" in lines[0] and "\\x0aFORGED" in lines[0]
    assert "cli:alice" in lines[1] and "\\u202eevil" in lines[1]
