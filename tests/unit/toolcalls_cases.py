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
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
TOOLS: list[dict[str, Any]] = [WEATHER, SEARCH, CLOCK]


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
    Case("hermes two objects in one tag, and a fenced one", "hermes",
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n{"name": "search", "arguments": {"query": "q"}}\n'
         '</tool_call><tool_call>\n```json\n{"name": "get_time", "arguments": {}}\n```\n</tool_call>',
         [call(0, "get_time", "{}"), call(1, "search", '{"query": "q"}'), call(2, "get_time", "{}")]),
    Case("hermes object then prose in the tag", "hermes",
         '<tool_call>{"name": "get_time", "arguments": {}} and more</tool_call>',
         [Unrepaired('<tool_call>{"name": "get_time", "arguments": {}} and more</tool_call>', "text after the call")]),
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
    # Calls written inside reasoning (vllm#39056): the caller feeds reasoning text to a parser too.
    Case("hermes call inside <think>", "hermes",
         '<think>I should check.\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n</think>Done.',
         [Text("<think>I should check.\n"), call(0, "get_time", "{}"), Text("\n</think>Done.")]),
    Case("hermes pretty-printed", "hermes",
         '<tool_call>\n{\n  "name": "search",\n  "arguments": {\n    "query": "tabs\\tand \\"quotes\\"",\n'
         '    "tags": ["x"]\n  }\n}\n</tool_call>\n',
         [call(0, "search", '{"query": "tabs\\tand \\"quotes\\"", "tags": ["x"]}'), Text("\n")]),
    Case("qwen3-xml empty call and braces in a value", "qwen3-xml",
         '<tool_call><function=get_time></function></tool_call><tool_call><function=search>'
         '<parameter=query>echo \'}\'</parameter><parameter=filters>{"x": "}"}</parameter></function></tool_call>',
         [call(0, "get_time", "{}"), call(1, "search", '{"query": "echo \'}\'", "filters": {"x": "}"}}')]),
    Case("qwen3-xml stream ends inside the call", "qwen3-xml",
         "<tool_call><function=get_weather><parameter=city>Paris</parameter></function></tool_call>"
         "<tool_call><function=get_weather><parameter=city>Tokyo</parameter>",
         [call(0, "get_weather", '{"city": "Paris"}'), call(1, "get_weather", '{"city": "Tokyo"}')]),
    Case("qwen3-xml unclosed wrapper, text after the function", "qwen3-xml",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\nThat is all.",
         [call(0, "get_weather", '{"city": "Rome"}'), Text("\nThat is all.")]),
    Case("qwen3-xml calls whose wrapper is never closed", "qwen3-xml",
         "<tool_call>\n<function=get_time>\n</function>\n<tool_call>\n<function=get_weather>\n"
         "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
         [call(0, "get_time", "{}"), Text("\n"), call(1, "get_weather", '{"city": "Oslo"}')]),
    Case("hermes call left open before the next", "hermes",
         '<tool_call>{"name": "get_time", "arguments": {}}\n<tool_call>{"name": "get_time", "arguments": {}}'
         "</tool_call>",
         [call(0, "get_time", "{}"), call(1, "get_time", "{}")]),
    Case("qwen3-xml JSON arguments in the function tag", "qwen3-xml",
         '<function=get_weather>{"city": "Kyiv", "days": "1"}</function>',
         [call(0, "get_weather", '{"city": "Kyiv", "days": 1}')]),
    Case("qwen3-xml parameter without its closing tag", "qwen3-xml",
         "<function=search><parameter=query>q<parameter=limit>3</function>",
         [call(0, "search", '{"query": "q", "limit": 3}')]),
    Case("qwen3-xml parameter given twice", "qwen3-xml",
         "<function=search><parameter=query>a</parameter><parameter=query>b</parameter></function>",
         [Unrepaired("<function=search><parameter=query>a</parameter><parameter=query>b</parameter></function>",
                     "parameter 'query' given twice")]),
    Case("mistral pretty-printed array, text after", "mistral",
         'I will look both up.\n\n[TOOL_CALLS] [\n    {\n        "name": "search",\n        "arguments": {\n'
         '            "query": "arr[0] = value[1]",\n            "exact": true\n        }\n    },\n    {\n'
         '        "name": "get_weather",\n        "arguments": {"city": "San Francisco, CA", "unit": "fahrenheit"}\n'
         '    }\n]\n\nRunning them now.',
         [Text("I will look both up.\n\n"), call(0, "search", '{"query": "arr[0] = value[1]", "exact": true}'),
          call(1, "get_weather", '{"city": "San Francisco, CA", "unit": "fahrenheit"}'),
          Text("\n\nRunning them now.")]),
    Case("mistral marker followed by no call", "mistral", "[TOOL_CALLS] hello there",
         [Unrepaired("[TOOL_CALLS] hello", "no [ARGS] after the name"), Text(" there")]),
    Case("mistral marker followed by punctuation", "mistral", "[TOOL_CALLS] !?",
         [Unrepaired("[TOOL_CALLS] ", "no call after [TOOL_CALLS]"), Text("!?")]),
    Case("mistral array that is no JSON", "mistral", '[TOOL_CALLS] [{"name": invalid}] ok',
         [Unrepaired('[TOOL_CALLS] [{"name": invalid}]', "not JSON: Expecting value"), Text(" ok")]),
    Case("mistral array whose [TOOL_CALLS] the runtime dropped", "mistral",
         ' [{"name": "get_time", "arguments": {}}, {"name": "search", "arguments": {"query": "q"}}]\n',
         [Text(" "), call(0, "get_time", "{}"), call(1, "search", '{"query": "q"}'), Text("\n")]),
    Case("mistral: a JSON array answer is text", "mistral", '[{"id": 1}, {"id": 2}] [TOOL_CALLS]x',
         [Text('[{"id": 1}, {"id": 2}] '), Unrepaired("[TOOL_CALLS]x", "no [ARGS] after the name")]),
    Case("llama3 python tag then text", "llama3",
         '<|python_tag|>{"name": "get_time", "parameters": {}}\nChecking the time.',
         [call(0, "get_time", "{}"), Text("\nChecking the time.")]),
    Case("llama3 python tag with code (code interpreter) is text", "llama3",
         "<|python_tag|>print(1 + 1)",
         [Unrepaired("<|python_tag|>", "<|python_tag|> not followed by a JSON call"), Text("print(1 + 1)")]),
    Case("auto finds a bare llama3 call", "auto",
         '\n {"type": "function", "name": "get_time", "parameters": {}}',
         [Text("\n "), call(0, "get_time", "{}")]),
    Case("auto: a JSON answer that is no call, then a Hermes call", "auto",
         '{"type": "note", "text": "x"}\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
         [Text('{"type": "note", "text": "x"}\n'), call(0, "get_time", "{}")]),
    Case("harmony recipient in the role, truncated without <|call|>", "harmony",
         '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
         '{"city": "Lima"}',
         [call(0, "get_weather", '{"city": "Lima"}')]),
    Case("harmony constrain without a space, preamble first", "harmony",
         "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>commentary "
         'to=functions.search<|constrain|>json<|message|>{"query": "k8s"}<|call|>',
         [Text("Let me look."), call(0, "search", '{"query": "k8s"}')]),
    Case("harmony two calls in a row", "harmony",
         '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>'
         '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
         '{"city": "Oslo"}<|call|>',
         [call(0, "get_time", "{}"), call(1, "get_weather", '{"city": "Oslo"}')]),
    Case("harmony built-in tool the request does not have", "harmony",
         '<|channel|>analysis to=browser.search<|message|>{"query": "q"}<|call|>',
         [Unrepaired('<|channel|>analysis to=browser.search<|message|>{"query": "q"}<|call|>',
                     "unknown tool 'browser.search'")]),
    Case("harmony header cut off at the end", "harmony",
         "Hi<|start|>assistant<|channel|>comm",
         [Text("Hi"), Unrepaired("<|start|>assistant<|channel|>comm", "Harmony header without <|message|>")]),
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
