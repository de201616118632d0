"""A tool call written out as text, the way each model family writes it when a runtime does not
parse it: what a client gets in ``content`` today from a runtime without (or with the wrong) tool
parser. The scripted runtime (tool_runtime.py ``--tool-format``) answers with these, so that
``passerelle agentcheck`` can show what reaches a client with tool-call repair off and on.

The shapes follow the formats' own documentation (written here, not copied):

* ``hermes`` (Hermes 2 Pro, Qwen 2.5/3): ``<tool_call>`` around a JSON object ``{"name", "arguments"}``.
* ``qwen3-xml`` (Qwen3-Coder): ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...``,
  the values untyped text (a string as is, anything else as JSON).
* ``mistral`` (Mistral's v11+ tokenizer): ``[TOOL_CALLS]NAME[ARGS]{...}``.
* ``llama3`` (Llama 3.1+ JSON tool calling): ``<|python_tag|>{"name", "parameters"}``.
* ``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``.

    >>> render("hermes", "get_weather", '{"city": "Paris"}')
    '<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>'
    >>> render("mistral", "f", "{}")
    '[TOOL_CALLS]f[ARGS]{}'
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

PREFACE = "I will run the tool now."


def _args(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


def _hermes(name: str, arguments: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": _args(arguments)}) + "\n</tool_call>"


def _qwen3_xml(name: str, arguments: str) -> str:
    args = _args(arguments)
    params = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
                     for key, value in (args.items() if isinstance(args, dict) else ()))
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _mistral(name: str, arguments: str) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(_args(arguments), separators=(',', ':'))}"


def _llama3(name: str, arguments: str) -> str:
    return "<|python_tag|>" + json.dumps({"name": name, "parameters": _args(arguments)})


def _harmony(name: str, arguments: str) -> str:
    return (f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
            f"{json.dumps(_args(arguments))}<|call|>")


FORMATS: dict[str, Callable[[str, str], str]] = {
    "hermes": _hermes, "qwen3-xml": _qwen3_xml, "mistral": _mistral, "llama3": _llama3, "harmony": _harmony,
}


def render(fmt: str, name: str, arguments: str) -> str:
    """The call of ``name`` with ``arguments`` (JSON text) as ``fmt``'s markup."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return FORMATS[fmt](name, arguments)


def as_text(fmt: str, name: str, arguments: str) -> str:
    """What a model of that family says: a sentence, then the call (Hermes-style models often talk
    first; the others start with the call)."""
    call = render(fmt, name, arguments)
    return f"{PREFACE}\n{call}" if fmt in ("hermes", "qwen3-xml") else call
