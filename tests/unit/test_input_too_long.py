"""An input longer than the runtime takes at once (an embedding's: never split) is the client's
error: OpenAI's 400 ``invalid_request_error`` naming the length and the limit, cause
``invalid_request``, nothing held against the runtime. llama-server answers it with a 500 of its
own ("input (N tokens) is too large to process"), which the gateway used to pass on as an
``upstream_error`` and count as a failure of the runtime. The same against the real llama-server
is in tests/integration/test_embeddings_llama.py."""

from __future__ import annotations

from passerelle.errors import Cause
from passerelle.proxy.attempt import refusal
from passerelle.runtimes.breaker import BreakerState
from tests.inprocess import fake_runtime, gateway


async def test_an_input_past_the_runtimes_batch_gets_a_400_naming_its_length_and_the_limit():
    async with fake_runtime(embed_batch=16) as fake, gateway(fake.backend_config()) as gw:
        fits = await gw.post("/v1/embeddings", {"model": "fake-model", "input": "word " * 16})
        assert fits.status == 200
        for _ in range(6):  # more than the breaker's failures to open: it must stay closed
            resp = await gw.post("/v1/embeddings", {"model": "fake-model", "input": ["short", "word " * 40]})
            assert resp.status == 400, resp.body
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded"
            assert "40 tokens" in error["message"] and "16 tokens" in error["message"]
        assert [r.cause for r in gw.records] == [Cause.OK] + [Cause.INVALID_REQUEST] * 6
        b = gw.app.registry.backends[0]
        assert b.breaker.state is BreakerState.CLOSED and b.breaker.failures == 0 and b.in_flight == 0
        assert (await gw.post("/v1/embeddings", {"model": "fake-model", "input": "still served"})).status == 200


def test_llama_servers_refusals_of_a_long_input_are_read_and_other_errors_pass_on():
    past_context = (b'{"error":{"code":400,"message":"input (9001 tokens) is larger than the max context size '
                    b'(8192 tokens). skipping","type":"exceed_context_size_error"}}')
    err = refusal(400, past_context, b"application/json")
    assert (err.status, err.code, err.tokens, err.limit) == (400, "context_length_exceeded", 9001, 8192)
    other = refusal(500, b'{"error":{"code":500,"message":"out of memory","type":"server_error"}}', b"")
    assert other.status == 500 and other.cause is Cause.UPSTREAM_ERROR
