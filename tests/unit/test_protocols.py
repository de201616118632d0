"""What the gateway reads of each API (protocols.py), the route table and allow-lists that name
them, and the refusal of runtimes' management routes."""

import dataclasses

import orjson
import pytest

from passerelle.config import BackendConfig, TimeoutConfig, is_management_route, load_config
from passerelle.errors import ConfigError, InvalidRequest, RateLimited, Unauthorized, UnknownModel
from passerelle.proxy.protocols import (
    ANTHROPIC,
    API,
    OPENAI,
    anthropic_type,
    error_body,
    form_fields,
    form_parts,
    replace_form_field,
)
from passerelle.runtimes.kinds import make_backend
from passerelle.server.routes import match

MSGS = [{"role": "user", "content": "hi"}]


def test_every_route_is_either_the_gateways_or_names_its_handler():
    """An inference route names its endpoint; every other one a handler: a coroutine function of
    the service and one ASGI request (server/handlers.py), and never None."""
    import inspect

    from passerelle.server import handlers
    from passerelle.server.routes import ROUTES, Access

    for r in ROUTES:
        if r.access is Access.INFERENCE:
            assert r.target and r.handler is None, r.path
        else:
            assert r.handler is not None and not r.target, r.path
            assert inspect.iscoroutinefunction(r.handler) and r.handler.__module__ == handlers.__name__, r.path
            assert list(inspect.signature(r.handler).parameters) == ["svc", "scope", "receive", "send"], r.path


def test_parse_reads_the_fields_each_api_names():
    req = API["responses"].parse(orjson.dumps({"model": "m", "input": "x", "max_output_tokens": 7, "stream": True}),
                                 None)
    assert (req.model, req.stream, req.max_tokens) == ("m", True, 7)
    req = API["infill"].parse(orjson.dumps({"input_prefix": "a", "input_suffix": "b", "n_predict": 5}), None)
    assert req.model is None and req.max_tokens == 5 and not req.stream
    req = API["rerank"].parse(orjson.dumps({"model": "r", "query": "q", "documents": ["d"], "stream": True}), None)
    assert not req.stream  # rerank never streams


@pytest.mark.parametrize(("api", "body", "text"), [
    ("messages", {"model": "m"}, "'messages'"),
    ("messages", {"model": "m", "messages": "hi"}, "'messages' must be"),
    ("responses", {"input": "x"}, "'model'"),
    ("completions", {"model": "m", "prompt": {"a": 1}}, "'prompt' must be"),
    ("responses", {"model": "m", "input": 5}, "'input' must be"),
    ("responses", {"model": "m", "input": "x", "max_output_tokens": "5"}, "'max_output_tokens'"),
    ("rerank", {"model": "m", "query": "q", "documents": []}, "'documents'"),
    ("infill", {"input_prefix": "a"}, "'input_suffix'"),
    ("detokenize", {}, "'tokens'"),
    ("count_tokens", {"model": "m", "messages": MSGS, "stream": "yes"}, "'stream'"),
    ("chat", {"model": "m", "messages": MSGS, "max_tokens": -1}, "'max_tokens' must be a non-negative"),
    ("chat", {"model": "m", "messages": MSGS, "max_completion_tokens": True}, "'max_completion_tokens'"),
    ("chat", {"model": "m", "messages": MSGS, "n": 0}, "'n' must be a positive"),
    ("completions", {"model": "m", "prompt": "p", "best_of": 1.5}, "'best_of'"),
    ("infill", {"input_prefix": "a", "input_suffix": "b", "n_predict": -2}, "'n_predict'"),
    ("chat", {"model": "m", "messages": MSGS, "stream_options": True}, "'stream_options'"),
    ("chat", {"model": "m", "messages": MSGS, "user": 7}, "'user' must be"),
    ("embeddings", {"model": "m", "input": {"a": 1}}, "'input' must be"),
])
def test_parse_refuses_what_the_gateway_relies_on(api, body, text):
    with pytest.raises(InvalidRequest) as info:
        API[api].parse(orjson.dumps(body), None)
    assert text in info.value.message


def test_parse_accepts_the_limits_at_their_edges():
    chat = {"model": "m", "messages": MSGS, "stream": None, "max_tokens": 0, "n": 1, "stream_options": {},
            "user": "u", "max_completion_tokens": None}
    assert API["chat"].parse(orjson.dumps(chat), None).max_tokens == 0
    assert API["infill"].parse(orjson.dumps({"input_prefix": "a", "input_suffix": "b", "n_predict": -1}),
                               None).max_tokens == -1  # llama-server's "no limit"
    assert API["embeddings"].parse(orjson.dumps({"model": "m", "input": ["a", "b"]}), None).model == "m"


def test_multipart_model_comes_from_the_form():
    body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            b"Content-Type: audio/wav\r\n\r\nRIFF\x00\x01name=\"model\"\r\n"
            b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n"
            b"--XyZ\r\nContent-Disposition: form-data; name=\"stream\"\r\n\r\ntrue\r\n--XyZ--\r\n")
    req = API["transcriptions"].parse(body, "multipart/form-data; boundary=XyZ")
    assert (req.model, req.stream, req.data) == ("whisper-1", True, None)
    assert form_fields(body, 'multipart/form-data; boundary="XyZ"', ("model",)) == {"model": "whisper-1"}
    with pytest.raises(InvalidRequest, match="multipart"):
        API["transcriptions"].parse(body, "application/json")
    with pytest.raises(InvalidRequest, match="'model'"):
        API["transcriptions"].parse(body.replace(b'name="model"', b'name="other"'), "multipart/form-data; boundary=XyZ")


def upload(audio: bytes, model: bytes = b"whisper-1", boundary: bytes = b"XyZ") -> bytes:
    b = b"--" + boundary
    return (b + b"\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
            b"Content-Type: audio/wav\r\n\r\n" + audio + b"\r\n"
            + b + b"\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n" + model + b"\r\n"
            + b + b"\r\nContent-Disposition: form-data; name=\"language\"\r\n\r\nfr\r\n" + b + b"--\r\n")


def test_the_model_field_of_an_upload_is_rewritten_alone():
    ctype = "multipart/form-data; boundary=XyZ"
    # a file with CRLFs, header-like lines and a 'name="model"' of its own, 4 MB
    audio = b"RIFF\r\n\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nnot-this\x00\xff" * 1000
    audio += bytes(range(256)) * 16384
    body = upload(audio)
    out = replace_form_field(body, ctype, "model", "large-v3-turbo")
    assert out == upload(audio, b"large-v3-turbo")  # every other byte as it was
    assert form_fields(out, ctype, ("model", "language")) == {"model": "large-v3-turbo", "language": "fr"}
    parts = list(form_parts(out, ctype))
    assert [(p.name, p.is_file) for p in parts] == [("file", True), ("model", False), ("language", False)]
    assert out[parts[0].start:parts[0].end] == audio
    assert API["transcriptions"].parse(out, ctype).model == "large-v3-turbo"
    # a shorter name, and the model as the last part without its closing delimiter
    short = b"--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1"
    assert replace_form_field(short, ctype, "model", "w") == short.replace(b"whisper-1", b"w")


def test_a_form_with_two_model_fields_is_refused():
    # the gateway routes by one, a runtime may read the other
    body = upload(b"RIFF").replace(b"--XyZ--", b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\n'
                                                b"other\r\n--XyZ--")
    with pytest.raises(InvalidRequest, match="more than one 'model'"):
        API["transcriptions"].parse(body, "multipart/form-data; boundary=XyZ")


@pytest.mark.parametrize(("err", "status", "kind"), [
    (InvalidRequest("bad"), 400, "invalid_request_error"),
    (Unauthorized("who"), 401, "authentication_error"),
    (UnknownModel("x", ["m"]), 404, "not_found_error"),
    (RateLimited("slow", retry_after=2), 429, "rate_limit_error"),
])
def test_anthropic_error_shape(err, status, kind):
    body, ctype = error_body(err, ANTHROPIC)
    assert orjson.loads(body) == {"type": "error", "error": {"type": kind, "message": err.message}}
    assert err.status == status and ctype == b"application/json"
    assert orjson.loads(error_body(err, OPENAI)[0])["error"]["message"] == err.message
    assert anthropic_type(503) == "overloaded_error" and anthropic_type(502) == "api_error"


def test_kinds_allow_lists_and_operator_additions():
    def endpoints(kind: str, **kw) -> tuple[str, ...]:
        return make_backend(BackendConfig(name="b", kind=kind, url="http://x", models=("m",), **kw),
                            TimeoutConfig()).endpoints

    assert endpoints("openai") == ("chat", "completions", "embeddings")
    assert {"responses", "messages", "rerank", "tokenize", "infill"} <= set(endpoints("llama-server"))
    assert "infill" not in endpoints("vllm") and "messages" in endpoints("ollama")
    assert endpoints("openai", endpoints=("chat", "responses"), extra_routes=("/v1/score",)) == \
        ("chat", "responses", "/v1/score")


@pytest.mark.parametrize("path", ["/slots", "/slots/0", "/props", "/models/load", "/sleep", "/wake_up",
                                  "/reset_prefix_cache", "/v1/load_lora_adapter", "/lora-adapters", "/collective_rpc",
                                  "/api/pull", "/api/delete", "/metrics", "/admin/reload", "/v1/models"])
def test_management_routes_are_recognised(path):
    assert is_management_route(path)


def test_extra_routes_are_checked(tmp_path):
    cfg = tmp_path / "p.toml"
    cfg.write_text('[server]\nextra_routes = ["/v1/score"]\n[[backends]]\nname = "a"\nurl = "http://x"\n'
                   'models = ["m"]\nextra_routes = ["/classify"]\n')
    loaded = load_config(cfg, env={})
    assert loaded.server.extra_routes == ("/v1/score",) and loaded.backends[0].extra_routes == ("/classify",)
    from passerelle.runtimes.factory import expand

    assert expand(loaded).backends[0].extra_routes == ("/v1/score", "/classify")
    for bad, why in [('"/reset_prefix_cache"', "management"), ('"/slots/0"', "management"), ('"v1/x"', "a path")]:
        cfg.write_text(f"[server]\nextra_routes = [{bad}]\n")
        with pytest.raises(ConfigError) as info:
            load_config(cfg, env={})
        assert why in str(info.value) and "server.extra_routes" in str(info.value) and ":2" in str(info.value)
    cfg.write_text('[[backends]]\nname = "a"\nurl = "http://x"\nmodels = ["m"]\nendpoints = ["chat", "speech"]\n')
    with pytest.raises(ConfigError, match=r"backends\[0\]\.endpoints"):
        load_config(cfg, env={})


def test_extra_routes_reach_the_route_table():
    from passerelle.server.routes import extra_route

    extra = {"/v1/score": extra_route("/v1/score")}
    assert match("POST", "/v1/score", extra).target == "/v1/score"
    assert dataclasses.astuple(match("POST", "/v1/responses", extra))[3] == "responses"


def test_responses_fields_the_runtime_decides_on_pass():
    # a stored prompt instead of input, a prompt template object: not the gateway's business
    req = API["responses"].parse(orjson.dumps({"model": "m", "prompt": {"id": "pmpt_1"},
                                               "previous_response_id": "resp_1"}), None)
    assert req.model == "m" and req.data["prompt"] == {"id": "pmpt_1"}
