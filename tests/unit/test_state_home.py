"""One home for an instance's state: runtime logs and learned memory follow ``[server] state_dir``
like the key store; ``launch`` may name the cached llama-server build; the admin commands find the
gateway from its configuration file; the key commands say which store they read."""

from __future__ import annotations

import sys
import textwrap

import pytest

from passerelle.cli import admin_address, main
from passerelle.config import BackendConfig, Config, ServerConfig, load_config
from passerelle.errors import ConfigError
from passerelle.runtimes.factory import expand
from tests.inprocess import gateway


def launched(name: str = "chat") -> BackendConfig:
    # on demand: nothing is started, the paths are what is looked at
    return BackendConfig(name=name, kind="llama-server", models=("m",), on_demand=True,
                         launch=(sys.executable, "-c", "pass", "{port}"))


async def test_a_test_gateway_writes_nothing_in_the_users_state_directory():
    home = Config().state_path(env={})
    async with gateway(launched()) as gw:  # (no db, no state_dir: the default an instance gets)
        where = gw.app.cfg.db_path()
        assert gw.app.batches.root == where.parent
    assert not where.is_relative_to(home) and where.parent.is_dir()


async def test_two_instances_with_a_backend_of_the_same_name_share_no_file(tmp_path):
    seen = []
    for inst in ("a", "b"):
        state = tmp_path / inst
        async with gateway(launched(), server=ServerConfig(state_dir=str(state)), db=state / "passerelle.db") as gw:
            sup = gw.app.supervisor
            seen.append((sup.processes["chat"].log_path, sup.book.path, gw.app.stores.keys.path))
            assert all(p.is_relative_to(state) for p in seen[-1]), seen[-1]
    assert seen[0][0] == tmp_path / "a" / "logs" / "chat.log"
    assert seen[0][1] == tmp_path / "a" / "runtime-memory.json"
    assert not set(seen[0]) & set(seen[1])


async def test_a_log_file_named_in_the_configuration_is_kept(tmp_path):
    bc = launched()
    import dataclasses

    bc = dataclasses.replace(bc, log_file=str(tmp_path / "mine.log"))
    async with gateway(bc, server=ServerConfig(state_dir=str(tmp_path / "s")), db=tmp_path / "k.db") as gw:
        assert gw.app.supervisor.processes["chat"].log_path == tmp_path / "mine.log"


def write(tmp_path, text: str):
    path = tmp_path / "gw.toml"
    path.write_text(textwrap.dedent(text))
    return path


LAUNCH_CACHED = """
[[backends]]
name = "chat"
kind = "llama-server"
models = ["m"]
launch = ["{llama-server}", "-m", "/models/m.gguf", "--port", "{port}"]
"""


def test_launch_may_name_the_cached_build(tmp_path, monkeypatch):
    monkeypatch.setenv("PASSERELLE_CACHE", str(tmp_path / "cache"))
    cfg = load_config(write(tmp_path, LAUNCH_CACHED))  # valid though no such program is on PATH
    with pytest.raises(ConfigError, match=r"passerelle setup"):
        expand(cfg)  # not built yet: said, never built here
    from passerelle.runtimes import embedded

    binary = embedded.cached_binary()
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert expand(cfg).backends[0].launch == (str(binary), "-m", "/models/m.gguf", "--port", "{port}")


def test_launch_of_an_unknown_program_is_still_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"\{llama-server\}"):
        load_config(write(tmp_path, LAUNCH_CACHED.replace("{llama-server}", "no-such-llama-server")))


def test_admin_address_from_the_configuration():
    assert admin_address(Config()) == "http://127.0.0.1:8080"
    assert admin_address(Config(server=ServerConfig(host="0.0.0.0", port=9000))) == "http://127.0.0.1:9000"
    assert admin_address(Config(server=ServerConfig(host="::", port=9000))) == "http://[::1]:9000"
    from passerelle.config import AdminConfig

    assert admin_address(Config(admin=AdminConfig(port=9100, host="10.0.0.2"))) == "http://10.0.0.2:9100"


def test_a_bad_configuration_is_said_by_the_admin_commands(tmp_path, capsys):
    path = write(tmp_path, "[server]\nport = 'x'\n")
    assert main(["reload", "--config", str(path), "--timeout", "5"]) == 1
    assert "configuration error" in capsys.readouterr().err


def test_the_first_key_says_anonymous_access_is_off(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PASSERELLE_STATE", str(tmp_path))
    assert main(["keys", "create", "--tenant", "t1"]) == 0
    err = capsys.readouterr().err
    assert "anonymous access is now off" in err and str(tmp_path / "passerelle.db") in err
    assert main(["keys", "create", "--tenant", "t2"]) == 0
    assert "anonymous access" not in capsys.readouterr().err


def test_keys_list_and_usage_say_which_store_they_read(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PASSERELLE_STATE", str(tmp_path / "env-state"))
    cfg = write(tmp_path, "[server]\nstate_dir = 'here'\n")
    store = tmp_path / "here" / "passerelle.db"
    assert main(["keys", "list", "--config", str(cfg)]) == 0
    out = capsys.readouterr()
    assert out.err.strip() == f"store: {store}" and out.out.startswith("ID")
    assert main(["usage", "--config", str(cfg), "--csv"]) == 0
    out = capsys.readouterr()
    assert out.err.strip() == f"store: {store}" and out.out.startswith("tenant,class")
