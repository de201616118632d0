"""Tool calls written as text read back as calls: every format's examples, whole and streamed at
every split, give the same pieces, and the text around the calls is kept exactly."""

from __future__ import annotations

import pytest

from passerelle.proxy.toolcalls import Text, ToolCall, Unrepaired, coalesce, parse_all, parser_for, plain_text
from tests.unit.toolcalls_cases import CASES, TOOLS, Case, streamed


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_whole_text_gives_the_expected_pieces(case: Case):
    assert parse_all(case.fmt, TOOLS, case.text) == case.pieces


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_split_gives_the_same_pieces(case: Case):
    text = case.text
    for i in range(len(text) + 1):
        assert streamed(case.fmt, TOOLS, [text[:i], text[i:]]) == case.pieces, i


@pytest.mark.parametrize("case", [c for c in CASES if len(c.text) <= 90], ids=lambda c: c.name)
def test_every_pair_of_splits_gives_the_same_pieces(case: Case):
    text = case.text
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert streamed(case.fmt, TOOLS, [text[:i], text[i:j], text[j:]]) == case.pieces, (i, j)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_one_character_at_a_time_gives_the_same_pieces(case: Case):
    assert streamed(case.fmt, TOOLS, list(case.text)) == case.pieces


@pytest.mark.parametrize("case", [c for c in CASES if c.fmt != "harmony"], ids=lambda c: c.name)
def test_text_around_calls_is_kept_in_order(case: Case):
    # What is not a repaired call comes out in input order, and with no call repaired it is the
    # input exactly (test_toolcalls_fuzz.py checks the text between calls exactly, built from parts).
    pieces = parse_all(case.fmt, TOOLS, case.text)
    kept = plain_text(pieces)
    it = iter(case.text)
    assert all(ch in it for ch in kept)
    if not any(isinstance(p, ToolCall) for p in pieces):
        assert kept == case.text
    for piece in pieces:
        if isinstance(piece, Unrepaired):
            assert piece.text in case.text


def test_off_is_no_parser():
    assert parse_all("off", TOOLS, "<tool_call>{}</tool_call>") == [Text("<tool_call>{}</tool_call>")]


@pytest.mark.parametrize("fmt", ["auto", "hermes", "qwen3-xml", "mistral", "llama3", "harmony"])
def test_plain_text_goes_on_as_it_came_at_once(fmt: str):
    parser = parser_for(fmt, None)
    assert parser is not None
    chunk = " the quick brown fox {json} (a < b) ;"
    [piece] = parser.feed(chunk)
    assert isinstance(piece, Text) and piece.text is chunk
    assert parser.feed("") == []


@pytest.mark.parametrize(("fmt", "text", "held"), [
    ("auto", "1 < 2 and <", "<"),
    ("auto", "see <tool_ca", "<tool_ca"),
    ("hermes", "see <tool_ca", "<tool_ca"),
    ("hermes", "see [TOOL_CA", ""),
    ("mistral", "see [TOOL_CA", "[TOOL_CA"),
    ("harmony", "x <|sta", "<|sta"),
    ("qwen3-xml", "a <functio", "<functio"),
    ("llama3", "b <|python_t", "<|python_t"),
    ("auto", "<b>bold</b> <i", ""),
])
def test_only_a_possible_partial_marker_is_held(fmt: str, text: str, held: str):
    parser = parser_for(fmt, None)
    assert parser is not None
    out = parser.feed(text)
    assert "".join(p.text for p in out if isinstance(p, Text)) + held == text
    assert coalesce(out + parser.finish()) == [Text(text)]
