"""Every reader of client (and runtime) JSON is total: property tests with Hypothesis.

Arbitrary JSON in every position (tests/jsonvalues.py) goes through the pure readers the gateway
runs on each request: the request's parse (protocols.py), the intake (class, affinity, output
estimate, the usage option spliced in), the prompt-token estimate, the model catalogue's rewrites,
the splice of a suspended stream; and, from the runtime's side, usage extraction, the streams'
grammars and the assembly of non-streamed answers. Each gives an answer of the right type, or a
client error (a ``GatewayError`` with a 4xx status) for the client's JSON, or an ``UpstreamError``
for the runtime's; never another exception (which the gateway turns into ``internal_error``).

The run is bounded and reproducible (derandomized); ``FUZZ_EXAMPLES=2000 FUZZ_RANDOM=1`` explores further.
"""

from __future__ import annotations

import os
import textwrap
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from passerelle.config import AuthConfig, RoutingConfig, load_config
from passerelle.errors import GatewayError, UpstreamError
from passerelle.observe.metrics import Metrics
from passerelle.proxy import grammars
from passerelle.proxy.assemble import assemble
from passerelle.proxy.assemble_events import assemble_events
from passerelle.proxy.intake import affinity_key, output_estimate, priority_class, with_usage_requested
from passerelle.proxy.protocols import API, Parsed
from passerelle.proxy.resume import Splice, suspendable
from passerelle.proxy.sse_scan import parse_usage
from passerelle.runtimes.catalogue import Catalogue
from passerelle.runtimes.kinds import make_backend
from passerelle.runtimes.registry import Registry
from passerelle.tenants.estimate import estimate_prompt_tokens
from tests.jsonvalues import REQUESTS, STREAMS, STREAMS_OUT, decoded, encode, json_values, mutated, sse

FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "100")), deadline=None,
                derandomize=not os.environ.get("FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
MAX_COUNT = 2**53  # what a token count may be: an exact float, and a SQLite integer


def client_error(err: GatewayError) -> bool:
    return 400 <= err.status < 500


# -- client requests -------------------------------------------------------------------------------
BASE = {name: {k: v for k, v in body.items() if k in ("model", "messages", "prompt", "input", "query",
                                                         "documents", "tokens", "content", "input_prefix",
                                                         "input_suffix", "max_tokens")}
        for name, body in REQUESTS.items()}
FIELDS = ("model", "messages", "prompt", "input", "stream", "stream_options", "max_tokens", "max_completion_tokens",
          "max_output_tokens", "n_predict", "n", "best_of", "user", "tools", "functions", "tool_choice",
          "response_format", "system", "instructions", "documents", "texts", "query", "tokens", "content",
          "input_prefix", "input_suffix", "input_extra", "suffix", "temperature", "logprobs", "id_slot",
          "priority", "timings_per_token", "continue_final_message", "metadata", "prompt_cache_key")


@st.composite
def request_body(draw: st.DrawFn, endpoint: str) -> Any:
    """An agent-shaped request of the API (tools, schemas, content parts, tool results) with
    arbitrary JSON at a few of its places, or its minimal body with arbitrary JSON in some of its
    fields (known or not)."""
    template = dict(REQUESTS[endpoint])
    if STREAMS.get(endpoint) and draw(st.booleans()):
        template["stream"] = True
    if draw(st.booleans()):
        return draw(mutated(template))
    body = dict(BASE[endpoint], model="fake-model")
    for name in draw(st.lists(st.sampled_from(FIELDS) | st.text(max_size=5), max_size=4)):
        body[name] = draw(json_values)
    return body


def parse(endpoint: str, body: Any) -> Parsed | None:
    """The request as the gateway parses it: None when refused as the client's error."""
    try:
        return API[endpoint].parse(encode(body), "application/json")
    except GatewayError as err:
        assert client_error(err), err
        return None


@pytest.mark.parametrize("endpoint", sorted(BASE))
@FUZZ
@given(data=st.data())
def test_intake_reads_any_request(endpoint, data):
    body = data.draw(request_body(endpoint))
    req = parse(endpoint, body)
    if req is None:
        return
    assert req.model is None or isinstance(req.model, str)
    assert isinstance(req.stream, bool) and (req.user is None or isinstance(req.user, str))
    raw = encode(body)
    assert req.data is not None
    assert isinstance(estimate_prompt_tokens(req.data), int)
    assert isinstance(output_estimate(req.data, req.max_tokens if isinstance(req.max_tokens, int) else None), int)
    scope = {"headers": [], "path": "/"}
    for prefix in (True, False):
        try:
            key = affinity_key(RoutingConfig(prefix_affinity=prefix), scope, req.data, endpoint)
        except GatewayError as err:
            assert client_error(err)
        else:
            assert isinstance(key, str)
    if req.stream:
        try:
            out = with_usage_requested(raw, req.data)
        except GatewayError as err:
            assert client_error(err)
        else:
            assert orjson.loads(out)["stream_options"]["include_usage"] is True


DEEP = b'{"content":' * 300 + b'"x"' + b"}" * 300  # past orjson's 254 written levels, within its 1,024 read


@pytest.mark.parametrize("endpoint", ["chat", "messages", "responses"])
def test_a_request_too_deep_to_rewrite_is_the_clients_error(catalogue, endpoint):
    """Found by Hypothesis: orjson reads 1,024 levels and writes 254, so every rewrite of a deep
    request (the usage option, a catalogue rule, the affinity key) raised TypeError: a 500."""
    from passerelle.errors import InvalidRequest

    body = encode({**REQUESTS[endpoint], "model": "m", "stream": True, "stream_options": {}})
    raw = body[:-1] + b',"extra":' + DEEP + b"}"
    req = API[endpoint].parse(raw, "application/json")
    assert req.data is not None and estimate_prompt_tokens(req.data) > 0
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        with_usage_requested(raw, req.data)
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        catalogue.resolve("m", endpoint, req.data, raw)
    req.data["messages" if endpoint != "responses" else "input"] = [{"role": "user", "content": req.data["extra"]}]
    with pytest.raises(InvalidRequest, match="nested too deeply"):
        affinity_key(RoutingConfig(prefix_affinity=True), {"headers": []}, req.data, endpoint)


def test_priority_class_reads_only_its_header():
    from passerelle.config import ClassConfig

    classes = {c.name: c for c in (ClassConfig("interactive", 0), ClassConfig("standard", 1), ClassConfig("batch", 2))}
    scope = {"headers": [(b"x-priority", b"  BATCH ")]}
    assert priority_class(classes, AuthConfig(), scope, None).name == "batch"


@FUZZ
@given(data=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6))
def test_estimator_counts_any_json(data):
    try:
        data = decoded(data)
    except orjson.JSONDecodeError:  # (nested past orjson's parser: never reaches the estimator)
        return
    n = estimate_prompt_tokens(data)
    assert isinstance(n, int) and n >= 0


CATALOGUE = """
[[backends]]
name = "b"
url = "http://127.0.0.1:9"
models = ["m-served"]
endpoints = ["chat", "completions", "embeddings", "responses", "messages", "rerank"]

[[models]]
name = "m"
aliases = ["gpt-*", "claude-*"]
served_name = "m-served"
defaults = { temperature = 0.7, stream_options = { include_usage = true } }
set = { top_k = 20 }
cap = { max_tokens = 512, temperature = 1.5, n = 2 }
strip = ["logit_bias", "id_slot"]
"""


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory) -> Catalogue:
    path = tmp_path_factory.mktemp("cat") / "c.toml"
    path.write_text(textwrap.dedent(CATALOGUE))
    cfg = load_config(path, env={})
    return Catalogue(cfg.models, Registry([make_backend(b, cfg.timeouts) for b in cfg.backends], Metrics()))


@pytest.mark.parametrize("endpoint", ["chat", "completions", "embeddings", "responses", "messages", "rerank"])
@FUZZ
@given(data=st.data())
def test_catalogue_rewrites_any_request(catalogue, endpoint, data):
    body = data.draw(request_body(endpoint))
    if isinstance(body, dict):
        body["model"] = data.draw(st.sampled_from(("m", "gpt-4o", "claude-3", "m-served")))
    req = parse(endpoint, body)
    if req is None:
        return
    assert req.data is not None and req.model is not None
    try:
        route = catalogue.resolve(req.model, endpoint, req.data, encode(body))
    except GatewayError as err:
        assert client_error(err), err
        return
    assert route.data is not None and orjson.loads(route.body) == route.data
    assert route.data["model"] == "m-served" and "logit_bias" not in route.data
    if endpoint not in ("embeddings", "rerank"):
        # the cap bounds whichever output limit the client used, else sets the API's own (catalogue.py)
        fields = ("max_output_tokens",) if endpoint == "responses" else ("max_tokens", "max_completion_tokens")
        limits = [route.data[k] for k in fields if route.data.get(k) is not None]
        assert limits and all(isinstance(v, int | float) and v <= 512 for v in limits), limits


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@FUZZ
@given(data=st.data())
def test_a_suspended_stream_continues_any_request(endpoint, data):
    body = data.draw(request_body(endpoint))
    req = parse(endpoint, body)
    if req is None or req.data is None or not suspendable(req.data, endpoint):
        return
    splice = Splice(req.data, endpoint)
    splice.text.append(data.draw(st.text(max_size=8)))
    for dialect in ("llama-server", "vllm"):
        try:
            out = splice.request_data(dialect)
        except GatewayError as err:
            assert client_error(err)
            continue
        assert isinstance(out, dict)


# -- runtime answers -------------------------------------------------------------------------------
@example(obj={"usage": {"prompt_tokens": -3, "completion_tokens": 2**64 - 1}})  # a negative counter is a ValueError
@example(obj={"usage": {"input_tokens": 2**53, "cache_read_input_tokens": 2**53, "output_tokens": True}})
@example(obj={"tokens_evaluated": -1, "tokens_predicted": 18446744073709551615})  # SQLite: OverflowError
@FUZZ
@given(obj=mutated({"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "input_tokens": 3,
                              "output_tokens": 2, "cache_read_input_tokens": 1}, "tokens_evaluated": 3,
                    "tokens_predicted": 2, "response": {"usage": {"input_tokens": 3}}}))
def test_usage_is_a_count_or_none(obj):
    try:
        obj = decoded(obj)
    except orjson.JSONDecodeError:
        return
    for p, c in (grammars.usage_of(obj), parse_usage(obj)):
        for v in (p, c):
            assert v is None or (isinstance(v, int) and 0 <= v <= MAX_COUNT)


def stream_of(api: str) -> st.SearchStrategy[bytes]:
    """A runtime's stream of the API, with arbitrary JSON at a few places (or whole events)."""
    return mutated(STREAMS_OUT[api], most=4).map(sse)


streams = st.one_of(*(stream_of(api) for api in STREAMS_OUT))


@FUZZ
@given(sse=streams)
def test_grammars_scan_any_stream(sse):
    from passerelle.proxy.sse_scan import SSEScanner

    events = SSEScanner().feed(sse)
    for name in ("generic", "responses", "messages", "llama", "transcription"):
        g = grammars.make(name)
        assert g is not None
        for ev in events:
            assert isinstance(g.scan(ev), int)
        for v in (g.prompt_tokens, g.completion_tokens):
            assert v is None or (isinstance(v, int) and 0 <= v <= MAX_COUNT)


# Found by Hypothesis (each an exception, so a 500 internal_error, before the fix):
@example(sse=b'data: {"usage":' + DEEP + b"}\n\n")  # the answer nested past what orjson writes
@example(sse=b'data: {"choices":5}\n\ndata: {"choices":[{"delta":[1]}]}\n\n')  # delta not an object
@example(sse=b'data: {"choices":[{"delta":{"tool_calls":[{"function":"f"}]}}]}\n\n')  # function a string
@example(sse=b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"name":{"a":1}}}]}}]}\n\n')
@example(sse=b'data: {"choices":[{"delta":{"tool_calls":7}}]}\n\ndata: {"choices":[{"text":"a","logprobs":[1]}]}\n\n')
@example(sse=b'data: {"type":"message_start","message":{"usage":[1]}}\n\n'  # Messages: wrong types everywhere
         b'data: {"type":"content_block_start","index":[0],"content_block":{"type":"text"}}\n\n'
         b'data: {"type":"content_block_start","index":"a","content_block":{"type":"text","text":5}}\n\n'
         b'data: {"type":"content_block_start","index":1,"content_block":{"type":"text","text":5}}\n\n'
         b'data: {"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":[]}}\n\n'
         b'data: {"type":"content_block_delta","index":2,"delta":true}\n\n'
         b'data: {"type":"content_block_delta","index":3,"delta":{"type":"input_json_delta","partial_json":1}}\n\n'
         b'data: {"type":"message_delta","delta":[1],"usage":{"output_tokens":1}}\n\n')
@FUZZ
@given(sse=streams)
def test_assembly_of_any_stream_is_an_answer_or_an_upstream_error(sse):
    for endpoint in ("chat", "completions"):
        try:
            body = assemble(sse, endpoint)
        except UpstreamError:
            continue
        assert isinstance(orjson.loads(body), dict)
    for grammar in ("responses", "messages", "llama"):
        try:
            body = assemble_events(sse, grammar)
        except UpstreamError:
            continue
        assert isinstance(orjson.loads(body), dict)


@example(sse=b'data: {"id":"a"}\n\ndata: {"id":"b","deep":' + DEEP + b"}\n\n")  # changed, and too deep to write
@FUZZ
@given(sse=streams)
def test_the_splice_passes_any_event(sse):
    from passerelle.proxy.sse_scan import SSEScanner

    for endpoint in ("chat", "completions"):
        splice = Splice(dict(BASE[endpoint]), endpoint)
        splice._dialect = "llama-server"
        for ev in SSEScanner().feed(sse):
            out = splice._event(ev)
            assert out is None or isinstance(out, bytes)
        splice.suspensions = 1
        _, c = splice.totals(None, None)
        assert c is None or isinstance(c, int)
