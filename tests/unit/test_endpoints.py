"""The one list of inference endpoints (passerelle/endpoints.py) and what derives from it: the
route table, the protocols, the catalogue's paths and capabilities, the embedded chat instance's
endpoints, the configuration's names. What is derived by construction is not tested again here;
what could still disagree is."""

from __future__ import annotations

from passerelle.config import ENDPOINT_KINDS, is_management_route, load_config
from passerelle.endpoints import BY_NAME, ENDPOINTS, NAMES
from passerelle.proxy import protocols
from passerelle.runtimes.catalogue import _GENERATE_NOTHING, ROUTES
from passerelle.runtimes.factory import CHAT_ENDPOINTS
from passerelle.runtimes.kinds import KINDS
from passerelle.runtimes.model_caps import _BY_ENDPOINT
from passerelle.server import routes
from passerelle.server.routes import Access, match


def test_every_public_path_belongs_to_one_endpoint_and_routes_to_it():
    paths = [p for e in ENDPOINTS for p in e.paths]
    assert len(paths) == len(set(paths))  # two endpoints never claim one path
    for e in ENDPOINTS:
        for path in e.paths:
            assert match("POST", path).target == e.name
            assert not is_management_route(path), path
    # no inference route is written by hand beside the list
    assert {(r.path, r.target) for r in routes.ROUTES if r.access is Access.INFERENCE} == {
        (p, e.name) for e in ENDPOINTS for p in e.paths}


def test_each_endpoint_is_read_by_the_protocols_as_it_says():
    assert set(protocols._PARSING) <= set(NAMES)  # a misspelt name there would be silently ignored
    for e in ENDPOINTS:
        api = protocols.API[e.name]
        assert (api.upstream, api.grammar, api.errors, api.scheduled, api.generates) == (
            e.upstream, e.grammar, e.errors, e.scheduled, e.generates)


def test_what_derives_from_the_list_is_what_it_was():
    assert ENDPOINT_KINDS == NAMES
    assert ROUTES["rerank"] == "/v1/rerank" and ROUTES["apply_template"] == "/apply-template" and len(ROUTES) == 13
    assert _BY_ENDPOINT == {"chat": "chat", "completions": "completions", "embeddings": "embeddings",
                            "rerank": "rerank", "audio": "transcriptions"}
    assert set(_GENERATE_NOTHING) == {"embeddings", "count_tokens", "responses_input_tokens", "tokenize",
                                      "detokenize", "apply_template", "rerank"}
    # the embedded chat instance serves all but what needs llama-server in another mode
    assert set(NAMES) - set(CHAT_ENDPOINTS) == {"embeddings", "rerank"}
    assert {BY_NAME[n].mode for n in ("embeddings", "rerank")} == {"embeddings", "reranking"}


def test_every_kind_serves_named_endpoints_and_a_backend_may_list_only_those(tmp_path):
    for kind, cls in KINDS.items():
        assert set(cls.serves) <= set(NAMES), kind
    path = tmp_path / "p.toml"
    path.write_text('[[backends]]\nname = "b"\nurl = "http://h:1"\nmodels = ["m"]\nendpoints = ["rerank", "infill"]\n')
    assert load_config(path, env={}).backends[0].endpoints == ("rerank", "infill")
