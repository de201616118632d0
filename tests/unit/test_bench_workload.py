"""Prompts, multi-turn chats, scenario files, URLs and the split of load over processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from passerelle.bench.processes import share_level
from passerelle.bench.runner import Level
from passerelle.bench.target import normalize_url, parse_target
from passerelle.bench.workload import (
    WORDS,
    Conversation,
    ScenarioError,
    TrafficClass,
    Workload,
    load_scenario,
    parse_duration,
)


def words_of(body: dict) -> int:
    text = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
    return len(text.split())


def test_prompt_length_follows_tokens_per_word_and_overhead():
    w = Workload(prompt_tokens=212, tokens_per_word=2.0, prompt_overhead=12)
    body, max_tokens = Conversation(w, 0, "m").next_body()
    # 100 words of text, plus the tag ("Story N:") and the instruction (7 words)
    assert words_of(body) == 100 + 2 + 7
    assert max_tokens == 64 and body["max_tokens"] == 64
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["model"] == "m"


def test_prompts_differ_and_are_reproducible():
    w = Workload(prompt_tokens=64)
    a1, _ = Conversation(w, 1, "m").next_body()
    a2, _ = Conversation(w, 1, "m").next_body()
    b, _ = Conversation(w, 2, "m").next_body()
    assert a1 == a2
    assert a1["messages"][0]["content"][:40] != b["messages"][0]["content"][:40]  # no shared prefix


def test_spreads_stay_in_range():
    w = Workload(prompt_tokens=100, prompt_spread=50, max_tokens=20, max_tokens_spread=10, tokens_per_word=1.0,
                 prompt_overhead=0)
    lengths, outs = set(), set()
    for i in range(200):
        body, mt = Conversation(w, i, "m").next_body()
        lengths.add(words_of(body) - 9)
        outs.add(mt)
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(lengths) > 20
    assert min(outs) >= 10 and max(outs) <= 30 and len(outs) > 5


def test_multi_turn_chat_grows_a_shared_prefix():
    conv = Conversation(Workload(turns=3, prompt_tokens=40), 7, "m")
    first, _ = conv.next_body()
    second, _ = conv.next_body()
    third, _ = conv.next_body()
    assert conv.finished
    assert second["messages"][:1] == first["messages"]
    assert [m["role"] for m in third["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert third["messages"][:3] == second["messages"]


def test_completions_body_and_switches():
    w = Workload(endpoint="completions", ignore_eos=False, include_usage=False, extra_body={"temperature": 0})
    body, _ = Conversation(w, 0, "m").next_body()
    assert "prompt" in body and "messages" not in body
    assert "ignore_eos" not in body and "stream_options" not in body and body["temperature"] == 0
    assert w.path == "/v1/completions"


def test_corpus_is_real_text():
    assert len(WORDS) > 400 and "river" in WORDS


def test_urls():
    for url in ("http://h:8080", "http://h:8080/", "http://h:8080/v1", "http://h:8080/v1/"):
        assert normalize_url(url) == "http://h:8080"
    assert normalize_url("https://x/prefix/v1") == "https://x/prefix"
    with pytest.raises(ValueError):
        normalize_url("h:8080")
    assert parse_target("vulkan=http://h:8081/v1") == ("vulkan", "http://h:8081")
    with pytest.raises(ValueError):
        parse_target("http://h:8081")


def test_durations():
    assert parse_duration("2s") == 2.0 and parse_duration("250ms") == 0.25 and parse_duration("1.5m") == 90.0
    assert parse_duration("3") == 3.0 and parse_duration("40", default_unit="ms") == 0.04
    with pytest.raises(ValueError):
        parse_duration("soon")


def test_scenario_file(tmp_path: Path):
    path = tmp_path / "s.toml"
    path.write_text("""
duration = "30s"
[defaults]
max_tokens = 32
[[class]]
name = "chat"
priority = "interactive"
api_key_env = "ALICE_KEY"
concurrency = 2
turns = 3
[[class]]
name = "batch"
priority = "batch"
rate = 0.5
poisson = true
prompt_tokens = 1024
max_tokens = 256
""")
    sc = load_scenario(path, Workload(), env={"ALICE_KEY": "sk-alice"})
    assert sc.duration == 30.0
    chat, batch = sc.classes
    assert chat.concurrency == 2 and chat.workload.turns == 3 and chat.workload.max_tokens == 32
    assert chat.headers() == {"X-Priority": "interactive", "Authorization": "Bearer sk-alice"}
    assert batch.rate == 0.5 and batch.poisson and batch.workload.prompt_tokens == 1024
    assert batch.workload.max_tokens == 256 and batch.headers() == {"X-Priority": "batch"}


@pytest.mark.parametrize(("text", "message"), [
    ('requests = 5\n[[class]]\nname = "a"\nconcurency = 2\n', "[[class]] #1 (a): unknown key 'concurency'"),
    ('requests = 5\n[[class]]\nname = "a"\n', "set 'concurrency' (closed loop) or 'rate'"),
    ('[[class]]\nconcurrency = 1\n', "set 'duration' or 'requests'"),
    ('requests = 5\n[[class]]\nconcurrency = "two"\n', "'concurrency' must be int"),
    ('requests = 5\n[[class]]\nconcurrency = 1\napi_key_env = "NOPE_KEY"\n', "NOPE_KEY is not set"),
    ('requests = 5\nrate = [\n', "s.toml: "),
])
def test_scenario_errors_name_the_key(tmp_path: Path, text: str, message: str):
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError) as err:
        load_scenario(path, Workload(), env={})
    assert message in str(err.value) and str(path) in str(err.value)


def test_share_level_splits_concurrency_requests_and_rate():
    closed = TrafficClass(None, Workload(), concurrency=5, requests=50)
    shares = [share_level(Level((closed,), concurrency=5), j, 2).classes[0] for j in range(2)]
    assert [s.concurrency for s in shares] == [3, 2]
    assert sum(s.requests for s in shares) == 50
    opened = TrafficClass(None, Workload(), rate=9.0, requests=31)
    parts = [share_level(Level((opened,), rate=9.0), j, 3).classes[0] for j in range(3)]
    assert all(p.rate == 3.0 for p in parts) and sum(p.requests for p in parts) == 31
    few = TrafficClass(None, Workload(), concurrency=1, requests=10)
    split = [share_level(Level((few,)), j, 2).classes[0] for j in range(2)]
    assert [(s.concurrency, s.requests) for s in split] == [(1, 10), (0, 0)]
