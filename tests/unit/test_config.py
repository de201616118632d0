import textwrap

import pytest

from passerelle.config import load_config
from passerelle.errors import ConfigError


def write(tmp_path, text: str):
    p = tmp_path / "p.toml"
    p.write_text(textwrap.dedent(text))
    return p


def test_defaults_use_the_embedded_runtime():
    cfg = load_config(env={})
    assert cfg.uses_embedded
    assert (cfg.server.host, cfg.server.port, cfg.server.max_body_bytes) == ("127.0.0.1", 8080, 8 * 1024 * 1024)
    assert cfg.server.cors_origins == ()


def test_backends_are_frozen_dataclasses(tmp_path):
    cfg = load_config(write(tmp_path, """
        [[backends]]
        name = "a"
        kind = "vllm"
        url = "http://127.0.0.1:8000"
        models = ["m1", "m2"]
        max_concurrency = 8
    """), env={})
    b = cfg.backends[0]
    assert (b.name, b.kind, b.models, b.max_concurrency) == ("a", "vllm", ("m1", "m2"), 8)
    with pytest.raises(AttributeError):
        b.name = "x"  # type: ignore[misc]


def test_environment_overrides_the_file(tmp_path):
    path = write(tmp_path, "[server]\nport = 9000\n[timeouts]\ntotal_s = 10\n")
    cfg = load_config(path, env={"PASSERELLE_SERVER_PORT": "9100", "PASSERELLE_TIMEOUTS_FIRST_TOKEN_S": "2.5",
                                 "PASSERELLE_SERVER_ACCESS_LOG": "false"})
    assert cfg.server.port == 9100
    assert cfg.timeouts.total_s == 10.0 and cfg.timeouts.first_token_s == 2.5
    assert cfg.server.access_log is False


@pytest.mark.parametrize(("text", "key", "line", "expect"), [
    ("[server]\nport = \"eighty\"\n", "server.port", 2, "expected an integer"),
    ("[server]\n\nhots = \"x\"\n", "server.hots", 3, "unknown key"),
    ("[timeouts]\ntotal_s = -1\n", "timeouts.total_s", 2, "positive"),
    ("[sever]\nport = 1\n", "sever", 1, "unknown section"),
    ("[[backends]]\nname = \"a\"\nkind = \"tgi2\"\nurl = \"http://x\"\nmodels = [\"m\"]\n",
     "backends[0].kind", 3, "expected one of"),
    ("[[backends]]\nname = \"a\"\nurl = \"http://x\"\n", "backends[0].models", 2, "at least one model"),
    ("[[backends]]\nname = \"a\"\nmodels = [\"m\"]\nurl = \"http://x\"\n"
     "[[backends]]\nname = \"b\"\nmodels = [\"m\"]\nlaunch = [\"llama-server\"]\n",
     "backends[1].launch", 8, "{port}"),
    ("[[backends]]\nurl = \"http://x\"\nmodels = [\"m\"]\n", "backends.name", None, "missing required key"),
    ("[[backends]]\nname = \"a\"\nurl = \"http://x\"\nmodels = [\"m\"]\n[[models]]\nname = \"m\"\n"
     "tool_calls = \"qwen3\"\n", "models[0].tool_calls", 7, "expected one of off, auto, hermes, qwen3-xml"),
])
def test_errors_name_file_key_and_line(tmp_path, text, key, line, expect):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    err = info.value
    assert err.file == str(path)
    assert err.key == key
    assert err.line == line
    assert expect in str(err)
    assert str(path) in str(err)


def test_bad_environment_value_is_named():
    with pytest.raises(ConfigError, match=r"PASSERELLE_SERVER_PORT.*expected an integer"):
        load_config(env={"PASSERELLE_SERVER_PORT": "x"})


def test_invalid_toml_is_reported(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[server\n"), env={})


def test_example_configuration_loads(llama_server_on_path):
    cfg = load_config("passerelle.example.toml", env={})
    assert cfg.backends, "the example shows backends"


def test_a_launch_program_that_does_not_exist_is_named_with_file_key_and_line(tmp_path):
    path = write(tmp_path, """
        [[backends]]
        name = "a"
        models = ["m"]
        launch = ["/nowhere/llama-server", "--port", "{port}"]
    """)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert str(err.value) == (f"{path}:5: key 'backends[0].launch': the program '/nowhere/llama-server' "
                              "is not an executable file or a command on PATH (or '{llama-server}', the "
                              "llama-server `passerelle setup` built)")


def test_limits_on_what_a_runtime_sends_are_validated_and_overridable(tmp_path):
    cfg = load_config(write(tmp_path, """
        [timeouts]
        client_write_s = 5

        [limits]
        max_answer_bytes = 1048576
        max_event_bytes = 65536
    """), env={"PASSERELLE_LIMITS_MAX_ERROR_BYTES": "4096"})
    assert (cfg.limits.max_answer_bytes, cfg.limits.max_error_bytes, cfg.limits.max_event_bytes) == (
        1048576, 4096, 65536)
    assert cfg.timeouts.client_write_s == 5.0
    defaults = load_config(env={}).limits
    assert (defaults.max_answer_bytes, defaults.max_error_bytes, defaults.max_event_bytes) == (
        64 * 1024 * 1024, 256 * 1024, 1024 * 1024)
    with pytest.raises(ConfigError, match=r"p\.toml:4: key 'limits\.max_event_bytes': expected a size in bytes"):
        load_config(write(tmp_path, "[limits]\nmax_answer_bytes = 1048576\n\nmax_event_bytes = 10\n"), env={})
    with pytest.raises(ConfigError, match=r"key 'timeouts\.client_write_s': expected a positive number"):
        load_config(write(tmp_path, "[timeouts]\nclient_write_s = 0\n"), env={})
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(write(tmp_path, "[limits]\nmax_body = 1\n"), env={})


def test_a_models_tool_calls_is_one_of_the_formats_and_off_by_default(tmp_path):
    text = "[[backends]]\nname = \"a\"\nurl = \"http://x\"\nmodels = [\"m\", \"n\"]\n[[models]]\nname = \"m\"\n" \
           "tool_calls = \"harmony\"\n[[models]]\nname = \"n\"\n"
    cfg = load_config(write(tmp_path, text), env={})
    assert [m.tool_calls for m in cfg.models] == ["harmony", "off"]
