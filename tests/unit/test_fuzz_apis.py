"""Every API through the gateway, in process, with arbitrary JSON in every field: Hypothesis.

Agent-shaped requests (tools with real JSON schemas, content parts, tool results: tests/jsonvalues.py)
with arbitrary JSON at a few places, or minimal ones with arbitrary JSON in some fields, go to each
inference route of one gateway (tests/inprocess.py) in front of the fake runtime, behind a model
catalogue that rewrites them (an alias, defaults, set, cap, strip), through a key with limits and a
quota, some at the preemptible batch class on a llama-server replica (the splice of a suspendable
stream, the answer assembled from a stream). Whatever the request, the answer is not the gateway's
own fault: no ``internal_error``, in the status, the body or the request's recorded cause; a 4xx
the gateway gives is in the API's own error shape.

One gateway per API for the whole run (started once, in its own event loop): the run stays well
within a minute on a loaded machine, reproducibly (derandomized); ``FUZZ_EXAMPLES=1000 FUZZ_RANDOM=1``
explores further.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from passerelle.config import AuthConfig, ModelConfig, TimeoutConfig
from passerelle.errors import Cause
from passerelle.tenants.keys import KeyStore
from passerelle.tenants.quota import Quota
from tests.inprocess import InProcessGateway, Response, fake_runtime, gateway
from tests.jsonvalues import REQUESTS, STREAMS, encode, json_values, mutated

FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "30")), deadline=None,
                derandomize=not os.environ.get("FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings",
         "responses": "/v1/responses", "messages": "/v1/messages", "count_tokens": "/v1/messages/count_tokens",
         "rerank": "/v1/rerank", "tokenize": "/tokenize", "detokenize": "/detokenize", "infill": "/infill"}
ANTHROPIC = ("messages", "count_tokens")
# Names a request may use: the two served models (one behind an OpenAI-compatible backend, one behind a
# llama-server one: answers assembled from a stream, slot ids, continuations), an alias, unknowns.
MODELS = ("llama-model", "fake-model", "gpt-4o-mini", "claude-sonnet-4", "nope", "")
FIELDS = ("model", "messages", "prompt", "input", "stream", "stream_options", "max_tokens", "max_completion_tokens",
          "max_output_tokens", "n_predict", "n", "best_of", "user", "tools", "tool_choice", "response_format",
          "system", "instructions", "documents", "query", "tokens", "content", "input_prefix", "input_suffix",
          "input_extra", "temperature", "id_slot", "priority", "metadata", "prompt_cache_key")
RULES = {"defaults": (("temperature", 0.7), ("stream_options", {"include_usage": True})),
         "set": (("top_k", 20),), "strip": ("logit_bias", "id_slot"),
         # the fake runtime generates max_tokens tokens: every request is bounded here
         "cap": (("max_tokens", 8.0), ("n", 2.0))}


class Harness:
    """A gateway and the fake runtime in an event loop of their own, for a synchronous test."""

    def __init__(self, tmp_path: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.stack = contextlib.AsyncExitStack()
        store = KeyStore(tmp_path / "keys.db")
        _, self.secret = store.create("fuzz", tpm=10**12, quotas=(Quota(10**15, "day"),))
        store.conn.close()
        fake = self.run(self.stack.enter_async_context(fake_runtime(ttft_ms=1, itl_ms=0)))
        # ("plain-model": no catalogue entry, so no rewrite; only the tests below that bound max_tokens use it)
        backends = (fake.backend_config(endpoints=tuple(PATHS), models=("fake-model", "plain-model")),
                    fake.backend_config("llama", kind="llama-server", models=("llama-model",), max_concurrency=2))
        models = (ModelConfig("fake-model", aliases=("gpt-*", "claude-*"), **RULES),  # type: ignore[arg-type]
                  ModelConfig("llama-model", **RULES))  # type: ignore[arg-type]
        self.gw: InProcessGateway = self.run(self.stack.enter_async_context(gateway(
            *backends, models=models, db=tmp_path / "keys.db",
            auth=AuthConfig(anonymous_max_priority="interactive"),
            timeouts=TimeoutConfig(first_token_s=5, between_tokens_s=5, total_s=8))))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        try:
            self.run(self.stack.aclose())
        finally:
            self.loop.close()


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Iterator[Harness]:
    h = Harness(tmp_path_factory.mktemp("fuzz"))
    yield h
    h.close()


@st.composite
def requests(draw: st.DrawFn, endpoint: str) -> tuple[bytes, dict[str, str]]:
    """A request body of ``endpoint`` (bytes: JSON nested up to orjson's limit, and past it) and its
    headers: a valid key or none, a class or none."""
    template = dict(REQUESTS[endpoint])
    if STREAMS.get(endpoint) and draw(st.booleans()):
        template["stream"] = True
    if draw(st.booleans()):
        body: Any = draw(mutated(template))
    else:
        body = {k: v for k, v in template.items() if k not in ("tools", "n_predict")}
        for name in draw(st.lists(st.sampled_from(FIELDS) | st.text(max_size=5), max_size=4)):
            body[name] = draw(json_values)
    if isinstance(body, dict) and draw(st.integers(0, 2)) != 0:
        body["model"] = draw(st.sampled_from(MODELS))
    headers = {"content-type": "application/json"}
    if draw(st.booleans()):
        headers["x-priority"] = draw(st.sampled_from(("batch", "interactive", "standard", "urgent")))
    return encode(body), headers


def check(endpoint: str, resp: Response, h: Harness) -> None:
    rec = h.gw.records[-1]
    assert rec.cause is not Cause.INTERNAL_ERROR, (rec.error, resp.body[:300])
    assert b"internal_error" not in resp.body, resp.body[:300]
    if resp.status >= 500:
        assert rec.cause in (Cause.UPSTREAM_ERROR, Cause.UPSTREAM_TIMEOUT, Cause.NO_BACKEND), rec.cause
    elif resp.status >= 400 and rec.backend == "":  # the gateway's own refusal, before any runtime
        err = resp.json()
        if endpoint in ANTHROPIC:
            assert err["type"] == "error" and isinstance(err["error"]["message"], str)
        else:
            assert isinstance(err["error"]["message"], str) and isinstance(err["error"]["code"], str)


def fuzz(endpoint: str, h: Harness, raw: bytes, headers: dict[str, str], keyed: bool) -> None:
    if keyed:
        headers = {**headers, "authorization": f"Bearer {h.secret}"}
    before = len(h.gw.records)
    resp = h.run(h.gw.request("POST", PATHS[endpoint], raw, headers=headers, timeout=30))
    assert len(h.gw.records) == before + 1
    check(endpoint, resp, h)
    # every slot and the key's concurrency came back, whatever the request was
    s = h.gw.app.scheduler
    assert not s.waiting and not any(s.running.values())
    assert all(b.in_flight == 0 for b in h.gw.app.registry.backends)


@pytest.mark.parametrize("endpoint", sorted(PATHS))
@FUZZ
@given(data=st.data())
def test_any_request_is_answered_or_refused_never_an_internal_error(harness, endpoint, data):
    raw, headers = data.draw(requests(endpoint))
    fuzz(endpoint, harness, raw, headers, keyed=data.draw(st.integers(0, 9)) < 9)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@FUZZ
@given(data=st.data())
def test_batch_streams_that_may_be_suspended_take_any_request(harness, endpoint, data):
    """A stream of the preemptible class on a replica that continues streams goes through the
    splice (resume.py): the continuation's body, every event passed through it."""
    body = {k: v for k, v in REQUESTS[endpoint].items() if k not in ("tools", "response_format", "best_of")}
    body = data.draw(mutated(dict(body, model="llama-model", stream=True), most=2))
    fuzz(endpoint, harness, encode(body), {"content-type": "application/json", "x-priority": "batch"}, keyed=True)


@pytest.mark.parametrize("endpoint", ["chat", "responses", "messages"])
def test_json_nested_to_orjsons_limit_anywhere_in_a_request(harness, endpoint):
    """1,000 levels in a content part, in a tool's schema, in an unknown field: counted and passed
    on untouched; refused with a 400 where the gateway must rewrite the body (here: the catalogue's
    rules of llama-model, and its answer asked as a stream); never a 500."""
    deep: Any = "x"
    for i in range(1000):
        deep = [deep] if i % 2 else {"type": deep}
    template = {k: v for k, v in REQUESTS[endpoint].items() if k != "stream_options"}
    for place in ("tools", "extra", "input" if endpoint == "responses" else "messages"):
        for model, stream in itertools.product(("plain-model", "llama-model"), (False, True)):
            body = dict(template, model=model, stream=stream)
            part = deep if place == "tools" else {"role": "user", "content": [deep]}
            body[place] = deep if place == "extra" else [*template[place], part]
            fuzz(endpoint, harness, encode(body), {"content-type": "application/json"}, keyed=True)
            rec = harness.gw.records[-1]
            assert rec.status == (200 if model == "plain-model" else 400), rec.error
