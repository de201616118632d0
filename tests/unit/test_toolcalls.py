"""Tool calls written as text read back as calls: every format's examples, whole and streamed at
every split, give the same pieces, and the text around the calls is kept exactly."""

from __future__ import annotations

import pytest

from passerelle.proxy.toolcalls import Text, ToolCall, Unrepaired, parse_all, plain_text
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
def test_text_around_calls_is_kept_exactly(case: Case):
    pieces = parse_all(case.fmt, TOOLS, case.text)
    rebuilt = case.text
    for piece in pieces:
        assert isinstance(piece, Text | ToolCall | Unrepaired)
    # Every repaired call's markup taken out, the rest is the text as it came.
    kept = plain_text(pieces)
    assert len(kept) <= len(rebuilt)
    it = iter(rebuilt)
    assert all(ch in it for ch in kept)
    if not any(isinstance(p, ToolCall) for p in pieces):
        assert kept == rebuilt


def test_off_is_no_parser():
    assert parse_all("off", TOOLS, "<tool_call>{}</tool_call>") == [Text("<tool_call>{}</tool_call>")]
