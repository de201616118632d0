"""Backends: one seam (:class:`Backend`) per outside runtime, one subclass per kind."""

from __future__ import annotations

import asyncio

import orjson

from passerelle.config import BACKEND_KINDS, BackendConfig, TimeoutConfig
from passerelle.runtimes.base import Backend, BackendStats
from passerelle.runtimes.llama_server import LlamaServerBackend
from passerelle.runtimes.ollama import OllamaBackend
from passerelle.runtimes.vllm import SglangBackend, VllmBackend
from passerelle.upstream.client import HTTPClientError, UpstreamClient

_CLASSES: dict[str, type[Backend]] = {
    "openai": Backend,
    "llama-server": LlamaServerBackend,
    "vllm": VllmBackend,
    "sglang": SglangBackend,
    "ollama": OllamaBackend,
}
# The kinds' names are the configuration's (config.BACKEND_KINDS validates them at load); each has a class here.
KINDS: dict[str, type[Backend]] = {name: _CLASSES[name] for name in BACKEND_KINDS}

__all__ = ["KINDS", "Backend", "BackendStats", "DetectionFailed", "detect_upstream", "make_backend"]


def make_backend(cfg: BackendConfig, timeouts: TimeoutConfig) -> Backend:
    return KINDS[cfg.kind](cfg, timeouts)


class DetectionFailed(Exception):
    """The server at ``--upstream`` could not say what it serves."""


_DETECT_BODY_LIMIT = 8 * 1024 * 1024


async def detect_upstream(url: str, *, timeout: float = 5.0) -> tuple[str, list[str]]:
    """Ask an existing server what it is and which models it serves: ``(kind, model ids)``.

    The kind is read from endpoints only one runtime has: llama-server's ``/props``, vLLM's
    ``/version`` with its metrics, Ollama's ``/api/version``, SGLang's ``/get_model_info``. How
    many requests it runs at once is the backend's to find out once it runs (capacity.py).
    It goes through the gateway's own HTTP client: a redirect is never followed (its answer would
    become the served model list, from wherever it points), every answer is capped and every
    question has ``timeout`` seconds. Raises DetectionFailed.
    """
    url = url.rstrip("/").removesuffix("/v1")
    client = UpstreamClient(url, limit=2, connect_timeout=timeout)

    async def get(path: str) -> tuple[int, bytes]:
        async with asyncio.timeout(timeout):
            resp = await client.request(b"GET", path)
            try:
                return resp.status, await resp.read(_DETECT_BODY_LIMIT)
            finally:
                resp.close()

    async def ok(path: str, needle: bytes = b"") -> bool:
        try:
            status, body = await get(path)
        except (TimeoutError, HTTPClientError, OSError):
            return False
        return status == 200 and needle in body

    try:
        try:
            status, body = await get("/v1/models")
        except TimeoutError:
            raise DetectionFailed(f"no answer within {timeout:g} s") from None
        except HTTPClientError as exc:
            raise DetectionFailed(str(exc)) from None
        if 300 <= status < 400:
            raise DetectionFailed(f"HTTP {status}: a redirect, which passerelle does not follow; give the URL it "
                                  "points to, if you trust it")
        if status != 200:
            raise DetectionFailed(f"HTTP {status}")
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise DetectionFailed("the answer is not JSON") from None
        listed = data.get("data", []) if isinstance(data, dict) else []
        models = [m["id"] for m in listed if isinstance(m, dict) and isinstance(m.get("id"), str)]
        if await ok("/props", b"build_info"):
            kind = "llama-server"
        elif await ok("/api/version", b"version"):
            kind = "ollama"
        elif await ok("/get_model_info", b"model_path"):
            kind = "sglang"
        elif await ok("/metrics", b"vllm:"):
            kind = "vllm"
        else:
            kind = "openai"
        return kind, models
    finally:
        client.close()
