"""What a public model can do: each capability true, false or unknown, from the catalogue and the runtimes.

Three sources, the first that speaks wins, per capability:

1. the catalogue: ``[[models]] capabilities`` (and the embedded default's entry). A list is the
   whole truth: what it does not name the model cannot do.
2. the runtimes: what each replica said once up (``Backend.traits``: llama-server's ``/props`` and
   a tool rendered by ``/apply-template``, runtimes/llama_server.py), and the routes it serves
   (embeddings, rerank, audio transcriptions). A model has a trait when a replica has it, and
   lacks it when every replica said it lacks it.
3. nothing: unknown (an ``--upstream`` server that says nothing). An unknown capability is never
   judged: the request goes to the runtime as it is.

A replica is fit for a request that needs a capability unless it said it lacks it (or the model's
entry does): a request with tools is never sent to the replica whose template drops them.

Example::

    caps = model_capabilities(entry, backends)   # {"tools": False, "vision": None, ...}
    fit = [b for b in pool if replica_has(entry, b, "tools")]
"""

from __future__ import annotations

from passerelle.config import CAPABILITIES, ModelConfig
from passerelle.endpoints import ENDPOINTS
from passerelle.runtimes.kinds import Backend

# capability -> the endpoint that serves it, for those a route tells
_BY_ENDPOINT = {e.capability: e.name for e in ENDPOINTS if e.capability}
_CLASSIC = ("chat", "completions", "embeddings")
# what a runtime's traits may tell (the rest are told by routes)
TRAITS = ("tools", "vision", "audio", "reasoning")
# what /v1/models always says, true or false (the list), whatever is unknown
LISTED = ("tools", "vision", "reasoning", "embeddings", "rerank")


def model_capabilities(m: ModelConfig, backends: list[Backend]) -> dict[str, bool | None]:
    """Every capability of ``CAPABILITIES``: True, False, or None (unknown)."""
    if m.capabilities:
        return {c: c in m.capabilities for c in CAPABILITIES}
    out: dict[str, bool | None] = {}
    # routes: what a runtime said it does not serve is not a capability of it
    served = {e for b in backends for e in b.endpoints}
    declared = {e for b in backends for e in b.cfg.endpoints if e in b.endpoints} | (served & set(_CLASSIC))
    for cap in CAPABILITIES:
        said = [b.traits[cap] for b in backends if cap in b.traits] if cap in TRAITS else []
        if any(said):
            out[cap] = True
        elif said and len(said) == len(backends):
            out[cap] = False
        elif cap in _BY_ENDPOINT and cap not in TRAITS:
            endpoint = _BY_ENDPOINT[cap]
            out[cap] = True if endpoint in declared else (False if backends and endpoint not in served else None)
        elif cap == "audio" and "transcriptions" in declared:
            out[cap] = True
        else:
            out[cap] = None
    return out


def replica_has(m: ModelConfig, backend: Backend, capability: str) -> bool:
    """May ``backend`` serve a request of ``m`` that needs ``capability``? Yes unless the entry's
    list or the replica itself says otherwise."""
    if m.capabilities:
        return capability in m.capabilities
    return backend.traits.get(capability) is not False


def capability_list(caps: dict[str, bool | None]) -> list[str]:
    """The capabilities that are true, in ``CAPABILITIES`` order (``/v1/models``' list)."""
    return [c for c in CAPABILITIES if caps.get(c)]


def ui_meta(caps: dict[str, bool | None], context_length: int | None) -> dict[str, object]:
    """The same in the shapes front-ends read: Open WebUI's model ``info.meta.capabilities``
    (``vision``, ``function_calling``...) and a ``meta`` like llama-swap's; false where unknown
    (a front-end offers nothing it cannot be sure of)."""
    flags = {c: bool(caps.get(c)) for c in LISTED}
    return {
        "capabilities": {"vision": flags["vision"], "function_calling": flags["tools"],
                         "reasoning": flags["reasoning"], "embedding": flags["embeddings"],
                         "rerank": flags["rerank"], "audio": bool(caps.get("audio"))},
        "context_length": context_length,
        "passerelle": {c: caps.get(c) for c in CAPABILITIES},
    }
