"""What a content chunk is: the event of a stream that carries generated tokens, per API.

One definition for both sides of a measurement: the gateway's relay (first-token time, the gaps
between tokens, the fallback token count: proxy/relay.py and proxy/grammars.py) and the benchmark
clients that time the gateway from outside (passerelle/bench/client.py, the bench/ scripts). If
they disagreed, "TTFT" would mean one event to the gateway and another to its benchmark.

* OpenAI chat completions and completions (``chat``, ``completions``): a non-empty string in a
  field that carries generated text (``content`` in a chat delta, ``text`` in a completion,
  ``reasoning_content`` or ``reasoning`` for a reasoning model's thinking: vLLM >= 0.16 names it
  ``reasoning``), or the start of a tool call (``"tool_calls": [{``). The role chunk's
  ``"content":""`` and a ``null`` content are not tokens.
* OpenAI Responses (``responses``): every ``response.*.delta`` event (output text, reasoning text
  and summaries, refusals, function-call arguments).
* Anthropic Messages (``messages``): a ``content_block_delta`` whose delta is a ``text_delta``,
  ``thinking_delta`` or ``input_json_delta`` (a ``signature_delta`` carries no tokens).
* llama-server's native chunks (``llama``: ``/completion``, ``/infill``): a non-empty ``content``.
* Transcriptions (``transcription``): ``transcript.text.delta``.

An event is matched in place, as bytes, never decoded: JSON escapes the quotes inside a string,
so generated text cannot fake a pattern. A typed event matches on its ``event:`` line or on the
``"type"`` of its data. This module imports nothing of passerelle (the base layer): the benchmark
may use it without depending on the gateway.

Example::

    >>> is_content("chat", b'data: {"choices":[{"delta":{"content":"Hi"}}]}')
    True
    >>> is_content("chat", b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}')
    False
    >>> count_events(PATTERNS["messages"], b'event: content_block_delta\\ndata: {"type":"content_block_delta",'
    ...              b'"delta":{"type":"text_delta","text":"a"}}\\n\\nevent: message_stop\\ndata: {}\\n\\n')
    1
"""

from __future__ import annotations

import re


def _typed(types: str) -> re.Pattern[bytes]:
    """An event whose ``event:`` line or data ``"type"`` is one of ``types`` (a regex of names)."""
    t = types.encode()
    return re.compile(rb"^event:[ \t]*(?:" + t + rb")[ \t]*\r?$|\"type\"\s*:\s*\"(?:" + t + rb')"', re.M)


#: The chat delta fields that carry a reasoning model's thinking (``reasoning``: vLLM >= 0.16).
REASONING_FIELDS = ("reasoning_content", "reasoning")

CHAT = re.compile(rb'"(?:content|text|reasoning_content|reasoning)"\s*:\s*"[^"]|"tool_calls"\s*:\s*\[\s*\{')
RESPONSES = _typed(r"response\.[a-z_.]+\.delta")
MESSAGES = re.compile(rb'"type"\s*:\s*"(?:text_delta|thinking_delta|input_json_delta)"')
LLAMA = re.compile(rb'"content"\s*:\s*"[^"]')
TRANSCRIPTION = _typed(r"transcript\.text\.delta")

#: Per API (by the name its grammar and the benchmark use): what marks a content event.
PATTERNS: dict[str, re.Pattern[bytes]] = {
    "chat": CHAT, "completions": CHAT, "responses": RESPONSES, "messages": MESSAGES, "llama": LLAMA,
    "transcription": TRANSCRIPTION,
}


def is_content(api: str, event: bytes) -> bool:
    """Does this one SSE event (its lines, without the blank line that ends it) carry tokens?"""
    return PATTERNS[api].search(event) is not None


def count_events(pattern: re.Pattern[bytes], data: bytes, sep: bytes = b"\n\n") -> int:
    """How many of the complete events in ``data`` (each ended by ``sep``) are content events:
    an event counts once however many text fields it has (a trailing incomplete event not at all)."""
    n = start = 0
    search, find, step = pattern.search, data.find, len(sep)
    while (end := find(sep, start)) >= 0:
        if search(data, start, end) is not None:
            n += 1
        start = end + step
    return n
