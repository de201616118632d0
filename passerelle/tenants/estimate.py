"""How many prompt tokens a request will cost, estimated before the runtime has seen it.

The estimate is reserved against a key's tokens/minute and quotas, and charged to its tenant's
fair share, until the runtime's own count replaces it at the end. It reads the request's text
only: about 4 characters a token, plus a few tokens of template per chat message. An image or an
audio clip costs a fixed number of tokens whatever its size in bytes (a vision model turns any
image into a few hundred to a couple of thousand tokens; its base64 bytes say nothing about that):
``[limits] image_tokens`` and ``audio_tokens``, the same for every model until the model catalogue
gives a per-model value (see :class:`MediaCosts`).

Recognised media parts: OpenAI chat ``{"type": "image_url"}`` and ``{"type": "input_audio"}``,
Responses ``input_image`` / ``input_audio`` / ``input_file``, Anthropic ``{"type": "image"}`` and
``{"type": "document"}``, and any ``data:`` URL anywhere in the prompt.

Example::

    >>> body = {"messages": [{"role": "user", "content": [
    ...     {"type": "text", "text": "What is in this picture?"},
    ...     {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 900_000}}]}]}
    >>> estimate_prompt_tokens(body, MediaCosts(image_tokens=768, audio_tokens=1500))
    780
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from passerelle.config import LimitsConfig

CHARS_PER_TOKEN = 4
PER_MESSAGE = 4  # the chat template's tokens around each message (role markers, separators)
# Fields of a request that become prompt tokens (chat, completions, embeddings, Responses,
# Anthropic Messages, rerank, infill); the others (sampling, format) do not.
PROMPT_FIELDS = ("messages", "prompt", "input", "system", "instructions", "tools", "functions", "documents",
                 "query", "input_prefix", "input_suffix", "input_extra", "suffix", "content")
_IMAGE_TYPES = frozenset({"image_url", "input_image", "image", "image_file"})
_AUDIO_TYPES = frozenset({"input_audio", "audio"})
_FILE_TYPES = frozenset({"input_file", "file", "document"})


@dataclass(frozen=True, slots=True)
class MediaCosts:
    """Tokens charged per image and per audio part for one model.

    The gateway-wide values come from ``[limits]``; a model catalogue can hand a per-model
    ``MediaCosts`` to :func:`estimate_prompt_tokens` instead.
    """

    image_tokens: int
    audio_tokens: int

    @classmethod
    def of(cls, limits: LimitsConfig) -> MediaCosts:
        """``[limits]`` image_tokens and audio_tokens."""
        return cls(limits.image_tokens, limits.audio_tokens)


@dataclass(slots=True)
class _Count:
    chars: int = 0
    tokens: int = 0  # given as token ids, or media constants
    images: int = 0
    audio: int = 0


def _walk(root: Any, c: _Count, costs: MediaCosts) -> None:
    # An explicit stack, not recursion: a client's JSON may nest as deep as the parser allows
    # (orjson: 1,024 levels), past Python's recursion limit.
    stack = [root]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if value.startswith("data:"):
                if value.startswith("data:audio/"):
                    c.audio += 1
                    c.tokens += costs.audio_tokens
                else:  # an image, or another inline file: charged like an image
                    c.images += 1
                    c.tokens += costs.image_tokens
            else:
                c.chars += len(value)
        elif isinstance(value, dict):
            # "type" is a content part's kind only when it is a string: in a tool's JSON schema it
            # may be a list (["string", "null"]) or a property named "type" (a dict).
            kind = value.get("type")
            if isinstance(kind, str):
                if kind in _IMAGE_TYPES or kind in _FILE_TYPES:
                    c.images += 1
                    c.tokens += costs.image_tokens
                    continue
                if kind in _AUDIO_TYPES:
                    c.audio += 1
                    c.tokens += costs.audio_tokens
                    continue
            stack.extend(value.values())
        elif isinstance(value, list):
            if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                c.tokens += len(value)  # a prompt given as token ids
                continue
            stack.extend(value)


_LIMITS = MediaCosts.of(LimitsConfig())  # [limits]' defaults, for a caller without a configuration


def estimate_prompt_tokens(data: dict[str, Any], costs: MediaCosts = _LIMITS) -> int:
    """Prompt tokens of the request ``data`` (a parsed JSON body): text at 4 characters a token,
    media at their constant cost, token-id prompts as given."""
    c = _Count()
    for name in PROMPT_FIELDS:
        value = data.get(name)
        if value is not None:
            _walk(value, c, costs)
    messages = data.get("messages")
    overhead = PER_MESSAGE * len(messages) if isinstance(messages, list) else 0
    return -(-c.chars // CHARS_PER_TOKEN) + c.tokens + overhead
