"""An embeddings request run as several: a large ``input`` array split across the runtime's
slots, and inputs past the context truncated where asked.

A runtime embeds one request's inputs one after the other in one slot; an array of 1,000 inputs
then takes one slot for the whole time. Here it is cut into sub-requests of at most
``[[models]] embed_batch`` inputs, sent at once (as many at a time as the runtime has slots free
for them, at least one), and the answers put back together in the client's order: every
``index`` is its input's place in the client's array, and ``usage`` is the sum.

Truncation, where the request says ``"truncate": true`` (as llama-server's reranker and TEI take
it) or its model's entry ``truncate_input = true``: an input the runtime refuses as too long (a
400 ``context_length_exceeded``, attempt.py) is tokenized by the runtime (``POST /tokenize``,
with its special tokens), cut to the limit the runtime named, and sent again as token ids. Without
it, too long stays the client's 400.

Example::

    plan = plan_of(route.data, entry)          # None: the request goes as it is
    raw, ctype = await fetch_embeddings(ex, req, backend, deadline, plan)
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

import orjson

from passerelle.config import ModelConfig
from passerelle.errors import InputTooLong, InvalidRequest, UpstreamError, encode_request
from passerelle.proxy.attempt import fetch
from passerelle.proxy.deadline import Deadline
from passerelle.proxy.exchange import Exchange
from passerelle.proxy.upstream_request import UpstreamRequest
from passerelle.runtimes.kinds import Backend

# An input of at most this many bytes fewer than the limit cannot be longer than it in tokens (a
# token is at least a byte; a few special tokens are added): it is not tokenized to be truncated.
_SPECIALS = 4
_TOKENIZE_CAP = 64 << 20  # bytes read from /tokenize at most


@dataclass(frozen=True)
class EmbedPlan:
    inputs: list[Any]  # the client's inputs, one per embedding (a string, or token ids)
    per_request: int  # inputs per sub-request
    truncate: bool


def _is_tokens(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def check_input(data: dict[str, Any]) -> None:
    """Refuse an ``input`` no runtime embeds (llama-server answers 500 to ``[null]``, ``5``, ``[1.5]``
    or an object): a string, token ids, or an array of strings and token-id arrays. (Emptiness and
    token ids out of the vocabulary are the runtime's own 400.)"""
    raw = data.get("input")
    if isinstance(raw, str) or (isinstance(raw, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in raw)):
        return
    if isinstance(raw, list) and all(isinstance(v, str) or (isinstance(v, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in v)) for v in raw):
        return
    raise InvalidRequest("'input' must be a string, an array of token ids, or an array of strings or of token-id "
                         "arrays.", param="input")


def plan_of(data: dict[str, Any] | None, entry: ModelConfig | None) -> EmbedPlan | None:
    """How to run embeddings request ``data``: None to send it as it is (one small request, no
    truncation asked, or an input of a shape the runtime judges)."""
    if data is None or entry is None:
        return None
    raw = data.get("input")
    if isinstance(raw, str) or _is_tokens(raw):
        inputs: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(v, str) or _is_tokens(v) for v in raw):
        inputs = raw
    else:
        return None  # empty, or mixed: the runtime's own 400
    truncate = data.get("truncate") is True or entry.truncate_input
    if len(inputs) <= entry.embed_batch and not truncate:
        return None
    return EmbedPlan(inputs, entry.embed_batch, truncate)


async def fetch_embeddings(ex: Exchange, req: UpstreamRequest, backend: Backend, deadline: Deadline,
                           plan: EmbedPlan) -> tuple[bytes, bytes]:
    """Run ``plan`` on ``backend`` and return the one answer, as the client would have got it
    from one request."""
    base = orjson.loads(req.body)
    chunks = [plan.inputs[i:i + plan.per_request] for i in range(0, len(plan.inputs), plan.per_request)]
    if len(chunks) > 1:
        base.pop("id_slot", None)  # (the sub-requests run in whichever slots are free)
    # as many at once as the runtime has slots for them (this request holds one)
    width = max(1, min(len(chunks), backend.capacity - backend.in_flight + 1))
    gate = asyncio.Semaphore(width)

    async def one(chunk: list[Any]) -> dict[str, Any]:
        async with gate:
            try:
                return await _embed(ex, req, backend, deadline, base, chunk)
            except InputTooLong as err:
                if not plan.truncate:
                    raise
                cut = await _truncated(backend, chunk, err.limit)
                return await _embed(ex, req, backend, deadline, base, cut)

    tasks = [asyncio.ensure_future(one(c)) for c in chunks]
    try:
        answers = await asyncio.gather(*tasks)
    finally:  # one failed (or the client left): the others stop, their connections closed
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return _merge(answers, [len(c) for c in chunks], ex), b"application/json"


async def _embed(ex: Exchange, req: UpstreamRequest, backend: Backend, deadline: Deadline, base: dict[str, Any],
                 chunk: list[Any]) -> dict[str, Any]:
    body = encode_request({**base, "input": chunk})
    answer = await fetch(ex, dataclasses.replace(req, body=body), backend, deadline)
    raw = answer[0] if answer is not None else b""
    try:
        obj = orjson.loads(raw) if isinstance(raw, bytes) else None
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict) or not isinstance(obj.get("data"), list) or len(obj["data"]) != len(chunk):
        raise UpstreamError(f"The model runtime '{backend.name}' answered an embeddings request of {len(chunk)} "
                            "inputs with something else than as many embeddings.")
    return obj


async def _truncated(backend: Backend, chunk: list[Any], limit: int) -> list[Any]:
    """``chunk`` with every input longer than ``limit`` tokens cut to it (as token ids)."""
    out: list[Any] = []
    for item in chunk:
        if isinstance(item, list):
            out.append(item[:limit])
        elif len(item.encode("utf-8", "surrogatepass")) <= limit - _SPECIALS:
            out.append(item)
        else:
            tokens = await _tokenize(backend, item)
            out.append(tokens[:limit] if len(tokens) > limit else item)
    return out


async def _tokenize(backend: Backend, text: str) -> list[int]:
    resp = await backend.post("/tokenize", encode_request({"content": text, "add_special": True}))
    try:
        raw = await resp.read(_TOKENIZE_CAP)
    finally:
        resp.close()
    tokens = orjson.loads(raw).get("tokens") if resp.status == 200 and raw.startswith(b"{") else None
    if not isinstance(tokens, list) or not _is_tokens(tokens):
        raise UpstreamError(f"The model runtime '{backend.name}' could not tokenize an input to truncate it "
                            f"(HTTP {resp.status}).")
    return list(tokens)


def _merge(answers: list[dict[str, Any]], sizes: list[int], ex: Exchange) -> bytes:
    data: list[Any] = []
    prompt = total = 0
    offset = 0
    for obj, size in zip(answers, sizes, strict=True):
        items = sorted(obj["data"], key=lambda d: d.get("index", 0) if isinstance(d, dict) else 0)
        for i, item in enumerate(items):
            if isinstance(item, dict):
                item["index"] = offset + i
            data.append(item)
        offset += size
        found = obj.get("usage")
        usage: dict[str, Any] = found if isinstance(found, dict) else {}
        p, t = usage.get("prompt_tokens"), usage.get("total_tokens")
        prompt += p if isinstance(p, int) else 0
        total += t if isinstance(t, int) else (p if isinstance(p, int) else 0)
    rec = ex.rec
    rec.prompt_tokens, rec.completion_tokens, rec.usage_from_server = prompt, 0, True
    first = answers[0]
    return orjson.dumps({"object": first.get("object", "list"), "data": data, "model": first.get("model"),
                         "usage": {"prompt_tokens": prompt, "total_tokens": total}})
