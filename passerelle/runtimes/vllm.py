"""vLLM (and SGLang, which shares the shape): load from ``/metrics``; priority as vLLM's field."""

from __future__ import annotations

import orjson

from passerelle.runtimes.base import Backend, BackendStats
from passerelle.runtimes.prom import parse_samples


class VllmBackend(Backend):
    kind = "vllm"
    health_path = "/health"
    prefix = "vllm:"
    serves: tuple[str, ...] = ("chat", "completions", "embeddings", "responses", "messages", "count_tokens",
                               "rerank", "tokenize", "detokenize", "transcriptions")

    async def _scrape_load(self, stats: BackendStats) -> None:
        status, body = await self._get("/metrics")
        if status != 200:
            return
        samples = parse_samples(body.decode("utf-8", "replace"))
        p = self.prefix
        stats.extra = samples
        if f"{p}num_requests_running" in samples:
            stats.slots_busy = int(samples[f"{p}num_requests_running"])
            stats.slots_total = self.capacity
        if f"{p}num_requests_waiting" in samples:
            stats.queue_depth = int(samples[f"{p}num_requests_waiting"])
        for name in (f"{p}kv_cache_usage_perc", f"{p}gpu_cache_usage_perc", f"{p}token_usage"):
            if name in samples:
                stats.kv_cache_usage_ratio = samples[name]
                break

    def prepare(self, body: bytes, priority_rank: int) -> bytes:
        """Pass the class as vLLM's ``priority`` (lower is more urgent; needs
        ``--scheduling-policy priority``, enabled per backend by ``priority = true``).

        The class decides: a ``priority`` the client put in the body is replaced, or any client
        could jump vLLM's queue past the class its key allows. Without ``priority = true`` the
        body goes through untouched (vLLM refuses a non-zero ``priority`` under its default
        first-come-first-served policy, and says so to the client).
        """
        if not self.cfg.priority:
            return body
        data = orjson.loads(body)
        if data.get("priority") == priority_rank:
            return body
        data["priority"] = priority_rank
        return orjson.dumps(data)



class SglangBackend(VllmBackend):
    kind = "sglang"
    prefix = "sglang:"
    serves = ("chat", "completions", "embeddings", "responses", "rerank")
