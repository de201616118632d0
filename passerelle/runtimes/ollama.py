"""Ollama: health from ``/api/version``, loaded models from ``/api/ps``."""

from __future__ import annotations

import orjson

from passerelle.runtimes.base import Backend, BackendStats


class OllamaBackend(Backend):
    kind = "ollama"
    health_path = "/api/version"
    serves = ("chat", "completions", "embeddings", "responses", "messages")  # Ollama >= 0.14

    async def _scrape_load(self, stats: BackendStats) -> None:
        status, body = await self._get("/api/ps")
        if status == 200:
            models = orjson.loads(body).get("models", [])
            stats.extra = {"loaded_models": float(len(models)),
                           "vram_bytes": float(sum(m.get("size_vram", 0) for m in models))}

