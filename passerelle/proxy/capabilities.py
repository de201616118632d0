"""Media a model cannot take, refused before the runtime sees them.

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

Example::

    check_media("gemma", ("chat",), {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}]}]}, body)
    # InvalidRequest: The model 'gemma' cannot take image or file input: its capabilities do not include 'vision' ...
"""

from __future__ import annotations

import re
from typing import Any

from passerelle.errors import InvalidRequest, clip

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
