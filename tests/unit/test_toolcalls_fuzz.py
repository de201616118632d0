"""Tool-call parsing under Hypothesis: text and calls interleaved at random, fed in random pieces,
give exactly the pieces the whole text gives and the ones it was built from; any text at all
(markers, half-calls, deep nesting) gives pieces that account for it and never an exception."""

from __future__ import annotations

import itertools
import json
import os
import re

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from passerelle.proxy.toolcalls import FORMATS, Piece, Reasoning, Text, ToolCall, Unrepaired, coalesce, parse_all
from passerelle.proxy.toolcalls.parser import _MARKERS
from passerelle.proxy.toolcalls.schema import coerce, coerce_text, validate
from tests.unit.toolcalls_cases import TOOLS, streamed

FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None,
                derandomize=not os.environ.get("FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])

# Per format: call markups and the pieces each stands for (index 0.. within the markup; renumbered
# in order), and markups that cannot be repaired (their pieces: the markup itself, Unrepaired).
_W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
_S = '{"name": "search", "arguments": {"query": "a<b [c] {d}", "limit": 2}}'
GOOD: dict[str, list[tuple[str, list[tuple[str, str]]]]] = {
    "hermes": [
        (f"<tool_call>{_W}</tool_call>", [("get_weather", '{"city": "Paris"}')]),
        (f"<tool_call>\n{_S}\n</tool_call>", [("search", '{"query": "a<b [c] {d}", "limit": 2}')]),
    ],
    "qwen3-xml": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n4\n"
         "</parameter>\n</function>\n</tool_call>", [("get_weather", '{"city": "Paris", "days": 4}')]),
        ("<function=search><parameter=query>x > y</parameter><parameter=exact>false</parameter></function>",
         [("search", '{"query": "x > y", "exact": false}')]),
        (f"<tool_call>{_W}</tool_call>", [("get_weather", '{"city": "Paris"}')]),
    ],
    "mistral": [
        (f"[TOOL_CALLS][{_W}, {_S}]", [("get_weather", '{"city": "Paris"}'),
                                        ("search", '{"query": "a<b [c] {d}", "limit": 2}')]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": "2"}',
         [("get_weather", '{"city": "Rome", "days": 2}')]),
    ],
    "llama3": [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
         [("get_weather", '{"city": "Oslo"}')]),
        ('<|python_tag|>{"name": "search", "parameters": {"query": "q"}}; {"name": "get_weather", "arguments": '
         '{"city": "Lima"}}', [("search", '{"query": "q"}'), ("get_weather", '{"city": "Lima"}')]),
    ],
    "harmony": [
        ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
         '{"city": "Paris"}<|call|>', [("get_weather", '{"city": "Paris"}')]),
        ('<|channel|>commentary to=functions.search<|message|>{"query": "q", "exact": "true"}<|call|>',
         [("search", '{"query": "q", "exact": true}')]),
    ],
}
# Harmony's text messages: their framing goes, their text stays (analysis as reasoning).
FRAMED: dict[str, list[tuple[str, list[Piece]]]] = {
    "harmony": [
        ("<|channel|>analysis<|message|>Think [a] <b>.<|end|>", [Reasoning("Think [a] <b>.")]),
        ("<|start|>assistant<|channel|>final<|message|>Done <|x|>!<|return|>", [Text("Done <|x|>!")]),
        ("<|start|>assistant<|channel|>commentary<|message|>Looking.<|end|>", [Text("Looking.")]),
    ],
}
BAD: dict[str, list[str]] = {
    "hermes": ['<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
               '<tool_call>{"name": "get_weather", "arguments": {"days": 1}}</tool_call>',
               "<tool_call>oops</tool_call>"],
    "qwen3-xml": ["<tool_call><function=get_weather><parameter=days>x</parameter></function></tool_call>",
                  "<function=nope></function>"],
    "mistral": ['[TOOL_CALLS]nope[ARGS]{"a": 1}', '[TOOL_CALLS][{"name": "search", "arguments": {}}]'],
    "llama3": ['<|python_tag|>{"name": "nope", "parameters": {}}'],
    "harmony": ["<|channel|>commentary to=functions.search<|message|>not json<|call|>"],
}
# Text between calls: the characters markup is made of, and none that would join a call to its
# neighbour (a ';' after Llama's object, a '</tool_call>' after a bare function).
ALPHABET = "ab <>|[]{}_=:\n\",.ïé🙂"


def _expected(parts: list[tuple[str, object]]) -> list[Piece]:
    out: list[Piece] = []
    index = 0
    for kind, value in parts:
        if kind == "text":
            assert isinstance(value, str)
            out.append(Text(value))
        elif kind == "bad":
            assert isinstance(value, str)
            out.append(Unrepaired(value, "?"))
        elif kind == "framed":
            assert isinstance(value, list)
            out.extend(value)
        else:
            assert isinstance(value, list)
            for name, args in value:
                out.append(ToolCall(index, name, args))
                index += 1
    return coalesce(out)


def _without_reasons(pieces: list[Piece]) -> list[Piece]:
    return [Unrepaired(p.text, "?") if isinstance(p, Unrepaired) else p for p in pieces]


@st.composite
def interleavings(draw: st.DrawFn) -> tuple[str, str, list[int], list[Piece]]:
    fmt = draw(st.sampled_from(sorted(GOOD)))
    segments = draw(st.lists(st.one_of(
        st.tuples(st.just("text"), st.text(ALPHABET, min_size=1, max_size=12)),
        st.tuples(st.just("good"), st.sampled_from(GOOD[fmt])),
        st.tuples(st.just("bad"), st.sampled_from(BAD[fmt])),
        *([st.tuples(st.just("framed"), st.sampled_from(FRAMED[fmt]))] if fmt in FRAMED else [])),
        min_size=1, max_size=6))
    parts: list[tuple[str, object]] = []
    markup_at: list[int] = []
    text = ""
    for kind, value in segments:
        if kind == "text":
            assert isinstance(value, str)
            parts.append(("text", value))
            text += value
        else:
            markup = value if kind == "bad" else value[0]
            assert isinstance(markup, str)
            markup_at.append(len(text))
            parts.append((kind, markup if kind == "bad" else value[1]))
            text += markup
    # The only markers are the calls' own, and no text joins a call: else the case means another thing.
    markers = re.compile("|".join(re.escape(m) for m in _MARKERS[fmt]))
    starts = [m.start() for m in markers.finditer(text)]
    draw(st.just(None).filter(lambda _: all(any(s == a or (a < s < a + 200) for a in markup_at) for s in starts)))
    cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=8))))
    return fmt, text, cuts, _expected(parts)


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@FUZZ
@given(interleavings())
def test_random_interleavings_streamed_at_random_splits(case: tuple[str, str, list[int], list[Piece]]):
    fmt, text, cuts, expected = case
    whole = parse_all(fmt, TOOLS, text)
    assert _without_reasons(whole) == expected
    assert streamed(fmt, TOOLS, _split(text, cuts)) == whole
    assert streamed("auto", TOOLS, _split(text, cuts)) == parse_all("auto", TOOLS, text)


def _accounted(text: str, pieces: list[Piece]) -> None:
    """Every character of ``text`` is in the pieces once, in order, but for repaired calls' markup
    (and Harmony's framing): the pieces' text is a subsequence of the input."""
    kept = "".join(p.text for p in pieces if isinstance(p, Text | Unrepaired | Reasoning))
    it = iter(text)
    assert all(ch in it for ch in kept)


MARKUP = st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<function=", "search>", "</function>",
                                  "<parameter=", "query>", "</parameter>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
                                  "<|python_tag|>", "<|start|>", "<|channel|>", "<|message|>", "<|call|>",
                                  "<|end|>", "analysis", "commentary", " to=functions.search", '{"name": "search"',
                                  ', "arguments": {', '"query": "x"', "}", "]", "[", "{", "; ", "\n", " ", "a", "<",
                                  '"', "\\", "[[[[[[[[", "{{{{{{{{"]), max_size=40).map("".join)


@FUZZ
@given(st.sampled_from([f for f in FORMATS if f != "off"]), st.one_of(st.text(max_size=200), MARKUP),
       st.lists(st.integers(0, 400), max_size=6), st.booleans())
@example("hermes", "<tool_call>" + "[" * 5000 + "</tool_call>", [3, 700], True)
@example("mistral", "[TOOL_CALLS]" + "[" * 100000, [12], True)
@example("llama3", "{" * 100000, [], True)
def test_any_text_gives_pieces_that_account_for_it(fmt: str, text: str, cuts: list[int], with_tools: bool):
    tools = TOOLS if with_tools else None
    whole = parse_all(fmt, tools, text)
    cut = sorted({c for c in cuts if c <= len(text)})
    assert streamed(fmt, tools, _split(text, cut)) == whole
    _accounted(text, whole)
    framed = fmt in ("harmony", "auto") and ("<|start|>" in text or "<|channel|>" in text)
    if not framed and not any(isinstance(p, ToolCall | Reasoning) for p in whole):
        assert "".join(p.text for p in whole if isinstance(p, Text | Unrepaired)) == text


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                    max_leaves=20)
TYPES = st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array", "bogus"])
SCHEMA = st.recursive(
    st.fixed_dictionaries({}, optional={"type": TYPES | st.lists(TYPES, max_size=3) | JSON, "enum": JSON,
                                        "required": JSON}),
    lambda inner: st.fixed_dictionaries({}, optional={
        "type": TYPES, "properties": st.dictionaries(st.text(max_size=4), inner, max_size=3) | JSON,
        "items": inner | JSON, "anyOf": st.lists(inner, max_size=3) | JSON, "required": st.lists(
            st.text(max_size=4), max_size=3)}),
    max_leaves=10)


@FUZZ
@given(JSON, SCHEMA, st.text(max_size=30))
def test_coercion_and_validation_take_any_value_and_schema(value: object, schema: dict[str, object], text: str):
    fault = validate(coerce(value, schema), schema)
    assert fault is None or isinstance(fault, str)
    coerce_text(text, schema)
    tools = [{"name": "f", "parameters": schema}]
    for markup in (f"<function=f><parameter=a>{text}</parameter></function>",
                   '<tool_call>{"name": "f", "arguments": ' + json.dumps(value) + "}</tool_call>"):
        for piece in parse_all("qwen3-xml", tools, markup):
            if isinstance(piece, ToolCall):
                assert isinstance(json.loads(piece.arguments), dict)
            else:
                assert isinstance(piece, Unrepaired | Text)
