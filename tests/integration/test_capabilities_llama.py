"""Capabilities with real llama-servers: the embedded default model (SmolLM2), whose chat template
drops tools, says ``tools`` false in /v1/models and refuses a request with tools (it used to answer
200 plain text even with ``tool_choice: "required"``), or serves it with a warning where its entry
says ``tools = "ignore"``; the same GGUF with a ChatML+tools template (tests/data/chatml_tools.jinja)
says ``tools`` true and serves it. Embeddings: an array split into sub-requests comes back in order
and equal to one-by-one embeddings; an input past the context is truncated where asked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from passerelle.runtimes import embedded

pytestmark = pytest.mark.llama

TEMPLATE = Path(__file__).resolve().parent.parent / "data" / "chatml_tools.jinja"
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
ASK = {"max_tokens": 8, "tools": [TOOL], "tool_choice": "required",
       "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
SENTENCE = "the lighthouse keeper lit the lamp at dusk. "  # 10 tokens for SmolLM2's tokenizer
CTX = 512


def backend(name: str, binary: Path, model: Path, tmp_path: Path, *, alias: str, extra: tuple[str, ...] = (),
            embeddings: bool = False, slots: int = 1) -> str:
    launch = embedded.launch_command(binary, model, alias=alias, slots=slots, ctx_per_slot=CTX, threads=1,
                                     embeddings=embeddings, extra=extra)
    return f"""
        [[backends]]
        name = "{name}"
        kind = "llama-server"
        launch = {json.dumps(list(launch))}
        models = ["{alias}"]
        log_file = "{tmp_path / (name + '.log')}"
        ready_timeout_s = 300
        """


@pytest.fixture(scope="module")
def smol() -> tuple[Path, Path]:
    return embedded.find_or_build_llama_server(), embedded.ensure_default_model()


@pytest.mark.timeout(600)
def test_tools_are_refused_ignored_or_served_as_the_template_says(gateway, smol, tmp_path):
    binary, model = smol
    gw = gateway(backend("plain", binary, model, tmp_path, alias="smol")
                 + backend("hermes", binary, model, tmp_path, alias="smol-tools",
                           extra=("--jinja", "--chat-template-file", str(TEMPLATE)))
                 + '[[models]]\nname = "smol"\n'
                 + '[[models]]\nname = "smol-lenient"\nserved_name = "smol"\ntools = "ignore"\n', timeout=300)
    listed = {m["id"]: m for m in httpx.get(gw.url + "/v1/models", timeout=10).json()["data"]}
    plain, hermes = listed["smol"], listed["smol-tools"]
    assert "tools" not in plain["capabilities"] and plain["meta"]["capabilities"]["function_calling"] is False
    assert plain["info"]["meta"]["capabilities"]["function_calling"] is False
    assert "tools" in hermes["capabilities"] and hermes["meta"]["capabilities"]["function_calling"] is True
    assert hermes["context_length"] == CTX and hermes["meta"]["context_length"] == CTX
    assert hermes["meta"]["capabilities"]["vision"] is False  # /props modalities
    one = httpx.get(gw.url + "/v1/models/smol", timeout=10).json()
    assert one["meta"]["passerelle"]["tools"] is False

    r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={"model": "smol", **ASK})
    assert r.status_code == 400, r.text
    assert "'smol' cannot use tools" in r.json()["error"]["message"]
    msg = httpx.post(gw.url + "/v1/messages", timeout=120, json={
        "model": "smol", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}]})
    assert msg.status_code == 400 and msg.json()["type"] == "error", msg.text

    r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={"model": "smol-lenient", **ASK})
    assert r.status_code == 200, r.text
    assert r.headers["x-passerelle-warning"] == "tools ignored: model smol-lenient cannot use tools"
    assert "cannot use tools" in gw.log_text()

    r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={"model": "smol-tools", **ASK})
    assert r.status_code == 200, r.text
    assert "x-passerelle-warning" not in r.headers
    # with the tools rendered, the prompt is longer than without them
    bare = httpx.post(gw.url + "/v1/chat/completions", timeout=120,
                      json={"model": "smol-tools", "max_tokens": 1, "messages": ASK["messages"]})
    assert r.json()["usage"]["prompt_tokens"] > bare.json()["usage"]["prompt_tokens"] + 50


def _close(a: list[float], b: list[float]) -> bool:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))) > 0.999


@pytest.mark.timeout(600)
def test_embedding_arrays_are_split_in_order_and_truncated_where_asked(gateway, smol, tmp_path):
    binary, model = smol
    # one slot, as the embedded default's embeddings runtime has: the pinned llama-server embeds an
    # input computed in one batch with another slot's differently (cosine 0.96-0.98 for SmolLM2 with
    # -np 4), so only one slot gives one-by-one's vectors exactly
    gw = gateway(backend("embed", binary, model, tmp_path, alias="smol-embed", embeddings=True, slots=1)
                 + '[[models]]\nname = "smol-embed"\nembed_batch = 3\n'
                 + '[[models]]\nname = "smol-cut"\nserved_name = "smol-embed"\ntruncate_input = true\n',
                 timeout=300)
    inputs = [f"{i} {SENTENCE * (1 + i % 3)}" for i in range(8)]
    whole = httpx.post(gw.url + "/v1/embeddings", timeout=300, json={"model": "smol-embed", "input": inputs})
    assert whole.status_code == 200, whole.text
    got = whole.json()
    assert [d["index"] for d in got["data"]] == list(range(8))
    singles = [httpx.post(gw.url + "/v1/embeddings", timeout=120, json={"model": "smol-embed", "input": t}).json()
               for t in inputs]
    for d, s in zip(got["data"], singles, strict=True):
        assert _close(d["embedding"], s["data"][0]["embedding"])
    assert got["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)

    long = SENTENCE * 80  # about 800 tokens: past the 512 of a slot
    r = httpx.post(gw.url + "/v1/embeddings", timeout=300, json={"model": "smol-embed", "input": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    for body in ({"model": "smol-embed", "input": ["short", long], "truncate": True},
                 {"model": "smol-cut", "input": ["short", long]}):
        r = httpx.post(gw.url + "/v1/embeddings", timeout=300, json=body)
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["index"] for d in data] == [0, 1] and r.json()["usage"]["prompt_tokens"] <= CTX + 8
