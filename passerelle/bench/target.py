"""The servers under test: their URL, the model to ask for, and what they say about themselves."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from passerelle.bench.client import get_json


@dataclass(frozen=True)
class Target:
    name: str
    base_url: str  # scheme://host:port[/prefix], without a trailing /v1
    model: str | None = None
    api_key: str | None = None
    models: tuple[str, ...] = ()
    version: dict[str, Any] = field(default_factory=dict, hash=False)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.base_url, "model": self.model, "models": list(self.models),
                "version": self.version}


def normalize_url(url: str) -> str:
    """``http://h:8080``, ``http://h:8080/`` and ``http://h:8080/v1/`` all give ``http://h:8080``."""
    url = url.strip()
    if not re.match(r"^https?://", url):
        raise ValueError(f"{url!r} is not an http(s) URL (example: http://127.0.0.1:8080)")
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    return url


def parse_target(text: str) -> tuple[str, str]:
    """``NAME=URL`` of ``bench compare --target``."""
    name, sep, url = text.partition("=")
    if not sep or not name.strip() or not url.strip():
        raise ValueError(f"{text!r}: expected NAME=URL, e.g. vulkan=http://127.0.0.1:8081")
    return name.strip(), normalize_url(url)


async def discover(session: Any, target: Target) -> Target:
    """Fill in the model list, the model (first listed when none was asked for) and versions.

    Versions come from whatever the server offers: llama-server's ``/props`` (``build_info``),
    vLLM's ``/version``, the ``owned_by`` of the models. A missing endpoint is not an error.
    """
    headers = target.headers()
    listing = await get_json(session, f"{target.base_url}/v1/models", headers)
    models: list[str] = []
    owners: set[str] = set()
    if isinstance(listing, dict) and isinstance(listing.get("data"), list):
        for item in listing["data"]:
            if isinstance(item, dict) and isinstance(item.get("id"), str):
                models.append(item["id"])
                if isinstance(item.get("owned_by"), str):
                    owners.add(item["owned_by"])
    model = target.model or (models[0] if models else None)
    if model is None:
        why = "did not answer (is the server running?)" if listing is None else "listed no model; pass --model"
        raise RuntimeError(f"GET {target.base_url}/v1/models {why}")
    version: dict[str, Any] = {}
    props = await get_json(session, f"{target.base_url}/props", headers)
    if isinstance(props, dict):
        for key in ("build_info", "total_slots", "model_path"):
            if props.get(key) not in (None, ""):
                version[key] = props[key]
        settings = props.get("default_generation_settings")
        if isinstance(settings, dict) and isinstance(settings.get("n_ctx"), int):
            version["n_ctx"] = settings["n_ctx"]
    ver = await get_json(session, f"{target.base_url}/version", headers)
    if isinstance(ver, dict) and ver.get("version"):
        version["version"] = ver["version"]
    if owners:
        version["owned_by"] = ", ".join(sorted(owners))
    return replace(target, model=model, models=tuple(models), version=version)


def server_kind(target: Target) -> str:
    """A best guess for the report: llama-server, vllm, or unknown."""
    v = target.version
    if "passerelle-fake" in str(v.get("build_info", "")):
        return "passerelle fake-backend"
    if "build_info" in v:
        return "llama-server"
    if v.get("owned_by") == "vllm" or "version" in v:
        return "vllm"
    return "unknown"
