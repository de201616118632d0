"""llama.cpp's ``llama-server``: load from ``/slots`` and ``/metrics`` (needs ``--slots --metrics``),
its size from ``/props`` (``total_slots``, the ``-np`` it was started with)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from pathlib import Path
from typing import Any

import orjson

from passerelle.errors import encode_request
from passerelle.runtimes.base import Backend, BackendStats
from passerelle.runtimes.prom import parse_samples
from passerelle.upstream.client import HTTPClientError

# (endpoint, path, a body refused before any work): llama-server checks that it can serve the
# route before it reads the body (tools/server/server-context.cpp)
PROBES = (("embeddings", "/v1/embeddings", b"{}"), ("rerank", "/v1/rerank", b"{}"),
           ("infill", "/infill", b'{"input_extra": 0}'))


log = logging.getLogger("passerelle.runtimes")

# A slot's KV saved under a name passerelle gave it (scheduling/kv_store.py): random, nothing else
SAVED_KV_NAME = re.compile(r"^[0-9a-f]{32}\.kv$")


def clean_saved_kv(directory: Path) -> int:
    """Remove every saved-KV file passerelle named in ``directory`` (at start: no gateway knows
    whose they are any more); how many. Other files are left alone."""
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for f in directory.iterdir():
            if SAVED_KV_NAME.match(f.name) and f.is_file():
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()
                    removed += 1
    if removed:
        log.info("removed %d saved session KV files left in %s", removed, directory)
    return removed


# A request whose rendered prompt names the tool when the template renders tools
PROBE_TOOL = "passerelle_probe_tool"
TOOL_PROBE = orjson.dumps({
    "messages": [{"role": "user", "content": "What is the weather?"}],
    "tools": [{"type": "function", "function": {"name": PROBE_TOOL, "description": "Probe.",
                                                 "parameters": {"type": "object", "properties": {}}}}]})
_THINKING = ("<think>", "reasoning_content", "enable_thinking", "<|channel|>")


def traits_of(props: dict[str, Any], rendered: str | None) -> dict[str, bool]:
    """The traits llama-server's ``/props`` (and the probe's rendered prompt) say."""
    out: dict[str, bool] = {}
    modalities = props.get("modalities")
    if isinstance(modalities, dict):
        for name in ("vision", "audio"):
            if isinstance(modalities.get(name), bool):
                out[name] = modalities[name]
    template = props.get("chat_template")
    if isinstance(template, str) and template:
        out["reasoning"] = any(t in template for t in _THINKING)
    caps = props.get("chat_template_caps")
    if rendered is not None:
        out["tools"] = PROBE_TOOL in rendered
    elif isinstance(caps, dict) and isinstance(caps.get("supports_tools"), bool):
        out["tools"] = caps["supports_tools"]
    return out


class LlamaServerBackend(Backend):
    kind = "llama-server"
    health_path = "/health"
    # llama-server checks for a closed connection only between streamed chunks; a non-streaming
    # request would hold its slot after the client left (see assemble.py).
    stream_always = True
    # every inference route of the pinned llama-server; a route its model or its flags cannot
    # serve (/infill without FIM tokens, /v1/embeddings without --embeddings) is answered by
    # llama-server with a 501, and is dropped once the runtime is up (unserved)
    serves = ("chat", "completions", "embeddings", "responses", "responses_input_tokens", "messages", "count_tokens",
              "rerank", "tokenize", "detokenize", "apply_template", "infill", "transcriptions")
    slot_ids = True
    continuation = "llama-server"

    def prepare(self, body: bytes, priority_rank: int, slot: int | None = None) -> bytes:
        """Name the slot passerelle chose (``id_slot``), replacing any the client gave: only
        passerelle knows which slots are free (scheduling/slots.py)."""
        if slot is None:
            return body
        if b'"id_slot"' not in body:
            i = body.index(b"{")
            return b'%s"id_slot":%d,%s' % (body[: i + 1], slot, body[i + 1 :])
        data = orjson.loads(body)
        data["id_slot"] = slot
        return encode_request(data)

    async def slot_action(self, slot: int, action: str, filename: str = "",
                          timeout: float = 10.0) -> dict[str, Any] | None:
        """``POST /slots/{slot}?action=save|restore|erase`` (``filename``: a bare name in the
        runtime's ``--slot-save-path``). Its JSON answer (``n_saved``/``n_written`` for a save,
        ``n_restored``/``n_read`` for a restore), or None: refused, no answer within ``timeout``
        (the runtime may still finish it), or no runtime."""
        body = orjson.dumps({"filename": filename}) if filename else b"{}"
        return await self._post_json(f"/slots/{slot}?action={action}", body, timeout, 1 << 16)

    async def _post_json(self, path: str, body: bytes, timeout: float, cap: int) -> dict[str, Any] | None:
        """POST ``body`` (JSON) to ``path``; the answer's JSON object (read up to ``cap`` bytes), or
        None: refused, no answer within ``timeout``, or not an object."""
        try:
            async with asyncio.timeout(timeout):
                resp = await self.client.request(b"POST", path, body, headers=b"Content-Type: application/json\r\n")
                try:
                    raw = await resp.read(cap)
                finally:
                    resp.close()
        except (TimeoutError, HTTPClientError, OSError):
            return None
        if resp.status != 200 or not raw.startswith(b"{"):
            return None
        with contextlib.suppress(orjson.JSONDecodeError):
            answer = orjson.loads(raw)
            return answer if isinstance(answer, dict) else None
        return None

    async def unserved(self) -> set[str]:
        """Audio from ``/props`` (``modalities.audio``); embeddings, rerank and infill from a
        request each that llama-server refuses before any work: with a 501 when the route cannot
        be served (started without --embeddings / --reranking, a model without FIM tokens), else
        with a 400 for the missing fields."""
        gone: set[str] = set()
        declared = self.declared_endpoints
        if "transcriptions" in declared:
            status, body = await self._get("/props")
            props = orjson.loads(body) if status == 200 else None
            modalities = props.get("modalities") if isinstance(props, dict) else None
            if isinstance(modalities, dict) and modalities.get("audio") is False:
                gone.add("transcriptions")
        for endpoint, path, probe in PROBES:
            if endpoint in declared and await self._probe(path, probe) == 501:
                gone.add(endpoint)
        return gone

    async def probe_traits(self) -> dict[str, bool]:
        """From ``/props``: ``modalities`` (vision, audio) and the chat template (reasoning: it
        knows a thinking block); tools from ``/apply-template`` rendering a request with a tool:
        a template that drops tools (SmolLM2's) renders no tool name, whatever
        ``chat_template_caps`` says; where that probe gets no answer, ``supports_tools`` decides."""
        status, body = await self._get("/props")
        props = orjson.loads(body) if status == 200 else None
        if not isinstance(props, dict):
            return {}
        return traits_of(props, await self._render(TOOL_PROBE))

    async def _render(self, body: bytes, timeout: float = 5.0) -> str | None:
        """``/apply-template``'s prompt for ``body``; None without an answer."""
        answer = await self._post_json("/apply-template", body, timeout, 1 << 20)
        prompt = answer.get("prompt") if answer is not None else None
        return prompt if isinstance(prompt, str) else None

    async def _report_capacity(self) -> tuple[int | None, str]:
        status, body = await self._get("/props")
        if status == 200:
            props = orjson.loads(body)
            total = props.get("total_slots") if isinstance(props, dict) else None
            if isinstance(total, int) and not isinstance(total, bool) and total > 0:
                return total, "/props total_slots"
        status, body = await self._get("/slots")  # an older llama-server: count the slots it lists
        if status == 200:
            slots = orjson.loads(body)
            if isinstance(slots, list) and slots:
                return len(slots), "/slots"
        return None, ""

    async def _scrape_load(self, stats: BackendStats) -> None:
        status, body = await self._get("/slots")
        if status == 200:
            slots = orjson.loads(body)
            if isinstance(slots, list):
                stats.slots_total = len(slots)
                stats.slots_busy = sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))
                n_ctx = slots[0].get("n_ctx") if slots and isinstance(slots[0], dict) else None
                if isinstance(n_ctx, int) and n_ctx > 0:
                    self.context_length = n_ctx  # per slot: what one request may use
        status, body = await self._get("/metrics")
        if status == 200:
            samples = parse_samples(body.decode("utf-8", "replace"))
            stats.extra = samples
            if "llamacpp:requests_deferred" in samples:
                stats.queue_depth = int(samples["llamacpp:requests_deferred"])
            if "llamacpp:kv_cache_usage_ratio" in samples:  # removed in newer llama.cpp
                stats.kv_cache_usage_ratio = samples["llamacpp:kv_cache_usage_ratio"]
            if stats.slots_busy is None and "llamacpp:requests_processing" in samples:
                stats.slots_busy = int(samples["llamacpp:requests_processing"])
            # the sums of every request's timings.prompt_n and prompt_ms (cached tokens not counted)
            stats.prompt_tokens_total = samples.get("llamacpp:prompt_tokens_total")
            stats.prompt_seconds_total = samples.get("llamacpp:prompt_seconds_total")
