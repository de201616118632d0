"""What a model cannot take, refused before the runtime sees it: media, and tools.

A text model sent an image gets nothing useful from its runtime: llama-server answers 500 (no
multimodal projector), another runtime may drop the part silently. Where the catalogue declares
what a model can do (``[[models]] capabilities``, and the embedded default: a text model), a
request with an image or audio part for a model that lacks ``vision`` / ``audio`` gets a 400 in its
API's shape that names the model and the capability. A model whose capabilities nobody declared
(a ``--upstream`` server, a backend with no ``[[models]]`` entry) is not judged: its requests pass
to the runtime as they are.

Media parts, on every API, wherever they sit in the prompt (a tool result's content included):

=========  ===================================================================================
vision     chat ``image_url``; Responses ``input_image``, ``input_file``; Anthropic ``image``,
           ``document`` (a PDF: its pages are images; a ``text`` document is text); ``image_file``
audio      chat and Responses ``input_audio``
=========  ===================================================================================

A tool's JSON schema is never read for parts (a property named ``image`` is not an image).

Tools: a request with a non-empty tool list needs ``tools`` (runtimes/model_caps.py says which
models and replicas have it: the catalogue, the runtime's own chat template). The catalogue routes
it to replicas that have it; where none has, :func:`fit_request` refuses it with a 400 naming the
model and ``tools``, or (``[[models]] tools = "ignore"``) serves it without them with a warning
header: tools never vanish silently. Empty ``tools: []`` and a ``tool_choice`` with no tools are
dropped before any runtime sees them; a request that needs no change goes on byte for byte.

Example::

    check_media("gemma", ("chat",), {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}]}, body)
    # InvalidRequest: The model 'gemma' cannot take image or file input: its capabilities do not include 'vision' ...
"""

from __future__ import annotations

import logging
import re
from typing import Any

from passerelle.errors import InvalidRequest, clip, encode_request
from passerelle.runtimes.catalogue import ModelRoute

log = logging.getLogger("passerelle.proxy.capabilities")

_VISION = frozenset({"image_url", "input_image", "image", "image_file", "input_file", "document", "file"})
_AUDIO = frozenset({"input_audio"})
# The request fields that hold a prompt's content parts (never "tools", "functions", "response_format").
_FIELDS = ("messages", "input", "system", "prompt")
# A body that names none of these part types (and escapes nothing) has no media: the walk is
# skipped (the common case).
_ANY_PART = re.compile(rb'"type"\s*:\s*"(?:image_url|input_image|image|image_file|input_file|document|file'
                       rb'|input_audio)"')
_WORDS = {"vision": "image or file", "audio": "audio"}


def _text_document(part: dict[str, Any]) -> bool:
    source = part.get("source")
    return isinstance(source, dict) and source.get("type") in ("text", "content")


def media_needed(data: dict[str, Any]) -> set[str]:
    """The capabilities the parts of request ``data`` need: a subset of ``{"vision", "audio"}``."""
    needed: set[str] = set()
    stack: list[Any] = [data[f] for f in _FIELDS if f in data]
    while stack and len(needed) < 2:
        value = stack.pop()
        if isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, dict):
            kind = value.get("type")
            if isinstance(kind, str):
                if kind in _AUDIO:
                    needed.add("audio")
                    continue
                if kind in _VISION and not (kind == "document" and _text_document(value)):
                    needed.add("vision")
                    continue
            stack.extend(v for v in value.values() if isinstance(v, list | dict))
    return needed


def check_media(model: str, capabilities: tuple[str, ...], data: dict[str, Any] | None, body: bytes) -> None:
    """Raise InvalidRequest when ``data`` carries media that ``model``'s declared ``capabilities``
    lack; nothing when none are declared (unknown: the runtime decides)."""
    if not capabilities or data is None or ("vision" in capabilities and "audio" in capabilities):
        return
    if not _ANY_PART.search(body) and b"\\u" not in body:  # (an escaped "type" is read by the walk)
        return
    missing = sorted(media_needed(data) - set(capabilities))
    if missing:
        need = missing[0]
        raise InvalidRequest(
            f"The model '{clip(model)}' cannot take {_WORDS[need]} input: its capabilities do not include "
            f"'{need}' (it has: {', '.join(capabilities)}). Send text only, or choose a model with '{need}'.",
            param="messages" if "messages" in data else "input")


# -- tools -------------------------------------------------------------------------------------
# The APIs whose requests carry tools, and the fields that go with them.
_TOOL_APIS = frozenset({"chat", "responses", "messages"})
_TOOL_FIELDS = ("tools", "functions")  # (chat's legacy `functions` too)
_CHOICE_FIELDS = ("tool_choice", "function_call", "parallel_tool_calls")


def _has_tools(data: dict[str, Any]) -> bool:
    return any(isinstance(data.get(f), list) and data[f] for f in _TOOL_FIELDS)


def capabilities_needed(api: str, data: dict[str, Any] | None, body: bytes) -> frozenset[str]:
    """What serving request ``data`` on ``api`` needs of a model: ``tools`` (a non-empty tool
    list), ``vision``/``audio`` (media parts). Empty for most requests (the walk for media runs
    only on a body that names a media part)."""
    if data is None:
        return frozenset()
    needed = {"tools"} if api in _TOOL_APIS and _has_tools(data) else set()
    if _ANY_PART.search(body) or b"\\u" in body:
        needed |= media_needed(data)
    return frozenset(needed)


def lacks(model: str, capability: str) -> InvalidRequest:
    """The 400 for a request that needs ``capability`` of ``model``, which has it on no replica."""
    if capability == "tools":
        return InvalidRequest(
            f"The model '{clip(model)}' cannot use tools: its capabilities do not include 'tools' (its chat "
            "template renders no tools, or its catalogue entry says so). Send the request without tools, or "
            "choose a model with 'tools' (GET /v1/models lists each model's capabilities).", param="tools")
    return InvalidRequest(
        f"The model '{clip(model)}' cannot take {_WORDS.get(capability, capability)} input: its capabilities do not "
        f"include '{capability}'. Choose a model with '{capability}' (GET /v1/models lists them).", param="messages")


def without_tools(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without its tools and what goes with them (``[[models]] tools = "ignore"``)."""
    return {k: v for k, v in data.items() if k not in _TOOL_FIELDS and k not in _CHOICE_FIELDS}


def normalise_tools(api: str, data: dict[str, Any]) -> tuple[dict[str, Any], list[str]] | None:
    """``data`` without an empty tool list, nor a tool choice with no tools to choose from (vLLM
    answers 400 to both; Open WebUI sends ``tools: []`` and ``tool_choice: "auto"``), and what was
    dropped; None when nothing is to drop (the body then goes on byte for byte)."""
    if api not in _TOOL_APIS:
        return None
    empty = [f for f in _TOOL_FIELDS if f in data and isinstance(data[f], list) and not data[f]]
    dangling = [] if _has_tools(data) else [f for f in _CHOICE_FIELDS if f in data]
    if not empty and not dangling:
        return None
    drop = set(empty) | set(dangling)
    notes = [f"{f} [] dropped" for f in empty] + [f"{f} without tools dropped" for f in dangling]
    return {k: v for k, v in data.items() if k not in drop}, notes


def fit_request(route: ModelRoute, api: str, needs: frozenset[str]) -> list[str]:
    """Make the routed request one its model can serve, or refuse it: a capability no replica
    has is a 400 naming the model and the capability (InvalidRequest), except tools where the
    model's entry says ``tools = "ignore"``: the request is served without them, and the warning
    returned (for the ``X-Passerelle-Warning`` header and the log). Then the tool fields normalised
    (:func:`normalise_tools`). ``route.data``/``route.body`` are replaced only when changed."""
    warnings: list[str] = []
    data = route.data
    for need in route.unfit:
        entry = route.entry
        if need == "tools" and entry is not None and entry.tools == "ignore" and data is not None:
            data = without_tools(data)
            route.applied.append("tools ignored")
            warnings.append(f"tools ignored: model {route.name} cannot use tools")
            log.warning("model %s cannot use tools; its entry says tools = \"ignore\": served without them",
                        route.name)
        else:
            raise lacks(route.name, need)
    if data is None:
        return warnings
    normalised = normalise_tools(api, data)
    if normalised is not None:
        data, notes = normalised
        route.applied.extend(notes)
    if data is not route.data:
        route.data, route.body, route.rewritten = data, encode_request(data), True
    return warnings
