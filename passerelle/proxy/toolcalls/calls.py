"""From a call's markup to pieces: a ``ToolCall`` when the name is a known tool and the arguments
can be made valid, else ``Unrepaired`` with the markup exactly as it came.

The formats differ in how a call is written, not in what it says; every reader ends here with
the call's markup and what it read from it (a name and arguments: a JSON object, a JSON text,
or the XML formats' untyped parameter texts). A markup that holds several calls (Mistral's array,
Llama's ``;``-separated objects) is repaired whole or not at all, so that its text is never cut.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from passerelle.proxy.toolcalls.pieces import Piece, ToolCall, Unrepaired
from passerelle.proxy.toolcalls.scan import MAX_NESTING, JsonEnd, TooDeep, loads_bounded
from passerelle.proxy.toolcalls.schema import coerce, coerce_text, normalise_tool, validate


@dataclass(frozen=True, slots=True)
class Found:
    """One call as read from markup: ``arguments`` is a parsed value, a JSON text, or (``xml``) a
    dict of untyped parameter texts."""

    name: str
    arguments: Any
    xml: bool = False


class Bad(Exception):
    """Markup that says no call: the message is the Unrepaired reason."""


def found_in_object(obj: Any) -> Found:
    """A call written as a JSON object: ``{"name", "arguments" | "parameters"}``, or wrapped as
    ``{"type": "function", "function": {...}}``."""
    if isinstance(obj, Mapping) and isinstance(obj.get("function"), Mapping):
        obj = obj["function"]
    if not isinstance(obj, Mapping):
        raise Bad("not a call object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise Bad("no name")
    args = obj.get("arguments", obj.get("parameters", obj.get("input", {})))
    return Found(name.strip(), args)


def found_in_json(text: str) -> list[Found]:
    """Calls written as JSON text: one object, an array of them, or several objects in a row
    (a model that puts two calls in one ``<tool_call>``)."""
    values: list[Any] = []
    pos = _skip(text, 0)
    while pos < len(text):
        if text[pos] not in "{[":
            raise Bad("not JSON" if not values else "text after the call")
        try:
            end = JsonEnd(pos).scan(text)
        except TooDeep:
            raise Bad(f"nested deeper than {MAX_NESTING}") from None
        try:
            value = loads_bounded(text[pos:end] if end is not None else text[pos:])
        except (ValueError, RecursionError) as e:
            raise Bad(f"not JSON: {e.msg if isinstance(e, json.JSONDecodeError) else str(e)[:80]}") from None
        values.extend(value if isinstance(value, list) else [value])
        if isinstance(value, list) and not value:
            raise Bad("empty call list")
        pos = _skip(text, end if end is not None else len(text))
    if not values:
        raise Bad("no call")
    return [found_in_object(v) for v in values]


_SPACE = re.compile(r"\s*")


def _skip(text: str, pos: int) -> int:
    m = _SPACE.match(text, pos)
    return m.end() if m else pos


_FUNCTION = re.compile(r"<function=([^>\n]{1,256})>")
_PARAM = re.compile(r"<parameter=([^>\n]{1,256})>")
_PARAM_END = re.compile(r"</parameter>|<parameter=|</function>")


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def found_in_xml(text: str) -> Found:
    """A Qwen3-Coder call: ``<function=NAME><parameter=P>value</parameter>...</function>`` (a
    parameter's closing tag may be missing: the next parameter or the function's end closes it)."""
    m = _FUNCTION.search(text)
    if m is None:
        raise Bad("no <function=NAME>")
    name = m.group(1).strip().strip("\"'")
    end = text.find("</function>", m.end())
    if end >= 0 and text[end + len("</function>"):].strip():
        raise Bad("text after </function>")
    body = text[m.end(): end if end >= 0 else len(text)]
    if "<parameter=" not in body and body.strip().startswith("{"):
        return Found(name, body.strip())  # JSON arguments in a function tag, as some models write them
    params: dict[str, str] = {}
    pos = 0
    while True:
        p = _PARAM.search(body, pos)
        if p is None:
            break
        if body[pos:p.start()].strip():
            raise Bad("text between parameters")
        key = p.group(1).strip().strip("\"'")
        if key in params:
            raise Bad(f"parameter {key[:80]!r} given twice")
        close = _PARAM_END.search(body, p.end())
        stop = close.start() if close else len(body)
        params[key] = _strip_one_newline(body[p.end():stop])
        pos = close.end() if close and close.group() == "</parameter>" else stop
    if body[pos:].strip():
        raise Bad("text outside parameters")
    return Found(name, params, xml=True)


_FENCE = re.compile(r"```[A-Za-z]{0,16}[ \t]*\n(.*)\n[ \t]*```", re.DOTALL)


def found_in_body(text: str) -> list[Found]:
    """What a ``<tool_call>`` holds: JSON (Hermes) or a ``<function=...>`` (Qwen3-Coder), possibly
    in a Markdown code fence."""
    stripped = text.strip()
    fenced = _FENCE.fullmatch(stripped)
    if fenced is not None:
        stripped = fenced.group(1).strip()
    if stripped.startswith("<function="):
        return [found_in_xml(stripped)]
    return found_in_json(stripped)


class Calls:
    """The tools of one request, and the count of calls repaired so far (each call's index)."""

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.known: dict[str, Any] | None = None
        if tools is not None:
            self.known = {}
            for tool in tools:
                if not isinstance(tool, Mapping):
                    continue
                named = normalise_tool(tool) if "parameters" not in tool else tool
                if named is not None and isinstance(named.get("name"), str):
                    self.known[named["name"]] = named.get("parameters")
        self.count = 0

    def is_tool(self, name: str) -> bool:
        return self.name_of(name) is not None

    def name_of(self, name: str) -> str | None:
        """The request's tool ``name`` means (a ``functions.`` namespace some models write taken
        off), or None when it names none."""
        if self.known is None or name in self.known:
            return name
        bare = name.removeprefix("functions.")
        return bare if bare in self.known else None

    def _arguments(self, found: Found) -> str:
        schema = self.known.get(found.name) if self.known is not None else None
        schema = schema if isinstance(schema, Mapping) else None
        args = found.arguments
        if found.xml:
            props = schema.get("properties") if schema is not None else None
            props = props if isinstance(props, Mapping) else {}
            args = {k: coerce_text(v, props.get(k) if isinstance(props.get(k), Mapping) else None)
                    for k, v in args.items()}
        elif isinstance(args, str):
            if not args.strip():
                args = {}
            else:
                try:
                    args = loads_bounded(args)
                except (ValueError, RecursionError):
                    raise Bad("arguments are not JSON") from None
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise Bad("arguments are not an object")
        args = coerce(args, schema)
        fault = validate(args, schema)
        if fault:
            raise Bad(fault)
        return json.dumps(args, ensure_ascii=False)

    def pieces(self, markup: str, found: list[Found]) -> list[Piece]:
        """The calls ``found`` in ``markup`` as ToolCalls, or the markup as one Unrepaired."""
        try:
            named = []
            for f in found:
                name = self.name_of(f.name)
                if name is None:
                    raise Bad(f"unknown tool {f.name[:80]!r}")
                named.append(Found(name, f.arguments, f.xml))
            made = [(f.name, self._arguments(f)) for f in named]
        except Bad as e:
            return [Unrepaired(markup, str(e))]
        out: list[Piece] = []
        for name, arguments in made:
            out.append(ToolCall(self.count, name, arguments))
            self.count += 1
        return out

    def read(self, markup: str, read: Any, *args: Any) -> list[Piece]:
        """``read(*args)`` (one of the ``found_in_*``) turned into pieces for ``markup``."""
        try:
            found = read(*args)
        except Bad as e:
            return [Unrepaired(markup, str(e))]
        return self.pieces(markup, found if isinstance(found, list) else [found])
