"""llama.cpp's ``llama-server``: load from ``/slots`` and ``/metrics`` (needs ``--slots --metrics``)."""

from __future__ import annotations

import orjson

from passerelle.runtimes.base import Backend, BackendStats
from passerelle.runtimes.prom import parse_samples


class LlamaServerBackend(Backend):
    kind = "llama-server"
    health_path = "/health"
    # llama-server checks for a closed connection only between streamed chunks; a non-streaming
    # request would hold its slot after the client left (see assemble.py).
    stream_always = True
    # every inference route of the pinned llama-server (a route its model cannot serve, e.g.
    # /infill without FIM tokens, is answered by llama-server itself with a 501)
    serves = ("chat", "completions", "embeddings", "responses", "responses_input_tokens", "messages", "count_tokens",
              "rerank", "tokenize", "detokenize", "apply_template", "infill", "transcriptions")

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

