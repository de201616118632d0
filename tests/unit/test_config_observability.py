"""[admin] and [metrics]: defaults, file values, environment overrides, errors naming key and line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from passerelle.config import load_config
from passerelle.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "p.toml"
    p.write_text(textwrap.dedent(text))
    return p


def test_defaults_serve_admin_routes_to_loopback_only_on_the_main_port():
    cfg = load_config(env={})
    assert cfg.admin.allow == ("127.0.0.0/8", "::1/128")
    assert (cfg.admin.key, cfg.admin.port, cfg.admin.host) == ("", 0, "127.0.0.1")
    assert (cfg.metrics.enabled, cfg.metrics.tenant_label, cfg.metrics.window_s) == (True, True, 300.0)


def test_file_values(tmp_path):
    cfg = load_config(write(tmp_path, """
        [admin]
        allow = ["10.0.0.0/8", "192.0.2.7"]
        key = "9c41e07b2fd5a836e1c0b7d4"
        port = 9091
        host = "0.0.0.0"
        [metrics]
        enabled = false
        tenant_label = false
        window_s = 600
    """), env={})
    assert cfg.admin.allow == ("10.0.0.0/8", "192.0.2.7") and cfg.admin.key == "9c41e07b2fd5a836e1c0b7d4"
    assert (cfg.admin.port, cfg.admin.host) == (9091, "0.0.0.0")
    assert (cfg.metrics.enabled, cfg.metrics.tenant_label, cfg.metrics.window_s) == (False, False, 600.0)


def test_environment_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "[admin]\nkey = \"file-8d2e61c0a9f3b7e4\"\n"), env={
        "PASSERELLE_ADMIN_KEY": "env-4b7f0d3a9e16c25b", "PASSERELLE_ADMIN_ALLOW": "0.0.0.0/0,::/0",
        "PASSERELLE_ADMIN_PORT": "9092", "PASSERELLE_METRICS_TENANT_LABEL": "no",
        "PASSERELLE_METRICS_WINDOW_S": "120"})
    assert cfg.admin.key == "env-4b7f0d3a9e16c25b" and cfg.admin.allow == ("0.0.0.0/0", "::/0")
    assert cfg.admin.port == 9092
    assert cfg.metrics.tenant_label is False and cfg.metrics.window_s == 120.0


@pytest.mark.parametrize(("text", "key", "line", "expect"), [
    ("[admin]\nallow = [\"127.0.0.1\", \"localhost\"]\n", "admin.allow", 2, "expected an address or network"),
    ("[admin]\nallow = \"127.0.0.1\"\n", "admin.allow", 2, "expected a list of strings"),
    ("[admin]\n\nport = 70000\n", "admin.port", 3, "between 1 and 65535"),
    ("[server]\nport = 9000\n[admin]\nport = 9000\n", "admin.port", 4, "must differ"),
    ("[admin]\nkey = \" padded \"\n", "admin.key", 2, "spaces"),
    ("[admin]\npasword = \"x\"\n", "admin.pasword", 2, "unknown key"),
    ("[metrics]\nenabled = \"yes\"\n", "metrics.enabled", 2, "true or false"),
    ("[metrics]\nwindow_s = 5\n", "metrics.window_s", 2, "between 10 and 86400"),
])
def test_errors_name_file_key_and_line(tmp_path, text, key, line, expect):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    err = info.value
    assert (err.file, err.key, err.line) == (str(path), key, line)
    assert expect in str(err) and str(path) in str(err)


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError) as info:
        load_config(env={"PASSERELLE_METRICS_ENABLED": "maybe"})
    assert info.value.key == "PASSERELLE_METRICS_ENABLED" and "true or false" in str(info.value)


def test_the_example_configuration_documents_admin_and_metrics(llama_server_on_path):
    example = Path(__file__).resolve().parents[2] / "passerelle.example.toml"
    text = example.read_text()
    for key in ("[admin]", "allow", "key", "port", "[metrics]", "tenant_label", "window_s", "enabled"):
        assert key in text
    load_config(example, env={})  # and it is valid
