"""The model catalogue: names, aliases, rewrite, parameters, fallbacks, metadata. No servers."""

from __future__ import annotations

import textwrap

import orjson
import pytest

from passerelle.config import load_config
from passerelle.errors import ConfigError, InvalidRequest, UnknownModel
from passerelle.observe.metrics import Metrics
from passerelle.runtimes.catalogue import Catalogue
from passerelle.runtimes.kinds import make_backend
from passerelle.runtimes.registry import Registry

CONFIG = """
[[backends]]
name = "big"
url = "http://127.0.0.1:9"
models = ["qwen-14b"]
endpoints = ["chat", "completions"]

[[backends]]
name = "small"
url = "http://127.0.0.1:9"
models = ["gemma-270m"]

[[backends]]
name = "embed"
url = "http://127.0.0.1:9"
models = ["bge-m3"]
endpoints = ["embeddings"]

[[models]]
name = "chat"
aliases = ["gpt-4o*", "claude-*", "gpt-3.5-turbo"]
served_name = "qwen-14b"
defaults = { temperature = 0.7 }
set = { top_k = 20 }
cap = { max_tokens = 512 }
strip = ["logit_bias"]
context_length = 32768
capabilities = ["chat", "tools"]
fallbacks = ["chat-small"]
owned_by = "alibaba"

[[models]]
name = "chat-small"
served_name = "gemma-270m"
aliases = ["gpt-4o-mini"]

[[models]]
name = "text-embedding-3-small"
served_name = "bge-m3"
"""


@pytest.fixture
def cat(tmp_path):
    def make(eta=None, text: str = CONFIG) -> Catalogue:
        path = tmp_path / "c.toml"
        path.write_text(textwrap.dedent(text))
        cfg = load_config(path, env={})
        backends = [make_backend(b, cfg.timeouts) for b in cfg.backends]
        return Catalogue(cfg.models, Registry(backends, Metrics()), eta=eta)

    return make


def chat(model: str, **extra) -> tuple[dict, bytes]:
    data = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return data, orjson.dumps(data)


def always(_pool) -> float:
    return 0.0


def test_names_aliases_and_globs_resolve_to_one_public_model(cat):
    c = cat(always)
    for asked in ("chat", "gpt-4o", "gpt-4o-2024-08-06", "claude-3-5-sonnet-latest", "gpt-3.5-turbo", "qwen-14b"):
        data, body = chat(asked)
        route = c.resolve(asked, "chat", data, body)
        assert (route.name, route.served, [b.name for b in route.pool]) == ("chat", "qwen-14b", ["big"])
        assert orjson.loads(route.body)["model"] == "qwen-14b" and route.requested == asked
    # an exact alias wins over a glob that would also match
    data, body = chat("gpt-4o-mini")
    assert c.resolve("gpt-4o-mini", "chat", data, body).name == "chat-small"


def test_unknown_model_lists_the_public_names(cat):
    data, body = chat("llama-9000")
    with pytest.raises(UnknownModel) as err:
        cat().resolve("llama-9000", "chat", data, body)
    assert "chat, chat-small, text-embedding-3-small" in err.value.message and err.value.status == 404


def test_a_model_not_served_on_the_endpoint_is_a_400(cat):
    data = {"model": "text-embedding-3-small", "prompt": "x"}
    with pytest.raises(InvalidRequest, match="not served on /v1/completions"):
        cat().resolve("text-embedding-3-small", "completions", data, orjson.dumps(data))


def test_parameters_defaults_set_cap_and_strip(cat):
    c = cat(always)
    data, body = chat("gpt-4o", max_tokens=4000, temperature=0.1, top_k=99, logit_bias={"1": 5})
    out = orjson.loads(c.resolve("gpt-4o", "chat", data, body).body)
    assert out["max_tokens"] == 512  # capped
    assert out["temperature"] == 0.1  # a default does not override the client
    assert out["top_k"] == 20  # set does
    assert "logit_bias" not in out
    assert data["max_tokens"] == 4000 and "logit_bias" in data  # the client's dict is left alone
    data, body = chat("gpt-4o")
    out = orjson.loads(c.resolve("gpt-4o", "chat", data, body).body)
    assert out["max_tokens"] == 512 and out["temperature"] == 0.7  # no limit asked: the cap is the limit
    data, body = chat("gpt-4o", max_completion_tokens=100)
    out = orjson.loads(c.resolve("gpt-4o", "chat", data, body).body)
    assert out["max_completion_tokens"] == 100 and "max_tokens" not in out  # under the cap, kept as sent


def test_a_cap_bounds_each_apis_own_output_limit(cat):
    """A cap on max_tokens bounds Responses' max_output_tokens (it left a Responses client's limit
    as sent and added a max_tokens that API does not define), and adds no limit to a request that
    generates nothing (count_tokens, input_tokens)."""
    c = cat(always, CONFIG.replace('endpoints = ["chat", "completions"]', 'kind = "llama-server"'))
    data = {"model": "gpt-4o", "input": "hi", "max_output_tokens": 4000}
    out = orjson.loads(c.resolve("gpt-4o", "responses", data, orjson.dumps(data)).body)
    assert out["max_output_tokens"] == 512 and "max_tokens" not in out
    data = {"model": "gpt-4o", "input": "hi"}
    out = orjson.loads(c.resolve("gpt-4o", "responses", data, orjson.dumps(data)).body)
    assert out["max_output_tokens"] == 512 and "max_tokens" not in out  # no limit asked: the cap is the limit
    data = {"model": "claude-x", "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]}
    assert orjson.loads(c.resolve("claude-x", "messages", data, orjson.dumps(data)).body)["max_tokens"] == 512
    for endpoint, data in (("count_tokens", {"model": "claude-x", "messages": [{"role": "user", "content": "hi"}]}),
                           ("responses_input_tokens", {"model": "gpt-4o", "input": "hi"})):
        out = orjson.loads(c.resolve(data["model"], endpoint, data, orjson.dumps(data)).body)
        assert not {"max_tokens", "max_output_tokens", "max_completion_tokens"} & set(out), endpoint


def test_a_request_needing_no_change_keeps_its_exact_bytes(cat):
    body = b'{"model":"gemma-270m",  "messages":[{"role":"user","content":"hi"}]}'
    data = orjson.loads(body)
    route = cat().resolve("gemma-270m", "chat", data, body)
    assert route.body is body and route.name == "chat-small"


def test_fallback_when_the_pool_cannot_serve_in_time(cat):
    etas = {"big": None, "small": 0.0}
    c = cat(lambda pool: etas[pool[0].name])
    data, body = chat("gpt-4o", max_tokens=9999)
    route = c.resolve("gpt-4o", "chat", data, body, wait_s=60)
    assert (route.name, route.served, route.fallback_from) == ("chat-small", "gemma-270m", "chat")
    assert orjson.loads(route.body)["max_tokens"] == 9999  # the fallback's own parameters apply
    etas["big"] = 300.0  # a load (and the swap it needs) longer than the request may wait
    assert c.resolve("gpt-4o", "chat", data, body, wait_s=60).name == "chat-small"
    assert c.resolve("gpt-4o", "chat", data, body, wait_s=600).name == "chat"
    etas["small"] = None  # nothing can serve: the model asked for answers (no_backend or a wait)
    assert c.resolve("gpt-4o", "chat", data, body, wait_s=60).name == "chat"


def test_model_metadata_for_v1_models(cat):
    c = cat(always)
    d = c.describe("gpt-4o-2024-08-06", created=123)
    assert d is not None
    assert (d["id"], d["owned_by"], d["context_length"], d["capabilities"]) == ("chat", "alibaba", 32768,
                                                                                ["chat", "tools"])
    assert d["routes"] == ["/v1/chat/completions", "/v1/completions"] and d["backends"] == ["big"]
    assert d["loaded"] is False and d["state"] == "down" and d["fallbacks"] == ["chat-small"]
    embed = c.describe("text-embedding-3-small")
    assert embed is not None and embed["capabilities"] == ["embeddings"]
    assert [m["id"] for m in c.listing()] == ["chat", "chat-small", "text-embedding-3-small"]
    assert c.describe("nope") is None


def test_without_a_catalogue_every_served_model_is_a_public_name(cat):
    c = cat(text=CONFIG.split("[[models]]")[0])
    assert c.names == ["qwen-14b", "gemma-270m", "bge-m3"]
    data, body = chat("qwen-14b")
    route = c.resolve("qwen-14b", "chat", data, body)
    assert route.name == "qwen-14b" and route.body is body


@pytest.mark.parametrize(("extra", "key", "expect"), [
    ('[[models]]\nname = "x"\nserved_name = "nope"\n', "models[3].served_name", "no backend serves 'nope'"),
    ('[[models]]\nname = "x"\nserved_name = "bge-m3"\nfallbacks = ["ghost"]\n', "models[3].fallbacks",
     "unknown fallback 'ghost'"),
    ('[[models]]\nname = "x"\nserved_name = "bge-m3"\naliases = ["gpt-3.5-turbo"]\n', "models[3].aliases",
     "already used"),
    ('[[models]]\nname = "x"\nserved_name = "bge-m3"\ncap = { max_tokens = "lots" }\n', "models[3].cap",
     "non-negative numbers"),
    ('[[models]]\nname = "x"\nserved_name = "bge-m3"\ncapabilities = ["telepathy"]\n', "models[3].capabilities",
     "unknown capability"),
    ('[[models]]\nname = "x"\nserved_name = "bge-m3"\nset = { model = "y" }\n', "models[3].set", "served_name"),
])
def test_catalogue_errors_name_the_key_and_line(tmp_path, extra, key, expect):
    path = tmp_path / "c.toml"
    path.write_text(textwrap.dedent(CONFIG) + extra)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert err.value.key == key and expect in str(err.value)
    assert err.value.line is not None and err.value.line > textwrap.dedent(CONFIG).count("\n")


LLAMA = """
[[backends]]
name = "gemma"
kind = "llama-server"
url = "http://127.0.0.1:9"
models = ["gemma-270m"]
extra_routes = ["/v1/chat/completions/input_tokens"]

[[backends]]
name = "ranker"
kind = "llama-server"
url = "http://127.0.0.1:9"
models = ["bge-reranker"]
endpoints = ["rerank", "tokenize"]

[[backends]]
name = "generic"
url = "http://127.0.0.1:9"
models = ["some-model"]
"""


def test_v1_models_lists_every_route_a_model_is_served_on(cat):
    c = cat(text=LLAMA)
    gemma = c.describe("gemma-270m")
    assert gemma is not None
    # llama-server's kind serves every inference API; the extra route comes last
    assert gemma["routes"] == ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
                               "/v1/responses/input_tokens", "/v1/messages", "/v1/messages/count_tokens",
                               "/v1/rerank", "/tokenize", "/detokenize", "/apply-template", "/infill",
                               "/v1/audio/transcriptions", "/v1/chat/completions/input_tokens"]
    # a route the kind merely answers is not a capability; one the operator declared is
    assert gemma["capabilities"] == ["chat", "completions", "embeddings"]
    ranker = c.describe("bge-reranker")
    assert ranker is not None and ranker["routes"] == ["/v1/rerank", "/tokenize"]
    assert ranker["capabilities"] == ["rerank"]
    generic = c.describe("some-model")
    assert generic is not None and generic["routes"] == ["/v1/chat/completions", "/v1/completions",
                                                         "/v1/embeddings"]
    assert [m["routes"] for m in c.listing()] == [gemma["routes"], ranker["routes"], generic["routes"]]


def test_a_form_is_routed_by_the_catalogue_and_left_for_the_gateway_to_rewrite(cat):
    etas = {"big": None, "small": 0.0}
    c = cat(lambda pool: etas[pool[0].name], text=CONFIG.replace(
        'endpoints = ["chat", "completions"]', 'endpoints = ["chat", "completions", "transcriptions"]').replace(
        'models = ["gemma-270m"]', 'models = ["gemma-270m"]\nendpoints = ["transcriptions"]'))
    body = b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ngpt-4o\r\n--b--\r\n"
    route = c.resolve("gpt-4o", "transcriptions", None, body, wait_s=60)
    # the pool is down: the fallback serves, under its own served name; the body is not touched here
    assert (route.name, route.served, route.fallback_from, route.data) == ("chat-small", "gemma-270m", "chat", None)
    assert route.body is body and not route.rewritten
    etas["big"] = 0.0
    route = c.resolve("claude-3-opus", "transcriptions", None, body)
    assert (route.name, route.served, [b.name for b in route.pool]) == ("chat", "qwen-14b", ["big"])
    with pytest.raises(InvalidRequest, match="not served on /v1/audio/transcriptions"):
        c.resolve("text-embedding-3-small", "transcriptions", None, body)


def _embedded_catalogue(cfg) -> Catalogue:
    """The catalogue the embedded default gets (runtimes/factory.expand), without building anything."""
    import dataclasses

    from passerelle.config import BackendConfig
    from passerelle.runtimes.factory import CHAT_ENDPOINTS, embedded_models

    chat_backend = BackendConfig(name="local", kind="llama-server", url="http://127.0.0.1:9",
                                 models=(cfg.embedded.served_id,), endpoints=CHAT_ENDPOINTS)
    cfg = dataclasses.replace(cfg, backends=(chat_backend,), models=(*cfg.models, *embedded_models(cfg)))
    return Catalogue(cfg.models, Registry([make_backend(b, cfg.timeouts) for b in cfg.backends], Metrics()))


def test_the_embedded_default_serves_the_names_coding_agents_ask_for(tmp_path):
    """Claude Code asks for its claude-* models (a haiku one for background work), Codex for gpt-*:
    with no configuration both reach the embedded model, rewritten to its id."""
    cfg = load_config(None, env={})
    c = _embedded_catalogue(cfg)
    served = cfg.embedded.served_id
    for asked, api in (("claude-sonnet-4-5-20250929", "messages"), ("claude-haiku-4-5", "messages"),
                       ("claude-opus-5-5", "count_tokens"), ("gpt-5.5", "responses"), ("gpt-4o-mini", "chat"),
                       (served, "chat")):
        data, body = chat(asked)
        route = c.resolve(asked, api, data, body)
        assert (route.name, route.served, route.requested) == (served, served, asked)
        assert orjson.loads(route.body)["model"] == served
    assert c.describe(served)["aliases"] == ["claude-*", "gpt-*"]
    with pytest.raises(UnknownModel):
        c.resolve("llama-9000", "chat", *chat("llama-9000"))


def test_embedded_aliases_can_be_changed_or_turned_off(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[embedded]\naliases = []\n')
    c = _embedded_catalogue(load_config(path, env={}))
    with pytest.raises(UnknownModel):
        c.resolve("gpt-5.5", "chat", *chat("gpt-5.5"))
    # a [[models]] entry for the embedded model replaces the default aliases
    path.write_text('[[models]]\nname = "local"\nserved_name = "gemma-3-270m"\naliases = ["gpt-4o"]\n')
    c = _embedded_catalogue(load_config(path, env={"PASSERELLE_EMBEDDED_MODEL_ID": "gemma-3-270m"}))
    assert c.resolve("gpt-4o", "chat", *chat("gpt-4o")).name == "local"
    with pytest.raises(UnknownModel):
        c.resolve("claude-haiku-4-5", "messages", *chat("claude-haiku-4-5"))
    path.write_text('[embedded]\naliases = ["gpt-*", " "]\n')
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert err.value.key == "embedded.aliases" and err.value.line == 2


def test_a_token_cap_bounds_a_responses_request_by_its_own_field(cat):
    """Responses names its output limit max_output_tokens: a cap on max_tokens bounds it, and sets
    it (not a chat field) when the client asked for no limit, as Codex does."""
    c = cat(always, text="""
    [[backends]]
    name = "rt"
    url = "http://127.0.0.1:9"
    models = ["m"]
    endpoints = ["chat", "responses", "messages"]

    [[models]]
    name = "m"
    aliases = ["gpt-*"]
    cap = { max_tokens = 48 }
    """)
    for sent, expect in (({"max_output_tokens": 100000}, 48), ({"max_output_tokens": 20}, 20), ({}, 48)):
        data = {"model": "gpt-5.5", "input": "hi", **sent}
        out = orjson.loads(c.resolve("gpt-5.5", "responses", data, orjson.dumps(data)).body)
        assert out["max_output_tokens"] == expect and "max_tokens" not in out
    data = {"model": "gpt-5.5", "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]}
    assert orjson.loads(c.resolve("gpt-5.5", "messages", data, orjson.dumps(data)).body)["max_tokens"] == 48
