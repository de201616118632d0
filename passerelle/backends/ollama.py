"""Ollama: health from ``/api/version``, loaded models from ``/api/ps``."""

from __future__ import annotations

from passerelle.backends.base import Backend, BackendStats


class OllamaBackend(Backend):
    kind = "ollama"
    health_path = "/api/version"

    async def _scrape_load(self, stats: BackendStats) -> None:
        async with await self._get("/api/ps") as resp:
            if resp.status == 200:
                models = (await resp.json(content_type=None)).get("models", [])
                stats.extra = {"loaded_models": float(len(models)),
                               "vram_bytes": float(sum(m.get("size_vram", 0) for m in models))}

    async def version(self) -> str:
        try:
            async with await self._get("/api/version") as resp:
                return str((await resp.json(content_type=None)).get("version", ""))
        except Exception:
            return ""
