"""Every request of the recorded corpus (tests/corpus/<client>/NNN-<api>.json: what Claude Code,
Codex CLI, opencode, the openai and anthropic SDKs and the agent frameworks really send; see
docs/corpus.md) replayed in-process through the gateway to the fake runtime: in front of an
OpenAI-compatible backend, of a llama-server one, and of a llama-server one whose catalogue entry
caps the output limit. Each must

(a) be answered, never with a 5xx of the gateway's own nor an ``internal_error`` (the answer's
    error code and the access record's cause are both checked), and
(b) reach the runtime as the client sent it, changed only by the documented rewrites listed in
    :func:`expected_upstream`.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from passerelle.config import ModelConfig
from passerelle.errors import Cause
from passerelle.runtimes.llama_server import PROBES as LLAMA_PROBES
from passerelle.runtimes.llama_server import TOOL_PROBE
from tests.inprocess import fake_runtime, gateway

CORPUS = Path(__file__).resolve().parent.parent / "corpus"
FILES = sorted(CORPUS.glob("*/*.json"))
SERVED = "fake-model"  # the fake runtime's model; every recorded name is an alias of it
CAP = 64  # the "capped" variant's catalogue: cap = { max_tokens = 64 }
# (backend kind, the catalogue entry caps the output limit)
VARIANTS = {"openai": ("openai", False), "llama-server": ("llama-server", False),
            "llama-server-capped": ("llama-server", True)}
COLLECTED = ("chat", "completions", "responses", "messages")  # protocols.py: Api.collect
SCHEDULED = ("chat", "completions", "embeddings", "responses", "messages")  # take a slot (llama-server's id_slot)
CHAT_LIKE = ("chat", "completions")  # OpenAI chunk streams, whose usage the gateway asks for


def expected_upstream(recorded: dict[str, Any], api: str, kind: str, capped: bool = False) -> dict[str, Any]:
    """The body the runtime should receive for ``recorded``: the documented rewrites, and only
    those, applied in the gateway's order. Each is documented in docs/api.md, "The API,
    route by route" (the list of what is not forwarded untouched), and where it comes from:

    1. ``model`` becomes the catalogue entry's ``served_name`` (docs/models.md, "The catalogue"); with
       ``cap = { max_tokens = N }`` the API's own output limit is bounded by N, and set to N when
       the client sent none, except on routes that generate nothing (the same section).
    2. llama-server: a non-streaming request of an API that streams is asked as a stream
       (``"stream": true``, chat/completions with ``stream_options.include_usage``) and assembled
       by the gateway (docs/api.md; proxy/protocols.py ``collect``).
    3. A streamed chat/completions request gets ``stream_options.include_usage = true`` (the usage
       chunk is removed again for a client that did not ask for it).
    4. llama-server: ``id_slot`` names the slot passerelle chose, for a request that takes one
       (runtimes/llama_server.py ``prepare``).
    5. An empty tool list, and a tool choice with no tools, are dropped (docs/api.md; proxy/capabilities.py).
    """
    body = copy.deepcopy(recorded)
    body["model"] = SERVED
    if api in ("chat", "responses", "messages"):
        for f in ("tools", "functions"):
            if body.get(f) == []:
                del body[f]
        if not body.get("tools") and not body.get("functions"):
            for f in ("tool_choice", "function_call", "parallel_tool_calls"):
                body.pop(f, None)
    if capped and api not in ("embeddings", "count_tokens", "responses_input_tokens"):
        fields = ("max_output_tokens",) if api == "responses" else ("max_tokens", "max_completion_tokens")
        sent = [f for f in fields if body.get(f) is not None]
        for f in sent or fields[:1]:
            body[f] = min(body.get(f) or CAP, CAP)
    if api not in COLLECTED:
        pass
    elif not body.get("stream"):
        if kind == "llama-server":
            body["stream"] = True
            if api in CHAT_LIKE:
                body["stream_options"] = {"include_usage": True}
    elif api in CHAT_LIKE and not (body.get("stream_options") or {}).get("include_usage"):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    if kind == "llama-server" and api in SCHEDULED:
        body["id_slot"] = 0
    return body


def _load(path: Path) -> dict[str, Any]:
    return orjson.loads(path.read_bytes())


def test_the_corpus_is_there() -> None:
    """The replay tests are only as good as what was recorded: every API agents use, real clients,
    multi-turn requests carrying tool results."""
    records = [_load(p) for p in FILES]
    apis = {r["api"] for r in records}
    assert {"chat", "responses", "messages", "count_tokens", "embeddings"} <= apis
    clients = {r["client"] for r in records}
    assert {"claude-code", "codex", "opencode", "openai-python", "anthropic-python", "open-webui",
            "open-webui-jwt"} <= clients
    assert len(records) >= 40

    def carries_tool_result(r: dict[str, Any]) -> bool:
        text = orjson.dumps(r["body"])
        return any(marker in text for marker in (b'"role":"tool"', b'"function_call_output"', b'"tool_result"'))

    assert {r["api"] for r in records if carries_tool_result(r)} >= {"chat", "responses", "messages"}


def test_no_key_was_recorded() -> None:
    """The clients were given the key ``dummy-not-a-key`` (tests/corpus/record.py); neither it nor
    anything shaped like a real key is stored."""
    for path in FILES:
        record, raw = _load(path), path.read_bytes()
        assert not {"authorization", "x-api-key", "api-key"} & set(record["headers"]), path
        assert b"dummy-not-a-key" not in raw, path
        assert not re.search(rb"(?<![A-Za-z])sk-[A-Za-z0-9_-]{8,}", raw), path


PROBES = {(path, probe) for _, path, probe in LLAMA_PROBES} | {("/apply-template", TOOL_PROBE)}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.stem}" for p in FILES])
async def test_replay(path: Path, variant: str) -> None:
    kind, capped = VARIANTS[variant]
    record = _load(path)
    api, recorded = record["api"], record["body"]
    async with fake_runtime(ttft_ms=0, itl_ms=0, tokens=4) as fake:
        received: list[tuple[bytes, bytes]] = []
        dispatch = fake.runtime.dispatch

        async def capture(conn: Any, method: bytes, rpath: bytes, body: bytes, keep_alive: bool) -> None:
            # (not the gateway's own probes of which routes a llama-server serves: runtimes/llama_server.py)
            if method == b"POST" and (rpath.decode(), body) not in PROBES:
                received.append((rpath, body))
            await dispatch(conn, method, rpath, body, keep_alive)

        fake.runtime.dispatch = capture  # type: ignore[method-assign]
        backend = fake.backend_config(kind=kind, models=(SERVED,),
                                      endpoints=() if kind == "llama-server" else (
                                          "chat", "completions", "embeddings", "responses", "messages",
                                          "count_tokens"))
        catalogue = (ModelConfig(name="corpus", aliases=("*",), served_name=SERVED,
                                 cap=(("max_tokens", float(CAP)),) if capped else ()),)
        async with gateway(backend, models=catalogue) as gw:
            headers = {k: v for k, v in record["headers"].items() if k != "content-type"}
            resp = await gw.post(record["path"], recorded, headers=headers)
    # (a) answered, by the runtime's answer: never the gateway's own failure
    rec = gw.records[-1]
    assert rec.cause is not Cause.INTERNAL_ERROR, rec.error
    assert b"internal_error" not in resp.body, resp.body[:500]
    assert resp.status == 200, resp.body[:500]
    assert rec.cause is Cause.OK, (rec.cause, rec.error)
    if resp.headers.get(b"content-type", b"").startswith(b"text/event-stream"):
        assert resp.events(), resp.body[:500]
        assert not any(e.startswith(b'{"error"') or b'"type":"error"' in e for e in resp.events())
    # (b) what the runtime received: the recorded body, changed only by the documented rewrites
    assert len(received) == 1, received
    upstream_path, upstream_body = received[0]
    assert upstream_path == record["path"].split("?")[0].encode()
    assert orjson.loads(upstream_body) == expected_upstream(recorded, api, kind, capped)
