"""Prompts (nonce, shared prefix), multi-turn chats, scenario files, traces, target specs, URLs and the
split of load over processes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from passerelle.bench.processes import share_level
from passerelle.bench.runner import Level
from passerelle.bench.target import TargetSpec, normalize_url, parse_target
from passerelle.bench.trace import TraceEntry
from passerelle.bench.workload import (
    TARGET_STRIDE,
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


def test_a_nonce_makes_every_run_s_prompts_new_and_keeps_the_lengths():
    run1, run2 = Workload(prompt_tokens=64, nonce="a1b2c3d4"), Workload(prompt_tokens=64, nonce="0f0f0f0f")
    for i in range(50):
        b1, _ = Conversation(run1, i, "m").next_body()
        b2, _ = Conversation(run2, i, "m").next_body()
        t1, t2 = b1["messages"][0]["content"], b2["messages"][0]["content"]
        # they differ from the tag on, the second word of the prompt: nothing to reuse from a cache
        assert t1.split()[0] == t2.split()[0] == "Story" and t1.split()[1] != t2.split()[1]
        assert len(t1.split()) == len(t2.split())  # same lengths: runs stay comparable
    # with the same nonce (or an explicit seed and none), prompts repeat exactly
    assert Conversation(run1, 3, "m").next_body() == Conversation(run1, 3, "m").next_body()


def test_targets_of_a_compare_get_the_same_lengths_and_their_own_text():
    w = Workload(prompt_tokens=100, prompt_spread=40, max_tokens=20, max_tokens_spread=10, tokens_per_word=1.0,
                 prompt_overhead=0)
    for i in range(20):
        a, mt_a = Conversation(w, i, "m").next_body()
        b, mt_b = Conversation(w, TARGET_STRIDE + i, "m").next_body()
        assert words_of(a) == words_of(b) and mt_a == mt_b
        assert a["messages"][0]["content"] != b["messages"][0]["content"]


def test_prefix_share_puts_one_passage_before_every_prompt_of_a_target():
    w = Workload(prompt_tokens=212, tokens_per_word=2.0, prompt_overhead=12, prefix_share=0.5, nonce="n")
    texts = [Conversation(w, i, "m").next_body()[0]["messages"][0]["content"] for i in range(5)]
    shared = texts[0].split("\n\n")[0]
    assert len(shared.split()) == 2 + 50  # "Story TAG:" and half of the 100 words
    assert all(t.startswith(shared + "\n\n") for t in texts)
    own = {t.split("\n\n")[1] for t in texts}
    assert len(own) == 5  # the rest of each prompt is its own
    assert all(len(t.split()) == 100 + 4 + 7 for t in texts)  # same total length, two tags, the instruction
    other_target = Conversation(w, TARGET_STRIDE, "m").next_body()[0]["messages"][0]["content"]
    assert not other_target.startswith(shared)  # each target pays for its own shared passage once
    later = Conversation(replace(w, turns=2), 0, "m")
    later.next_body()
    second, _ = later.next_body()
    assert second["messages"][-1]["content"].count("Story ") == 1  # the passage opens the chat, not every turn


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
    assert parse_target("vulkan=http://h:8081/v1") == TargetSpec("vulkan", "http://h:8081")
    with pytest.raises(ValueError):
        parse_target("http://h:8081")


def test_target_specs_carry_their_own_key_model_and_pid():
    spec = parse_target("vllm=http://h:8000/v1,key=VLLM_KEY,model=qwen2.5-7b,pid=4242")
    assert spec == TargetSpec("vllm", "http://h:8000", key_env="VLLM_KEY", model="qwen2.5-7b", pid=4242)
    assert spec.api_key("shared", env={"VLLM_KEY": "sk-vllm"}) == "sk-vllm"
    assert parse_target("a=http://h").api_key("shared", env={}) == "shared"  # --api-key for the rest
    with pytest.raises(ValueError, match="VLLM_KEY"):
        spec.api_key(None, env={})
    for bad in ("a=http://h,key", "a=http://h,colour=red", "a=http://h,pid=x", "a=http://h,model=a,model=b"):
        with pytest.raises(ValueError):
            parse_target(bad)


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
    ('requests = 5\n[[class]]\nname = "a"\n', "set 'concurrency' (closed loop), 'rate' (requests/s) or 'trace'"),
    ('requests = 5\n[[class]]\ntrace = "none.jsonl"\n', "'trace': "),
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


def test_scenario_class_replays_a_trace(tmp_path: Path):
    (tmp_path / "week.jsonl").write_text('{"t": 5.0, "prompt_tokens": 300, "output_tokens": 20}\n'
                                         '{"t": 5.5, "prompt_tokens": 40, "output_tokens": 200, "tenant": "x"}\n')
    path = tmp_path / "s.toml"
    path.write_text('[[class]]\nname = "replay"\ntrace = "week.jsonl"\ntrace_speed = 2\nconcurrency = 8\n')
    (cls,) = load_scenario(path, Workload(), env={}).classes
    assert cls.trace == (TraceEntry(0.0, 300, 20), TraceEntry(0.5, 40, 200))  # shifted to start at 0
    assert cls.trace_speed == 2.0 and cls.requests == 2 and cls.concurrency == 8 and cls.rate is None


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
    traced = TrafficClass(None, Workload(), trace=tuple(TraceEntry(k * 0.1, 10, 5) for k in range(5)), requests=5)
    halves = [share_level(Level((traced,)), j, 2).classes[0] for j in range(2)]
    assert [len(h.trace) for h in halves] == [3, 2] and halves[1].trace[0].t == pytest.approx(0.1)
