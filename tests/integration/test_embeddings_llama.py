"""The embedded default's embeddings runtime, launched as ``passerelle serve`` launches it (the same
command line, from runtimes/factory.py), behind a real gateway: an input as long as /v1/models
advertises is embedded, and a longer one is the client's 400, naming its length and the limit.

It used to be launched without ``-b``/``-ub``: llama-server embeds an input in one physical batch,
512 tokens by default, so any input past 512 tokens got a 500 ``upstream_error`` ("input (902
tokens) is too large to process. increase the physical batch size") while /v1/models said 8,192."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from passerelle.config import Config, EmbeddedConfig
from passerelle.runtimes import factory

pytestmark = pytest.mark.llama

# 10 tokens for SmolLM2's tokenizer: 100 of them are about 900 tokens, 1,000 about 9,000
SENTENCE = "the lighthouse keeper lit the lamp at dusk. "


@pytest.fixture
def embedding(gateway, tmp_path):
    e = EmbeddedConfig(rerank=False)  # the default model (SmolLM2) and context (8,192 a slot)
    [embed] = [b for b in factory.embedded_backends(Config(embedded=e)) if b.name == "local-embed"]
    return gateway(f"""
        [[backends]]
        name = "embed"
        kind = "llama-server"
        launch = {json.dumps(list(embed.launch))}
        models = {json.dumps(list(embed.models))}
        endpoints = ["embeddings"]
        log_file = "{tmp_path / 'embed.log'}"
        ready_timeout_s = 300
        """, timeout=300), embed.models[0], e.ctx_per_slot


@pytest.mark.timeout(900)  # an input of 900 tokens is computed on shared cores
def test_an_input_past_512_tokens_is_embedded_and_one_past_the_context_is_a_400(embedding):
    gw, model, context = embedding
    r = httpx.post(gw.url + "/v1/embeddings", timeout=600, json={"model": model, "input": SENTENCE * 100})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 850 and len(r.json()["data"][0]["embedding"]) > 100

    r = httpx.post(gw.url + "/v1/embeddings", timeout=120, json={"model": model, "input": SENTENCE * 1000})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"
    found = re.search(r"The input is (\d+) tokens, more than the (\d+) tokens", error["message"])
    assert found and int(found[1]) > context and int(found[2]) == context, error["message"]
    assert gw.log_for(r.headers["x-request-id"])["cause"] == "invalid_request"
