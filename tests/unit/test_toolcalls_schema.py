"""A call's arguments against the request's tool schema: the three APIs' tool shapes, the XML
formats' untyped values coerced by type, and what cannot be made valid left unrepaired."""

from __future__ import annotations

import json
from typing import Any

import pytest

from passerelle.proxy.toolcalls import MAX_HELD, Text, ToolCall, Unrepaired, parse_all, parser_for, tool_schemas
from passerelle.proxy.toolcalls.schema import coerce, coerce_text, validate

PARAMS = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


def test_tools_in_every_api_shape_are_read():
    chat = {"tools": [{"type": "function", "function": {"name": "read", "parameters": PARAMS}}],
            "functions": [{"name": "legacy", "parameters": PARAMS}]}
    responses = {"tools": [{"type": "function", "name": "read", "parameters": PARAMS, "strict": True},
                           {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}]}
    messages = {"tools": [{"name": "read", "description": "d", "input_schema": PARAMS},
                          {"type": "web_search_20250305", "name": "web_search"}]}
    assert tool_schemas("chat", chat) == [{"name": "read", "parameters": PARAMS},
                                          {"name": "legacy", "parameters": PARAMS}]
    assert tool_schemas("responses", responses) == [{"name": "read", "parameters": PARAMS}]
    assert tool_schemas("messages", messages) == [{"name": "read", "parameters": PARAMS}]
    assert tool_schemas("chat", {"tools": "nonsense"}) == []
    assert tool_schemas("chat", {"tools": [None, 3, {"function": {"name": ""}}]}) == []


@pytest.mark.parametrize("tools", [
    [{"type": "function", "function": {"name": "read", "parameters": PARAMS}}],
    [{"type": "function", "name": "read", "parameters": PARAMS}],
    [{"name": "read", "input_schema": PARAMS}],
])
def test_the_parser_takes_tools_in_any_shape(tools: list[dict[str, Any]]):
    text = "<tool_call>{\"name\": \"read\", \"arguments\": {}}</tool_call>"
    assert parse_all("hermes", tools, text) == [Unrepaired(text, "arguments: missing required path")]
    good = "<tool_call>{\"name\": \"read\", \"arguments\": {\"path\": \"/a\"}}</tool_call>"
    assert parse_all("hermes", tools, good) == [ToolCall(0, "read", '{"path": "/a"}')]


@pytest.mark.parametrize(("text", "schema", "value"), [
    ("42", {"type": "integer"}, 42),
    (" 7.0 ", {"type": "integer"}, 7),
    ("7.5", {"type": "integer"}, "7.5"),
    ("+5", {"type": "integer"}, 5),
    ("1_000", {"type": "integer"}, "1_000"),
    ("\u0663", {"type": "integer"}, "\u0663"),
    ("1" * 5000, {"type": "integer"}, "1" * 5000),
    ("1e999", {"type": "number"}, "1e999"),
    ("NaN", None, "NaN"),
    ("-3.25", {"type": "number"}, -3.25),
    ("1e3", {"type": "number"}, 1000.0),
    ("nan", {"type": "number"}, "nan"),
    ("True", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False),
    ("yes", {"type": "boolean"}, "yes"),
    ("null", {"type": "null"}, None),
    ("None", {"type": ["string", "null"]}, None),
    ("hello", {"type": ["string", "null"]}, "hello"),
    ("12", {"type": ["integer", "string"]}, 12),
    ('{"a": [1, "2"]}', {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}},
     {"a": [1, 2]}),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("[1, 2", {"type": "array"}, "[1, 2"),
    ("42", {"type": "string"}, "42"),
    ("  spaced  ", {"type": "string"}, "  spaced  "),
    ("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 5),
    ("5", {"description": "no type"}, "5"),
    ("5", None, 5),
    ('{"k": 1}', None, {"k": 1}),
    ("some words", None, "some words"),
    ("[" * 10000, None, "[" * 10000),
])
def test_untyped_text_is_coerced_by_the_schema(text: str, schema: dict[str, Any] | None, value: Any):
    got = coerce_text(text, schema)
    assert got == value and type(got) is type(value)


def test_typed_json_strings_are_coerced_where_the_schema_asks():
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "b": {"type": "boolean"}, "o": {"type": "object"}, "s": {"type": "string"},
        "l": {"type": "array", "items": {"type": "number"}}}}
    got = coerce({"n": "3", "b": "false", "o": '{"x": 1}', "s": 5, "l": ["1.5", 2], "extra": "1"}, schema)
    assert got == {"n": 3, "b": False, "o": {"x": 1}, "s": "5", "l": [1.5, 2], "extra": "1"}
    assert coerce({"s": True}, schema) == {"s": True}
    nullable = {"properties": {"n": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}
    assert coerce({"n": "4"}, nullable) == {"n": 4}
    assert coerce({"n": "null"}, nullable) == {"n": None}


@pytest.mark.parametrize(("value", "schema", "fault"), [
    ({"a": 1}, {"type": "object", "required": ["a", "b"]}, "arguments: missing required b"),
    ({"a": "x"}, {"properties": {"a": {"type": "integer"}}}, "arguments.a: expected integer, got string"),
    ({"a": True}, {"properties": {"a": {"type": "integer"}}}, "arguments.a: expected integer, got boolean"),
    ({"a": 1.0}, {"properties": {"a": {"enum": [1, 2]}}}, None),
    ({"a": True}, {"properties": {"a": {"enum": [1, 2]}}}, "arguments.a: true is not one of [1, 2]"),
    ({"a": [1, "x"]}, {"properties": {"a": {"items": {"type": "integer"}}}}, "arguments.a[1]: expected integer, "
                                                                            "got string"),
    ({"a": None}, {"properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}, None),
    ({"a": 3}, {"properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}}},
     "arguments.a: matches none of anyOf"),
    ({"a": 3}, {"properties": {"a": {"type": "integer", "minimum": 5, "format": "x", "pattern": "["}}}, None),
    ({"a": 3}, {"type": "object", "properties": "junk", "required": "junk", "enum": "junk"}, None),
    ([], {"type": "object"}, "arguments: expected object, got array"),
])
def test_the_validator_knows_the_subset_and_ignores_the_rest(value: Any, schema: dict[str, Any], fault: str | None):
    assert validate(value, schema) == fault


def test_deep_schemas_and_values_are_refused_not_recursed():
    schema: dict[str, Any] = {"type": "object"}
    value: Any = 1
    for _ in range(5000):
        schema = {"type": "object", "properties": {"x": schema}}
        value = {"x": value}
    assert "nested deeper than" in (validate(value, schema) or "")
    assert coerce(value, schema) is value or coerce(value, schema) == value


def test_tool_lists_with_junk_in_them_are_read():
    tools: list[Any] = [None, "x", {"type": "function", "function": {"name": "read", "parameters": "junk"}}]
    text = '<tool_call>{"name": "read", "arguments": {"any": 1}}</tool_call>'
    assert parse_all("hermes", tools, text) == [ToolCall(0, "read", '{"any": 1}')]


def test_unknown_tool_and_no_tools():
    text = '<tool_call>{"name": "other", "arguments": {"q": 1}}</tool_call>'
    assert parse_all("hermes", [{"name": "read", "parameters": PARAMS}], text) == [
        Unrepaired(text, "unknown tool 'other'")]
    assert parse_all("hermes", [], text) == [Unrepaired(text, "unknown tool 'other'")]
    # Tools unknown to the caller: any name is taken, arguments are not checked.
    assert parse_all("hermes", None, text) == [ToolCall(0, "other", '{"q": 1}')]


def test_a_functions_namespace_is_taken_off_a_known_name():
    text = '<tool_call>{"name": "functions.read", "arguments": {"path": "p"}}</tool_call>'
    assert parse_all("hermes", [{"name": "read", "parameters": PARAMS}], text) == [
        ToolCall(0, "read", '{"path": "p"}')]


def test_arguments_that_are_no_object_are_unrepaired():
    # NaN and Infinity: Python reads them, a client's JSON parser would not read the arguments.
    for args in ('"just text"', "[1, 2]", '"{not json"', "3", '{"x": NaN}', '"{\\"x\\": -Infinity}"',
                 '{"x": ' + "9" * 5000 + "}"):
        text = f'<tool_call>{{"name": "read", "arguments": {args}}}</tool_call>'
        [piece] = parse_all("hermes", None, text)
        assert isinstance(piece, Unrepaired) and piece.text == text, args


def test_a_call_past_the_cap_is_released_as_unrepaired_and_the_rest_is_text():
    parser = parser_for("hermes", None)
    assert parser is not None
    head = '<tool_call>{"name": "read", "arguments": {"path": "'
    out = parser.feed(head)
    chunk = "x" * 4096
    fed = head
    while not out:
        out = parser.feed(chunk)
        fed += chunk
    assert len(fed) <= MAX_HELD + len(chunk) + 1
    assert out == [Unrepaired(fed, f"call longer than {MAX_HELD} characters")]
    assert parser.feed('"}}</tool_call> after') + parser.finish() == [Text('"}}</tool_call> after')]


def test_a_json_answer_past_the_cap_goes_on_as_text():
    parser = parser_for("llama3", [{"name": "read", "parameters": PARAMS}])
    assert parser is not None
    out = parser.feed('{"name": "')
    fed = '{"name": "'
    while not out:
        out = parser.feed("y" * 65536)
        fed += "y" * 65536
    assert out == [Text(fed)]


def test_whitespace_floods_are_scanned_once():
    # Held whitespace after a marker or a call is not rescanned at every feed: 512 KiB of it in
    # 8-character pieces would take minutes if it were.
    for fmt, head in (("mistral", "[TOOL_CALLS]"), ("qwen3-xml", "<function=read><parameter=path>p</parameter>"
                                                                  "</function>"),
                      ("llama3", '<|python_tag|>{"name": "read", "parameters": {"path": "p"}}')):
        parser = parser_for(fmt, [{"name": "read", "parameters": PARAMS}])
        assert parser is not None
        out = parser.feed(head)
        for _ in range(65536):
            out += parser.feed(" \n \t    ")
        out += parser.finish()
        assert "".join(p.text for p in out if isinstance(p, Text | Unrepaired)).strip() in ("", "[TOOL_CALLS]")


def test_unicode_and_escapes_survive():
    text = '<tool_call>{"name": "read", "arguments": {"path": "caf\\u00e9/🙂\\n\\"q\\""}}</tool_call>'
    [call] = parse_all("hermes", [{"name": "read", "parameters": PARAMS}], text)
    assert isinstance(call, ToolCall)
    assert json.loads(call.arguments) == {"path": 'café/🙂\n"q"'}
