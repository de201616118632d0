"""Model outputs in each tool-call format, written here after the formats' documentation and the
runtimes' own test fixtures (vLLM's tool-parser tests, SMG's tool_parser crate): what a model
prints, the calls it means, and the text around them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from passerelle.proxy.toolcalls import Piece, Reasoning, Text, ToolCall, Unrepaired, coalesce, parser_for

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}
SEARCH = {"name": "search", "parameters": {
    "type": "object",
    "properties": {"query": {"type": "string"}, "limit": {"type": ["integer", "null"]},
                   "exact": {"type": "boolean"}, "filters": {"type": "object"},
                   "tags": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number"}},
    "required": ["query"]}}
TOOLS: list[dict[str, Any]] = [WEATHER, SEARCH]


def call(index: int, name: str, arguments: str) -> ToolCall:
    return ToolCall(index, name, arguments)


@dataclass(frozen=True)
class Case:
    name: str
    fmt: str
    text: str
    pieces: list[Piece]


CASES = [
    Case("hermes one call", "hermes",
         'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
         '</tool_call>',
         [Text("Let me check.\n"), call(0, "get_weather", '{"city": "Paris", "days": 3}')]),
    Case("hermes two calls, arguments as a JSON string", "hermes",
         '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>\n'
         '<tool_call>{"name": "search", "arguments": {"query": "a < b [x] {y}", "limit": "5"}}</tool_call>',
         [call(0, "get_weather", '{"city": "Oslo"}'), Text("\n"),
          call(1, "search", '{"query": "a < b [x] {y}", "limit": 5}')]),
    Case("hermes without closing tag at the end", "hermes",
         'ok <tool_call>{"name": "search", "parameters": {"query": "q"}}',
         [Text("ok "), call(0, "search", '{"query": "q"}')]),
    Case("hermes unknown tool", "hermes",
         'a<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>b',
         [Text("a"), Unrepaired('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool 'rm_rf'"),
          Text("b")]),
    Case("qwen3-xml wrapped", "qwen3-xml",
         "I'll look.\n<tool_call>\n<function=search>\n<parameter=query>\nlocal llm\n</parameter>\n"
         "<parameter=limit>\n10\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n"
         "<parameter=filters>\n{\"lang\": \"fr\"}\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
         "<parameter=score>\n0.5\n</parameter>\n</function>\n</tool_call>",
         [Text("I'll look.\n"), call(0, "search", '{"query": "local llm", "limit": 10, "exact": true, '
                                                  '"filters": {"lang": "fr"}, "tags": ["a", "b"], "score": 0.5}')]),
    Case("qwen3-xml bare function with a stray closing tag", "qwen3-xml",
         "<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
         "</function>\n</tool_call>\nDone.",
         [call(0, "get_weather", '{"city": "New York", "days": 2}'), Text("\nDone.")]),
    Case("qwen3-xml value keeps inner newlines, null limit", "qwen3-xml",
         "<tool_call><function=search><parameter=query>\n\nline1\nline2\n\n</parameter>"
         "<parameter=limit>null</parameter></function></tool_call>",
         [call(0, "search", '{"query": "\\nline1\\nline2\\n", "limit": null}')]),
    Case("qwen3-xml integer that is not one", "qwen3-xml",
         "x<function=get_weather><parameter=city>Rome</parameter><parameter=days>soon</parameter></function>y",
         [Text("x"), Unrepaired("<function=get_weather><parameter=city>Rome</parameter><parameter=days>soon"
                                "</parameter></function>", "arguments.days: expected integer, got string"),
          Text("y")]),
    Case("mistral array", "mistral",
         'Sure[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "celsius"}}, '
         '{"name": "search", "arguments": {"query": "x"}}]',
         [Text("Sure"), call(0, "get_weather", '{"city": "Lyon", "unit": "celsius"}'),
          call(1, "search", '{"query": "x"}')]),
    Case("mistral v11 name and args", "mistral",
         '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]search[CALL_ID]abc123XYZ[ARGS]{"query": "y"}',
         [call(0, "get_weather", '{"city": "Nice"}'), call(1, "search", '{"query": "y"}')]),
    Case("mistral enum violated", "mistral",
         '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice", "unit": "kelvin"} after',
         [Unrepaired('[TOOL_CALLS]get_weather[ARGS]{"city": "Nice", "unit": "kelvin"}',
                     'arguments.unit: "kelvin" is not one of ["celsius", "fahrenheit"]'), Text(" after")]),
    Case("llama3 python tag", "llama3",
         '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Berlin"}}',
         [call(0, "get_weather", '{"city": "Berlin"}')]),
    Case("llama3 bare JSON, two calls", "llama3",
         '{"name": "get_weather", "parameters": {"city": "Bern"}}; {"name": "search", "arguments": {"query": "z"}}',
         [call(0, "get_weather", '{"city": "Bern"}'), call(1, "search", '{"query": "z"}')]),
    Case("llama3 bare JSON answer that is no call", "llama3",
         '{"name": "Alice", "parameters": {"age": 3}}',
         [Text('{"name": "Alice", "parameters": {"age": 3}}')]),
    Case("llama3 bare JSON followed by text is text", "llama3",
         '{"name": "search", "parameters": {"query": "q"}} is the call I would make.',
         [Text('{"name": "search", "parameters": {"query": "q"}} is the call I would make.')]),
    Case("harmony analysis then call", "harmony",
         "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
         'to=functions.get_weather <|constrain|>json<|message|>{"city": "Tokyo"}<|call|>',
         [Reasoning("Need weather."), call(0, "get_weather", '{"city": "Tokyo"}')]),
    Case("harmony recipient before channel, no constrain", "harmony",
         '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"query": "q"}<|call|>',
         [call(0, "search", '{"query": "q"}')]),
    Case("harmony final answer", "harmony",
         "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>",
         [Reasoning("Simple."), Text("Hello!")]),
    Case("harmony bad JSON", "harmony",
         "<|channel|>commentary to=functions.search<|message|>{query: q}<|call|>",
         [Unrepaired("<|channel|>commentary to=functions.search<|message|>{query: q}<|call|>",
                     "arguments are not JSON")]),
    Case("auto finds hermes", "auto",
         'x <tool_call>{"name": "search", "arguments": {"query": "q"}}</tool_call>',
         [Text("x "), call(0, "search", '{"query": "q"}')]),
    Case("auto finds mistral", "auto",
         'a [b] [TOOL_CALLS]search[ARGS]{"query": "q"}',
         [Text("a [b] "), call(0, "search", '{"query": "q"}')]),
    Case("auto finds harmony", "auto",
         '<|start|>assistant<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": "q"}'
         "<|call|>",
         [call(0, "search", '{"query": "q"}')]),
    Case("plain text with brackets", "auto",
         "Use <b>bold</b>, [links](x) and {braces}; 1 < 2 and [TOOL] <tool> <|x|>",
         [Text("Use <b>bold</b>, [links](x) and {braces}; 1 < 2 and [TOOL] <tool> <|x|>")]),
    Case("partial marker at the end is text", "auto", "the end <tool_ca",
         [Text("the end <tool_ca")]),
    Case("unterminated call at the end", "hermes", 'a <tool_call>{"name": "search", "argu',
         [Text("a "), Unrepaired('<tool_call>{"name": "search", "argu', "not JSON: Unterminated string starting at")]),
]


def streamed(fmt: str, tools: list[dict[str, Any]] | None, parts: list[str]) -> list[Piece]:
    parser = parser_for(fmt, tools)
    assert parser is not None
    out: list[Piece] = []
    for part in parts:
        out.extend(parser.feed(part))
    out.extend(parser.finish())
    return coalesce(out)
