"""The request's tools, and a call's arguments coerced and checked against a tool's JSON schema.

Tools come in three shapes, normalised to ``{"name", "parameters"}``: chat's
``{"type": "function", "function": {"name", "parameters"}}`` (and the legacy ``functions`` list),
Responses' flat ``{"type": "function", "name", "parameters"}``, and Anthropic's
``{"name", "input_schema"}``. Tools with no schema of their own (Responses' ``web_search``,
Anthropic's server tools, custom grammars) are not listed: a call naming one is not repaired.

The validator knows the subset models are given: ``type`` (a name or a list), ``properties``,
``required``, ``enum``, ``items``, ``anyOf`` / ``oneOf`` (read as "any of"); every other keyword is
ignored (a schema is a hint here, not a contract to enforce). Coercion turns text into the type the
schema asks for: the XML formats carry every value as text, and models write ``"5"`` for 5.
Nesting past ``MAX_DEPTH`` is refused, never recursed into.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from passerelle.proxy.toolcalls.scan import loads_bounded

MAX_DEPTH = 64

Schema = Mapping[str, Any]


def _named(name: Any, schema: Any) -> dict[str, Any] | None:
    if not isinstance(name, str) or not name:
        return None
    return {"name": name, "parameters": schema if isinstance(schema, Mapping) else {"type": "object"}}


def normalise_tool(tool: Any) -> dict[str, Any] | None:
    """One tool definition in any API's shape as ``{"name", "parameters"}``, or None when it has no
    function schema."""
    if not isinstance(tool, Mapping):
        return None
    function = tool.get("function")
    if isinstance(function, Mapping):
        return _named(function.get("name"), function.get("parameters"))
    if "input_schema" in tool:
        return _named(tool.get("name"), tool.get("input_schema"))
    kind = tool.get("type")
    if kind in (None, "function") and "name" in tool:
        return _named(tool.get("name"), tool.get("parameters"))
    return None


def tool_schemas(api: str, body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The function tools of request ``body`` on ``api`` (chat, completions, responses, messages:
    every shape is read on every API, a client may mix them), as ``{"name", "parameters"}``."""
    found: list[dict[str, Any]] = []
    for field in ("tools", "functions"):
        listed = body.get(field)
        if isinstance(listed, list):
            found.extend(t for t in map(normalise_tool, listed) if t is not None)
    return found


def _types(schema: Schema) -> list[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    if "properties" in schema:
        return ["object"]
    return []


def _branches(schema: Schema) -> list[Schema]:
    for key in ("anyOf", "oneOf"):
        listed = schema.get(key)
        if isinstance(listed, list):
            return [b for b in listed if isinstance(b, Mapping)]
    return []


# JSON's numbers (a leading "+" forgiven), in ASCII digits: Python's int() would also take "1_000" and "٣".
_INTEGER = re.compile(r"[+-]?[0-9]{1,4000}")
_NUMBER = re.compile(r"[+-]?[0-9]{1,4000}(?:\.[0-9]{1,4000})?(?:[eE][+-]?[0-9]{1,4})?")
_LITERALS = {"true": True, "false": False, "null": None, "none": None}


def _from_text(text: str, kind: str) -> tuple[bool, Any]:
    """``text`` read as a value of JSON type ``kind``: (True, value), or (False, None)."""
    word = text.strip()
    if kind == "string":
        return True, text
    if kind == "boolean":
        lowered = word.lower()
        if lowered in ("true", "false"):
            return True, lowered == "true"
        return False, None
    if kind == "null":
        return (True, None) if word.lower() in ("null", "none") else (False, None)
    if kind == "integer":
        if _INTEGER.fullmatch(word):
            return True, int(word)
        if _NUMBER.fullmatch(word):
            number = float(word)
            return (True, int(number)) if math.isfinite(number) and number.is_integer() else (False, None)
        return False, None
    if kind == "number":
        if _INTEGER.fullmatch(word):
            return True, int(word)
        if _NUMBER.fullmatch(word):
            number = float(word)
            return (True, number) if math.isfinite(number) else (False, None)
        return False, None
    if kind in ("object", "array"):
        try:
            value = loads_bounded(word)
        except (ValueError, RecursionError):
            return False, None
        return (True, value) if isinstance(value, dict if kind == "object" else list) else (False, None)
    return False, None


def coerce_text(text: str, schema: Schema | None) -> Any:
    """An XML format's untyped value ``text`` as the type ``schema`` asks for; a value no type takes
    stays text (the validator then says what is wrong). With no schema, a JSON literal (number,
    boolean, null, object, array) is read as one, anything else stays text."""
    if schema is None:
        try:
            return loads_bounded(text) if text.strip()[:1] in ("{", "[") or text.strip().lower() in _LITERALS \
                or _is_number(text) else text
        except (ValueError, RecursionError):
            return text
    kinds = _types(schema) or [k for b in _branches(schema) for k in _types(b)]
    for kind in sorted(kinds, key=lambda k: k == "string"):
        ok, value = _from_text(text, kind)
        if ok:
            return coerce(value, schema)
    return text


def _is_number(text: str) -> bool:
    return _NUMBER.fullmatch(text.strip()) is not None


def coerce(value: Any, schema: Schema | None, depth: int = 0) -> Any:
    """``value`` with strings turned into the type ``schema`` asks for where they read as one
    (``"5"`` for an integer, ``"true"`` for a boolean, a JSON text for an object or array), and
    numbers written as strings where only a string will do (``123`` for an id), inside objects'
    properties and arrays' items too; anything else as it was."""
    if schema is None or depth > MAX_DEPTH:
        return value
    kinds = _types(schema) or [k for b in _branches(schema) for k in _types(b)]
    if isinstance(value, str) and kinds and "string" not in kinds:
        for kind in kinds:
            ok, converted = _from_text(value, kind)
            if ok:
                value = converted
                break
    elif kinds == ["string"] and _is_type(value, "number"):
        value = json.dumps(value)
    if isinstance(value, dict):
        props = schema.get("properties")
        if isinstance(props, Mapping):
            return {k: coerce(v, props.get(k) if isinstance(props.get(k), Mapping) else None, depth + 1)
                    for k, v in value.items()}
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, Mapping):
            return [coerce(v, items, depth + 1) for v in value]
    return value


def _is_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    checks: dict[str, type | tuple[type, ...]] = {
        "string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}
    wanted = checks.get(kind)
    return True if wanted is None else isinstance(value, wanted)


def validate(value: Any, schema: Schema | None, where: str = "arguments", depth: int = 0) -> str | None:
    """Why ``value`` does not meet ``schema`` (the first fault found, naming where), or None."""
    if schema is None:
        return None
    if depth > MAX_DEPTH:
        return f"{where}: nested deeper than {MAX_DEPTH}"
    branches = _branches(schema)
    if branches and all(validate(value, b, where, depth + 1) for b in branches):
        return f"{where}: matches none of anyOf"
    kinds = _types(schema)
    if kinds and not any(_is_type(value, k) for k in kinds):
        return f"{where}: expected {' or '.join(kinds)}, got {_json_type(value)}"
    enum = schema.get("enum")
    if isinstance(enum, list) and not any(_same(value, e) for e in enum):
        return f"{where}: {_dumps(value)[:60]} is not one of {_dumps(enum)[:120]}"
    if isinstance(value, dict):
        required = schema.get("required")
        if isinstance(required, list):
            missing = [r for r in required if isinstance(r, str) and r not in value]
            if missing:
                return f"{where}: missing required {', '.join(missing)}"
        props = schema.get("properties")
        if isinstance(props, Mapping):
            for key, sub in value.items():
                inner = props.get(key)
                if isinstance(inner, Mapping):
                    fault = validate(sub, inner, f"{where}.{key}", depth + 1)
                    if fault:
                        return fault
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, Mapping):
            for i, sub in enumerate(value):
                fault = validate(sub, items, f"{where}[{i}]", depth + 1)
                if fault:
                    return fault
    return None


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _same(value: Any, wanted: Any) -> bool:
    """JSON equality: 1 is 1.0, but True is not 1."""
    if _is_type(value, "number") and _is_type(wanted, "number"):
        return bool(value == wanted)
    return type(value) is type(wanted) and bool(value == wanted)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"
