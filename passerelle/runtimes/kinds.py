"""Backends: one seam (:class:`Backend`) per outside runtime, one subclass per kind."""

from __future__ import annotations

from passerelle.config import BACKEND_KINDS, BackendConfig, TimeoutConfig
from passerelle.runtimes.base import Backend, BackendStats
from passerelle.runtimes.llama_server import LlamaServerBackend
from passerelle.runtimes.ollama import OllamaBackend
from passerelle.runtimes.vllm import SglangBackend, VllmBackend

_CLASSES: dict[str, type[Backend]] = {
    "openai": Backend,
    "llama-server": LlamaServerBackend,
    "vllm": VllmBackend,
    "sglang": SglangBackend,
    "ollama": OllamaBackend,
}
# The kinds' names are the configuration's (config.BACKEND_KINDS validates them at load); each has a class here.
KINDS: dict[str, type[Backend]] = {name: _CLASSES[name] for name in BACKEND_KINDS}

__all__ = ["KINDS", "Backend", "BackendStats", "detect_upstream", "make_backend"]


def make_backend(cfg: BackendConfig, timeouts: TimeoutConfig) -> Backend:
    return KINDS[cfg.kind](cfg, timeouts)


async def detect_upstream(url: str, *, timeout: float = 5.0) -> tuple[str, list[str]]:
    """Ask an existing server what it is and which models it serves: ``(kind, model ids)``.

    The kind is read from endpoints only one runtime has: llama-server's ``/props``, vLLM's
    ``/version`` with its metrics, Ollama's ``/api/version``, SGLang's ``/get_model_info``. How
    many requests it runs at once is the backend's to find out once it runs (capacity.py).
    """
    import aiohttp  # only here, at start-up: the gateway's own requests go through upstream.py

    url = url.rstrip("/").removesuffix("/v1")
    to = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=to) as session:

        async def ok(path: str, needle: str = "") -> bool:
            try:
                async with session.get(url + path) as resp:
                    text = await resp.text()
                    return resp.status == 200 and needle in text
            except (TimeoutError, aiohttp.ClientError, UnicodeDecodeError):
                return False

        async with session.get(url + "/v1/models") as resp:
            resp.raise_for_status()
            data = await resp.json(content_type=None)
        models = [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
        if await ok("/props", "build_info"):
            kind = "llama-server"
        elif await ok("/api/version", "version"):
            kind = "ollama"
        elif await ok("/get_model_info", "model_path"):
            kind = "sglang"
        elif await ok("/metrics", "vllm:"):
            kind = "vllm"
        else:
            kind = "openai"
        return kind, models
