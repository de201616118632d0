"""Tool calls a model wrote as text, read back as calls, incrementally.

Runtimes leave calls in the text when their own parser misses a format or a variant (vLLM's
``qwen3_coder``, Ollama's bare ``<function=...>``, calls inside ``<think>``, Harmony's variants).
This package reads the formats models use (Hermes, Qwen3-Coder's XML, Mistral, Llama 3's JSON,
gpt-oss's Harmony; ``auto`` finds which), checks each call against the request's tool schemas,
and hands back pieces (pieces.py): ``Text`` to pass on, ``ToolCall`` to deliver as the API's own
tool call, ``Unrepaired`` markup it could not repair, exactly as it came, and ``Reasoning`` (only
from Harmony's ``analysis`` channel, when a runtime left it in the text). It is pure code: no
I/O, no clock, nothing of the gateway. Where the caller feeds reasoning text (``<think>``), the
calls written there are found too.

Not read: Harmony with its special tokens dropped (``analysiscommentary to=functions.x json{...}``)
and Mistral's ``NAME[ARGS]{...}`` without ``[TOOL_CALLS]``: without their tokens they cannot be
told from prose.

Example::

    >>> tools = [{"name": "get_weather", "parameters": {"type": "object",
    ...     "properties": {"days": {"type": "integer"}}, "required": ["days"]}}]
    >>> parse_all("qwen3-xml", tools,
    ...     "Sure.<tool_call><function=get_weather><parameter=days>\\n3\\n</parameter></function></tool_call>")
    [Text(text='Sure.'), ToolCall(index=0, name='get_weather', arguments='{"days": 3}')]
"""

from passerelle.proxy.toolcalls.parser import FORMATS, MAX_HELD, ToolCallParser, parse_all, parser_for
from passerelle.proxy.toolcalls.pieces import Piece, Reasoning, Text, ToolCall, Unrepaired, coalesce, plain_text
from passerelle.proxy.toolcalls.schema import tool_schemas

__all__ = ["FORMATS", "MAX_HELD", "Piece", "Reasoning", "Text", "ToolCall", "ToolCallParser", "Unrepaired",
           "coalesce", "parse_all", "parser_for", "plain_text", "tool_schemas"]
