"""The servers under test: their URL, the model to ask for, and what they say about themselves."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from passerelle.bench.client import get_json, get_json_status


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


@dataclass(frozen=True)
class TargetSpec:
    """A target as given on the command line: ``NAME=URL[,key=ENV][,model=ID][,pid=PID]``."""

    name: str
    url: str
    key_env: str | None = None  # the environment variable holding this target's API key
    model: str | None = None
    pid: int | None = None  # the runtime's process, when it cannot be found from the port

    def api_key(self, default: str | None, env: dict[str, str] | None = None) -> str | None:
        import os

        if self.key_env is None:
            return default
        value = (os.environ if env is None else env).get(self.key_env)
        if value is None:
            raise ValueError(f"{self.name}: environment variable {self.key_env} (key=) is not set")
        return value


_SPEC_KEYS = ("key", "model", "pid")


def parse_target(text: str) -> TargetSpec:
    """``NAME=URL`` of ``bench compare --target``, optionally followed by ``,key=ENV``, ``,model=ID``
    and ``,pid=PID`` (e.g. ``vllm=http://127.0.0.1:8000,key=VLLM_KEY,model=qwen2.5-7b``)."""
    name, sep, rest = text.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise ValueError(f"{text!r}: expected NAME=URL, e.g. vulkan=http://127.0.0.1:8081")
    url, *options = rest.split(",")
    fields: dict[str, str] = {}
    for opt in options:
        key, eq, value = opt.partition("=")
        key = key.strip()
        if not eq or key not in _SPEC_KEYS or not value.strip():
            raise ValueError(f"{text!r}: after the URL expected key=ENV, model=ID or pid=PID, not {opt!r}")
        if key in fields:
            raise ValueError(f"{text!r}: {key}= given twice")
        fields[key] = value.strip()
    pid = None
    if "pid" in fields:
        if not fields["pid"].isdigit():
            raise ValueError(f"{text!r}: pid= must be a process id")
        pid = int(fields["pid"])
    return TargetSpec(name.strip(), normalize_url(url), key_env=fields.get("key"), model=fields.get("model"), pid=pid)


async def discover(session: Any, target: Target) -> Target:
    """Fill in the model list, the model (first listed when none was asked for) and versions.

    Versions come from whatever the server offers: llama-server's ``/props`` (``build_info``),
    vLLM's ``/version``, passerelle's ``/health``; the ``owned_by`` of the models is kept to tell
    the kind, not as a version. A missing endpoint is not an error; a refused key is (401/403).
    """
    headers = target.headers()
    status, listing = await get_json_status(session, f"{target.base_url}/v1/models", headers)
    if status in (401, 403):
        hint = ("the key given was refused" if target.api_key else
                "pass --api-key (bench compare: key=ENV in --target)")
        raise RuntimeError(f"GET {target.base_url}/v1/models: {status}: {hint}")
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
        if status is None:
            why = "did not answer (is the server running?)"
        elif status != 200:
            why = f"answered HTTP {status}"
        else:
            why = "listed no model; pass --model"
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
    health = await get_json(session, f"{target.base_url}/health", headers)
    if isinstance(health, dict) and health.get("server") == "passerelle" and isinstance(health.get("version"), str):
        version["passerelle"] = health["version"]
    else:
        ver = await get_json(session, f"{target.base_url}/version", headers)
        if isinstance(ver, dict) and ver.get("version"):
            version["version"] = ver["version"]
    if owners:
        version["owned_by"] = ", ".join(sorted(owners))
    return replace(target, model=model, models=tuple(models), version=version)


def server_kind(target: Target) -> str:
    """A best guess for the report: passerelle, llama-server, vllm, or unknown."""
    v = target.version
    if "passerelle" in v:
        return "passerelle"
    if "passerelle-fake" in str(v.get("build_info", "")):
        return "passerelle fake-backend"
    if "build_info" in v:
        return "llama-server"
    if v.get("owned_by") == "vllm" or "version" in v:
        return "vllm"
    return "unknown"
