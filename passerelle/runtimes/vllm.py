"""vLLM and SGLang: load from ``/metrics``; priority as vLLM's field; their size where they show it.

vLLM shows its configuration (``max_num_seqs``) only in development mode (``/server_info``, with
``VLLM_SERVER_DEV_MODE=1``); otherwise its capacity is learned from ``num_requests_waiting``,
which also follows a vLLM that runs fewer sequences than configured because its KV cache is full.
SGLang says ``max_running_requests`` in ``/get_server_info``.
"""

from __future__ import annotations

from typing import Any

import orjson

from passerelle.errors import encode_request
from passerelle.runtimes.base import Backend, BackendStats
from passerelle.runtimes.prom import parse_samples


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class VllmBackend(Backend):
    kind = "vllm"
    health_path = "/health"
    prefix = "vllm:"
    serves: tuple[str, ...] = ("chat", "completions", "embeddings", "responses", "messages", "count_tokens",
                               "rerank", "tokenize", "detokenize", "transcriptions")
    continuation = "vllm"
    running_gauge = "num_requests_running"
    waiting_gauge = "num_requests_waiting"

    async def _report_capacity(self) -> tuple[int | None, str]:
        status, body = await self._get("/server_info?config_format=json")
        if status != 200:
            return None, ""
        config = orjson.loads(body).get("vllm_config")
        if not isinstance(config, dict):
            return None, ""
        seqs = _positive((config.get("scheduler_config") or {}).get("max_num_seqs"))
        ranks = _positive((config.get("parallel_config") or {}).get("data_parallel_size")) or 1
        return (seqs * ranks, "/server_info max_num_seqs") if seqs else (None, "")

    async def _scrape_load(self, stats: BackendStats) -> None:
        status, body = await self._get("/metrics")
        if status != 200:
            return
        samples = parse_samples(body.decode("utf-8", "replace"))
        p = self.prefix
        stats.extra = samples
        if f"{p}{self.running_gauge}" in samples:
            stats.slots_busy = int(samples[f"{p}{self.running_gauge}"])
            stats.slots_total = self.capacity
        if f"{p}{self.waiting_gauge}" in samples:
            stats.queue_depth = int(samples[f"{p}{self.waiting_gauge}"])
        for name in (f"{p}kv_cache_usage_perc", f"{p}gpu_cache_usage_perc", f"{p}token_usage"):
            if name in samples:
                stats.kv_cache_usage_ratio = samples[name]
                break

    def prepare(self, body: bytes, priority_rank: int, slot: int | None = None) -> bytes:
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
        return encode_request(data)


class SglangBackend(VllmBackend):
    kind = "sglang"
    prefix = "sglang:"
    serves = ("chat", "completions", "embeddings", "responses", "rerank")
    continuation = ""  # not checked against a real SGLang: its streams are not suspended
    running_gauge = "num_running_reqs"
    waiting_gauge = "num_queue_reqs"

    async def _report_capacity(self) -> tuple[int | None, str]:
        status, body = await self._get("/get_server_info")
        if status != 200:
            return None, ""
        info = orjson.loads(body)
        if not isinstance(info, dict):
            return None, ""
        # the effective value (computed from memory when not given) is in internal_states
        states = info.get("internal_states")
        for state in states if isinstance(states, list) else []:
            if isinstance(state, dict) and (n := _positive(state.get("max_running_requests"))):
                return n, "/get_server_info internal_states max_running_requests"
        n = _positive(info.get("max_running_requests"))
        return (n, "/get_server_info max_running_requests") if n else (None, "")
