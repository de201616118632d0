"""Does a tool call's arguments object fit the tool's JSON schema? The subset of JSON Schema that
agents' tool definitions use (type, required, properties, additionalProperties, enum, const,
items, anyOf/oneOf/allOf, local ``$ref``, minItems/maxItems, minimum/maximum), checked as a
client's tool runner would before it runs the tool. Keywords outside the subset are accepted,
so a schema this does not understand never fails a call.

    >>> problems({"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}, {})
    ['$: missing required property city']
    >>> problems({"type": "integer"}, True)
    ['$: expected integer, got boolean']
"""

from __future__ import annotations

from typing import Any

MAX_DEPTH = 32  # a recursive schema ($ref to itself) stops here, accepted
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    for name, kind in _TYPES.items():
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _fits_type(kind: str, value: Any) -> bool:
    actual = _type_of(value)
    if kind == "number":
        return actual in ("integer", "number")
    if kind == "integer":
        return actual == "integer" or (actual == "number" and float(value).is_integer())
    return actual == kind


def problems(schema: Any, value: Any, root: Any = None, where: str = "$", depth: int = 0) -> list[str]:
    """What is wrong with ``value`` under ``schema``: one line per problem, empty when it fits."""
    root = schema if root is None else root
    if depth > MAX_DEPTH or not isinstance(schema, dict):
        return []
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target: Any = root
        for part in ref[2:].split("/") if len(ref) > 1 else ():
            target = target.get(part) if isinstance(target, dict) else None
        return problems(target, value, root, where, depth + 1)
    out: list[str] = []
    kind = schema.get("type")
    kinds = [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)] if isinstance(kind, list) \
        else []
    if kinds and not any(_fits_type(k, value) for k in kinds):
        return [f"{where}: expected {' or '.join(kinds)}, got {_type_of(value)}"]
    if "const" in schema and value != schema["const"]:
        out.append(f"{where}: expected {schema['const']!r}")
    if isinstance(schema.get("enum"), list) and value not in schema["enum"]:
        out.append(f"{where}: {value!r} is not one of {schema['enum']!r}")
    for key in ("anyOf", "oneOf"):
        branches = [b for b in schema.get(key) or () if isinstance(b, dict)]
        if branches and all(problems(b, value, root, where, depth + 1) for b in branches):
            out.append(f"{where}: fits none of {key}")
    for part in schema.get("allOf") or ():
        out += problems(part, value, root, where, depth + 1)
    if isinstance(value, dict):
        out += _object(schema, value, root, where, depth)
    elif isinstance(value, list):
        items = schema.get("items")
        for i, item in enumerate(value):
            out += problems(items, item, root, f"{where}[{i}]", depth + 1)
        low, high = schema.get("minItems"), schema.get("maxItems")
        if isinstance(low, int) and len(value) < low:
            out.append(f"{where}: fewer than {low} items")
        if isinstance(high, int) and len(value) > high:
            out.append(f"{where}: more than {high} items")
    elif _type_of(value) in ("integer", "number"):
        low, high = schema.get("minimum"), schema.get("maximum")
        if isinstance(low, int | float) and value < low:
            out.append(f"{where}: below the minimum {low}")
        if isinstance(high, int | float) and value > high:
            out.append(f"{where}: above the maximum {high}")
    return out


def _object(schema: dict[str, Any], value: dict[str, Any], root: Any, where: str, depth: int) -> list[str]:
    out: list[str] = []
    props = p if isinstance(p := schema.get("properties"), dict) else {}
    for name in schema.get("required") or ():
        if isinstance(name, str) and name not in value:
            out.append(f"{where}: missing required property {name}")
    extra = schema.get("additionalProperties")
    for name, item in value.items():
        if name in props:
            out += problems(props[name], item, root, f"{where}.{name}", depth + 1)
        elif extra is False:
            out.append(f"{where}: unexpected property {name}")
        elif isinstance(extra, dict):
            out += problems(extra, item, root, f"{where}.{name}", depth + 1)
    return out
