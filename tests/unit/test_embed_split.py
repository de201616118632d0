"""Embeddings in-process with the fake runtime: a large ``input`` array is split into sub-requests
of at most ``embed_batch`` inputs, run at once and put back in the client's order (indexes, usage
summed); an input past the runtime's limit is truncated where the request or the model's entry
asks, else a 400; no input shape the client may send gets a 5xx."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from passerelle.config import ModelConfig
from passerelle.errors import Cause
from tests.inprocess import fake_runtime, gateway


def capture(fake: Any) -> list[dict[str, Any]]:
    received: list[dict[str, Any]] = []
    dispatch = fake.runtime.dispatch

    async def wrapped(conn: Any, method: bytes, path: bytes, body: bytes, keep_alive: bool) -> None:
        if path == b"/v1/embeddings":
            received.append(orjson.loads(body))
        await dispatch(conn, method, path, body, keep_alive)

    fake.runtime.dispatch = wrapped
    return received


async def test_a_large_array_is_split_and_put_back_in_order() -> None:
    inputs = [f"word{i} " * (1 + i % 5) for i in range(23)]
    async with fake_runtime() as fake:
        received = capture(fake)
        models = (ModelConfig(name="fake-model", embed_batch=5),)
        async with gateway(fake.backend_config(), models=models) as gw:
            whole = await gw.post("/v1/embeddings", {"model": "fake-model", "input": inputs})
            assert whole.status == 200, whole.body
            assert [len(r["input"]) for r in received] == [5, 5, 5, 5, 3]
            one_by_one = []
            for text in inputs:
                r = await gw.post("/v1/embeddings", {"model": "fake-model", "input": text})
                one_by_one.append(r.json())
    got = whole.json()
    assert [d["index"] for d in got["data"]] == list(range(23))
    assert [d["embedding"] for d in got["data"]] == [o["data"][0]["embedding"] for o in one_by_one]
    assert got["usage"]["prompt_tokens"] == sum(o["usage"]["prompt_tokens"] for o in one_by_one)
    assert got["usage"]["total_tokens"] == got["usage"]["prompt_tokens"]
    assert gw.records[0].prompt_tokens == got["usage"]["prompt_tokens"]


async def test_truncation_where_asked_and_a_400_where_not() -> None:
    long = "w " * 40  # 40 tokens for the fake; it takes 16 in one input
    async with fake_runtime(embed_batch=16) as fake:
        received = capture(fake)
        models = (ModelConfig(name="fake-model"), ModelConfig(name="cut", served_name="fake-model",
                                                              truncate_input=True))
        async with gateway(fake.backend_config(), models=models) as gw:
            r = await gw.post("/v1/embeddings", {"model": "fake-model", "input": ["short", long]})
            assert r.status == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            r = await gw.post("/v1/embeddings", {"model": "fake-model", "input": ["short", long], "truncate": True})
            assert r.status == 200, r.body
            assert received[-1]["input"][0] == "short" and received[-1]["input"][1] == list(range(1, 17))
            assert [d["index"] for d in r.json()["data"]] == [0, 1] and r.json()["usage"]["prompt_tokens"] == 17
            r = await gw.post("/v1/embeddings", {"model": "cut", "input": long})
            assert r.status == 200 and r.json()["usage"]["prompt_tokens"] == 16


I64 = st.integers(-(2**63), 2**63 - 1)  # what JSON from a client can carry here (orjson's range)
INPUTS = st.one_of(
    st.text(max_size=200),
    st.lists(st.text(max_size=40), max_size=40),
    st.lists(st.integers(-5, 2**31), max_size=40),
    st.lists(st.lists(st.integers(0, 1000), max_size=30), max_size=20),
    st.lists(st.one_of(st.text(max_size=10), I64, st.none(), st.lists(st.text(max_size=3))), max_size=8),
    st.none(), I64, st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
    st.just("w " * 5000), st.just(["w " * 40] * 70),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=INPUTS, truncate=st.sampled_from([None, True, False, "yes"]))
async def test_no_input_shape_gets_a_5xx(value: Any, truncate: Any) -> None:
    async with fake_runtime(embed_batch=16) as fake:
        models = (ModelConfig(name="fake-model", embed_batch=7),)
        async with gateway(fake.backend_config(), models=models) as gw:
            body: dict[str, Any] = {"model": "fake-model", "input": value}
            if truncate is not None:
                body["truncate"] = truncate
            r = await gw.post("/v1/embeddings", body)
            assert r.status < 500, r.body
            assert gw.records[-1].cause is not Cause.INTERNAL_ERROR


async def test_a_sub_request_refused_ends_the_whole_request_with_its_error() -> None:
    # the fourth input is too long for the runtime and no truncation is asked: the client's 400,
    # and no sub-request is left running
    inputs = ["a b"] * 9 + ["w " * 40] + ["c"] * 5
    async with fake_runtime(embed_batch=16) as fake:
        models = (ModelConfig(name="fake-model", embed_batch=3),)
        async with gateway(fake.backend_config(), models=models) as gw:
            r = await gw.post("/v1/embeddings", {"model": "fake-model", "input": inputs})
            assert r.status == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert gw.records[-1].cause is Cause.INVALID_REQUEST
            assert gw.app.gateway.registry.backends[0].in_flight == 0  # its slot came back
