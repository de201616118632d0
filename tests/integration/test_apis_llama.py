"""The runtime's whole inference API through the gateway, in front of a real llama-server: the
official anthropic and openai SDKs on Messages and Responses, rerank on a real reranking GGUF,
tokenize/detokenize, apply-template, infill; keys, metering and the refusal of management routes."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from passerelle.runtimes.factory import CHAT_ENDPOINTS
from tests.conftest import MODEL_ID, upstream_config, wait_until
from tests.integration.test_scheduling_llama import cli

pytestmark = pytest.mark.llama

ASK = [{"role": "user", "content": "Tell me about lighthouses."}]
RERANK_ID = "tiny-reranker"


@pytest.fixture
def gw(gateway, llama_server, reranker_server):
    """Laid out as the embedded default: a chat runtime for every route but embeddings and rerank
    (which llama-server serves only when started for them), and a reranking runtime."""
    chat_routes = ", ".join(f'"{e}"' for e in CHAT_ENDPOINTS)
    config = upstream_config(llama_server.url, extra=f"endpoints = [{chat_routes}]") + f"""
    [[backends]]
    name = "ranker"
    kind = "llama-server"
    url = "{reranker_server.url}"
    models = ["{RERANK_ID}"]
    endpoints = ["rerank"]
    max_concurrency = 1
    """
    return gateway(config)


# -- Anthropic Messages ------------------------------------------------------------------------
def test_anthropic_sdk_messages_create(gw):
    msg = gw.anthropic().messages.create(model=MODEL_ID, max_tokens=6, messages=ASK,
                                         extra_body={"ignore_eos": True})
    assert msg.type == "message" and msg.role == "assistant"
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.usage.output_tokens == 6 and msg.stop_reason == "max_tokens"
    line = gw.log_for(msg._request_id)
    assert line["endpoint"] == "messages" and line["cause"] == "ok" and not line["stream"]
    assert line["completion_tokens"] == 6
    assert line["prompt_tokens"] == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


def test_anthropic_sdk_messages_stream(gw):
    with gw.anthropic().messages.stream(model=MODEL_ID, max_tokens=8, messages=ASK,
                                        extra_body={"ignore_eos": True}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        request_id = stream.response.headers["x-request-id"]
    assert text and final.content[0].text == text
    assert final.usage.output_tokens == 8 and final.stop_reason == "max_tokens"
    line = gw.log_for(request_id)
    # the relay read Anthropic's grammar: first-token time, gaps, usage from message_start/_delta
    assert line["endpoint"] == "messages" and line["stream"] and line["cause"] == "ok"
    assert line["completion_tokens"] == 8 and line["ttft_ms"] > 0 and line["tokens_per_s"] > 0


def test_anthropic_sdk_count_tokens(gw):
    counted = gw.anthropic().messages.count_tokens(model=MODEL_ID, messages=ASK)
    assert counted.input_tokens > 5
    assert gw.access_log()[-1]["endpoint"] == "count_tokens"


def test_anthropic_sdk_unknown_model_is_an_anthropic_404(gw):
    with pytest.raises(anthropic.NotFoundError) as info:
        gw.anthropic().messages.create(model="claude-9", max_tokens=4, messages=ASK)
    assert info.value.status_code == 404
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "not_found_error"
    assert MODEL_ID in info.value.body["error"]["message"]


@pytest.mark.parametrize("body", [b"{", b'{"model": "gemma-3-270m", "max_tokens": 4}'])
def test_gateway_errors_on_messages_have_anthropics_shape(gw, body):
    r = httpx.post(gw.url + "/v1/messages", content=body)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(gw.url + "/v1/messages")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_x_api_key_and_anthropic_errors_for_keys(gateway, llama_server, tmp_path):
    env = {"PASSERELLE_STATE": str(tmp_path / "state")}
    secret = cli(env, "keys", "create", "--tenant", "claude-user", "--rpm", "2").strip()
    gw = gateway(upstream_config(llama_server.url), env=env)
    assert gw.anthropic(secret).messages.create(model=MODEL_ID, max_tokens=2, messages=ASK).content
    with pytest.raises(anthropic.AuthenticationError) as info:
        gw.anthropic("psk_wrong_wrong").messages.create(model=MODEL_ID, max_tokens=2, messages=ASK)
    assert info.value.body["error"]["type"] == "authentication_error"
    gw.anthropic(secret).messages.count_tokens(model=MODEL_ID, messages=ASK)
    with pytest.raises(anthropic.RateLimitError) as info:  # rpm 2: the third request in the minute
        gw.anthropic(secret).messages.create(model=MODEL_ID, max_tokens=2, messages=ASK)
    assert info.value.body["error"]["type"] == "rate_limit_error"
    assert int(info.value.response.headers["retry-after"]) >= 1
    lines = wait_until(lambda: (got := [(x["tenant"], x["endpoint"], x["cause"]) for x in gw.access_log()])
                       and len(got) >= 4 and got, 5, what="four access log lines")
    assert lines[:4] == [("claude-user", "messages", "ok"), ("anonymous", "messages", "unauthorized"),
                         ("claude-user", "count_tokens", "ok"), ("claude-user", "messages", "rate_limited")]


# -- OpenAI Responses --------------------------------------------------------------------------
def test_openai_sdk_responses_create(gw):
    resp = gw.openai().responses.create(model=MODEL_ID, input="Tell me about lighthouses.", max_output_tokens=6,
                                        extra_body={"ignore_eos": True})
    assert resp.status == "completed" and resp.output_text
    assert resp.usage.output_tokens == 6
    line = gw.log_for(resp._request_id)
    assert line["endpoint"] == "responses" and line["cause"] == "ok" and line["completion_tokens"] == 6
    assert line["prompt_tokens"] == resp.usage.input_tokens


def test_openai_sdk_responses_stream(gw):
    stream = gw.openai().responses.create(model=MODEL_ID, input="Tell me about lighthouses.", max_output_tokens=8,
                                          stream=True, extra_body={"ignore_eos": True})
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert deltas and events[-1].response.output_text == "".join(deltas)
    line = gw.log_for(stream.response.headers["x-request-id"])
    assert line["stream"] and line["cause"] == "ok" and line["completion_tokens"] == 8
    assert line["ttft_ms"] > 0 and line["prompt_tokens"] == events[-1].response.usage.input_tokens


def test_openai_sdk_responses_with_a_bad_key_and_over_its_limit(gateway, llama_server, tmp_path):
    env = {"PASSERELLE_STATE": str(tmp_path / "state")}
    secret = cli(env, "keys", "create", "--tenant", "codex-user", "--rpm", "1").strip()
    revoked = cli(env, "keys", "create", "--tenant", "gone").strip()
    cli(env, "keys", "revoke", revoked.split("_")[1])
    gw = gateway(upstream_config(llama_server.url), env=env)

    def client(key: str) -> openai.OpenAI:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        gw.extra.setdefault("clients", []).append(c)
        return c

    for bad in ("psk_wrong_wrong", revoked):
        with pytest.raises(openai.AuthenticationError):
            client(bad).responses.create(model=MODEL_ID, input="Hi", max_output_tokens=2)
    assert client(secret).responses.create(model=MODEL_ID, input="Hi", max_output_tokens=2).output_text is not None
    with pytest.raises(openai.RateLimitError) as info:
        client(secret).responses.create(model=MODEL_ID, input="Hi", max_output_tokens=2, stream=True)
    assert info.value.body["code"] == "rate_limit_exceeded"
    causes = wait_until(lambda: (c := [x["cause"] for x in gw.access_log() if x["endpoint"] == "responses"])
                        and len(c) == 4 and c, 5, what="four responses lines")
    assert causes == ["unauthorized", "unauthorized", "ok", "rate_limited"]


# -- rerank, tokenize, templates, infill -------------------------------------------------------
def test_rerank_on_a_real_reranking_gguf(gw):
    docs = ["A lighthouse guides ships.", "Bananas are yellow.", "Keepers lived in lighthouses."]
    for path in ("/v1/rerank", "/rerank", "/v1/reranking"):
        r = httpx.post(gw.url + path, timeout=60, json={"model": RERANK_ID, "query": "lighthouse", "documents": docs,
                                                        "top_n": 2})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["results"]) == 2 and {x["index"] for x in body["results"]} <= {0, 1, 2}
        scores = [x["relevance_score"] for x in body["results"]]
        assert scores == sorted(scores, reverse=True)
        line = gw.log_for(r.headers["x-request-id"])
        assert line["endpoint"] == "rerank" and line["backend"] == "ranker" and line["prompt_tokens"] > 10


def test_a_route_no_backend_serves_for_the_model_is_a_clear_4xx(gw):
    r = httpx.post(gw.url + "/v1/rerank", json={"model": MODEL_ID, "query": "q", "documents": ["d"]})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert MODEL_ID in msg and "/v1/rerank" in msg and "/v1/chat/completions" in msg
    r = httpx.post(gw.url + "/v1/chat/completions", json={"model": RERANK_ID, "messages": ASK})
    assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"]


def test_tokenize_detokenize_and_apply_template(gw):
    r = httpx.post(gw.url + "/tokenize", json={"content": "lighthouse keeper"})  # one model serves it: no model
    tokens = r.json()["tokens"]
    assert r.status_code == 200 and tokens and all(isinstance(t, int) for t in tokens)
    r = httpx.post(gw.url + "/detokenize", json={"model": MODEL_ID, "tokens": tokens})
    assert r.json()["content"].strip() == "lighthouse keeper"
    r = httpx.post(gw.url + "/apply-template", json={"messages": ASK})
    assert "Tell me about lighthouses." in r.json()["prompt"]
    lines = gw.access_log()[-3:]
    assert [x["endpoint"] for x in lines] == ["tokenize", "detokenize", "apply_template"]
    assert all(x["cause"] == "ok" and x["model"] == MODEL_ID for x in lines)


def test_infill_stream_and_not(gw):
    body = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 4, "ignore_eos": True}
    r = httpx.post(gw.url + "/infill", json=body, timeout=60)
    assert r.status_code == 200 and isinstance(r.json()["content"], str) and r.json()["tokens_predicted"] == 4
    with httpx.stream("POST", gw.url + "/infill", json={**body, "stream": True}, timeout=60) as s:
        events = [x for x in s.iter_lines() if x.startswith("data:")]
        request_id = s.headers["x-request-id"]
    assert '"stop":true' in events[-1] and len(events) == 5
    line = gw.log_for(request_id)
    assert line["endpoint"] == "infill" and line["completion_tokens"] == 4 and line["ttft_ms"] > 0
    r = httpx.post(gw.url + "/infill", json={"input_prefix": "x"})
    assert r.status_code == 400 and "input_suffix" in r.json()["error"]["message"]


def test_management_routes_are_never_reachable(gw, llama_server):
    for method, path in [("GET", "/slots"), ("POST", "/slots/0?action=erase"), ("POST", "/props"),
                         ("GET", "/props"), ("POST", "/models/load"), ("POST", "/lora-adapters"), ("POST", "/sleep"),
                         ("POST", "/reset_prefix_cache"), ("POST", "/v1/chat/completions/control")]:
        r = httpx.request(method, gw.url + path, json={"model": MODEL_ID})
        assert r.status_code == 404, (method, path, r.status_code)
    assert not [x for x in gw.access_log() if x["backend"]]  # none of them reached a runtime


def test_metrics_count_the_new_routes(gw):
    gw.openai().responses.create(model=MODEL_ID, input="Hi", max_output_tokens=3)
    gw.anthropic().messages.create(model=MODEL_ID, max_tokens=3, messages=ASK)
    text = httpx.get(gw.url + "/metrics").text
    ttft = [x for x in text.splitlines()
            if x.startswith("passerelle_time_to_first_token_seconds_count") and f'model="{MODEL_ID}"' in x]
    assert ttft and sum(float(x.rsplit(" ", 1)[1]) for x in ttft) == 2


def test_an_operator_added_route_is_forwarded_with_the_same_life(gateway, llama_server):
    gw = gateway(upstream_config(llama_server.url)
                 + '\n[server]\nextra_routes = ["/v1/chat/completions/input_tokens"]\n')
    r = httpx.post(gw.url + "/v1/chat/completions/input_tokens", json={"model": MODEL_ID, "messages": ASK})
    assert r.status_code == 200 and r.json()["input_tokens"] > 5
    line = gw.log_for(r.headers["x-request-id"])
    assert line["endpoint"] == "/v1/chat/completions/input_tokens" and line["cause"] == "ok"
    r = httpx.post(gw.url + "/v1/chat/completions/input_tokens", json={"model": "other", "messages": ASK})
    assert r.status_code == 404
    assert httpx.post(gw.url + "/responses/input_tokens", json={"model": MODEL_ID}).status_code == 404


def test_transcriptions_route_the_form_and_cap_the_upload(gateway, llama_server):
    # (declared: a llama-server left to its kind's routes would be asked, and drop audio for Gemma)
    gw = gateway(upstream_config(llama_server.url, extra='endpoints = ["chat", "transcriptions"]')
                 + "\n[server]\nmax_upload_bytes = 65536\n")
    wav = b"RIFF" + b"\x00" * 2000
    files = {"file": ("a.wav", wav, "audio/wav")}
    r = httpx.post(gw.url + "/v1/audio/transcriptions", data={"model": MODEL_ID}, files=files, timeout=30)
    # routed by the form's model to llama-server, whose Gemma has no audio: its own answer, passed on
    assert r.status_code == 501 and "audio" in r.json()["error"]["message"]
    line = gw.log_for(r.headers["x-request-id"])
    assert line["endpoint"] == "transcriptions" and line["backend"] == "b1" and line["model"] == MODEL_ID
    r = httpx.post(gw.url + "/v1/audio/transcriptions", data={"model": "whisper-9"}, files=files, timeout=30)
    assert r.status_code == 404 and "whisper-9" in r.json()["error"]["message"]
    r = httpx.post(gw.url + "/v1/audio/transcriptions", files=files, timeout=30)
    assert r.status_code == 400 and "'model'" in r.json()["error"]["message"]
    big = {"file": ("a.wav", b"RIFF" + b"\x00" * 70000, "audio/wav")}
    r = httpx.post(gw.url + "/v1/audio/transcriptions", data={"model": MODEL_ID}, files=big, timeout=30)
    assert r.status_code == 413
