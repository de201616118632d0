"""Preemption against the real llama-server (2 slots): a batch stream cut for an interactive request
resumes on the slot it left, its client gets one well-formed stream, and with temperature 0 and
a seed the text is the one an uninterrupted run gives; a request with tools is never cut."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from tests.conftest import MODEL_ID, start_llama, wait_until

pytestmark = pytest.mark.llama



def config(url: str) -> str:
    """Preemption at its defaults (min_run_s shorter: the test is short; preempt_after_ms longer,
    so that a request that waited it shows); no max_concurrency: llama-server reports its 2 slots."""
    return f"""
    [auth]
    anonymous_max_priority = "interactive"
    [scheduler]
    min_run_s = 0.5
    preempt_after_ms = 300
    [[backends]]
    name = "b1"
    kind = "llama-server"
    url = "{url}"
    models = ["{MODEL_ID}"]
    """


@pytest.fixture(scope="module")
def llama2(llama_paths, tmp_path_factory):
    binary, model = llama_paths
    server = start_llama(binary, model, tmp_path_factory.mktemp("llama2") / "llama-server.log", slots=2)
    yield server
    server.stop()


class Stream:
    """A streamed chat request on a thread; what its client received."""

    def __init__(self, url: str, body: dict, priority: str) -> None:
        self.url, self.body, self.priority = url, body, priority
        self.events: list[dict | str] = []
        self.status = 0
        self.request_id = ""

    def run(self) -> Stream:
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=self.body, timeout=300,
                          headers={"X-Priority": self.priority}) as r:
            self.status, self.request_id = r.status_code, r.headers.get("x-request-id", "")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        return self

    @property
    def chunks(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict)]

    def contents(self) -> list[str]:
        return [e["choices"][0]["delta"]["content"] for e in self.chunks
                if e.get("choices") and e["choices"][0]["delta"].get("content")]

    @property
    def text(self) -> str:
        return "".join(self.contents())


def story(words: str, max_tokens: int, **extra) -> dict:
    return {"model": MODEL_ID, "stream": True, "max_tokens": max_tokens, "temperature": 0, "seed": 42,
            "ignore_eos": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"{words} {time.time_ns()}: write a long story about it."}],
            **extra}


def test_a_batch_stream_is_cut_resumed_on_its_slot_and_reads_as_if_uninterrupted(llama2, gateway):
    gw = gateway(config(llama2.url))
    target = story("A lighthouse keeper", 48)
    alone = Stream(gw.url, target, "batch").run()  # the uninterrupted reference, same prompt
    assert alone.status == 200 and len(alone.contents()) == 48

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        other = pool.submit(Stream(gw.url, story("A sailor", 96), "batch").run)
        wait_until(lambda: httpx.get(llama2.url + "/slots").json()[0]["is_processing"]
                   or httpx.get(llama2.url + "/slots").json()[1]["is_processing"], 60, what="the other stream")
        cut = Stream(gw.url, target, "batch")
        cut_done = pool.submit(cut.run)
        wait_until(lambda: len(cut.contents()) >= 10, 120, what="the batch stream under way")
        chat = Stream(gw.url, {"model": MODEL_ID, "stream": True, "max_tokens": 4,
                               "messages": [{"role": "user", "content": f"Hello {time.time_ns()}"}]}, "interactive")
        chat.run()
        # the continuation, seen in llama-server's /slots while it runs: its prompt (the original
        # one plus the text so far) mostly from the slot's cache
        during = wait_until(lambda: next((s for s in httpx.get(llama2.url + "/slots").json()
                                          if s["is_processing"] and s["n_prompt_tokens_cache"] > 0
                                          and s["n_prompt_tokens"] > alone.chunks[-1]["usage"]["prompt_tokens"]),
                                         None) or cut_done.done(), 120, what="the continuation in /slots")
        cut_done.result(300)
        other.result(300)

    rec = gw.log_for(cut.request_id)
    chat_rec = gw.log_for(chat.request_id)
    assert rec["suspensions"] == 1 and rec["cause"] == "ok"
    # the interactive request ran in the slot the batch stream left, which came back to it after;
    # it was sent the moment the cut was (no stream was about to end: nothing to wait for), not
    # after preempt_after_ms, and llama-server queued it until the cut stream let the slot go
    assert chat_rec["slot"] == rec["slot"] and chat_rec["queue_ms"] < 300
    # one well-formed stream: one id, one role chunk, the end once, usage of the original request
    assert cut.status == 200 and cut.events[-1] == "[DONE]"
    assert len({c["id"] for c in cut.chunks}) == 1
    assert sum(1 for c in cut.chunks if c.get("choices") and "role" in c["choices"][0]["delta"]) == 1
    assert sum(1 for c in cut.chunks if c.get("choices") and c["choices"][0].get("finish_reason")) == 1
    usage = cut.chunks[-1]["usage"]
    ref_usage = alone.chunks[-1]["usage"]
    assert usage["prompt_tokens"] == ref_usage["prompt_tokens"] and usage["completion_tokens"] == 48
    assert len(cut.contents()) == 48
    # The continuation ran in the slot the stream left, its prompt mostly from that slot's cache:
    # Gemma 3's sliding-window cache goes back only to a checkpoint a few tokens before the end of
    # the original prompt, so those few and the text so far are computed again, never the whole.
    assert isinstance(during, dict), "the continuation was not seen running"
    assert during["id"] == rec["slot"]
    assert during["n_prompt_tokens_cache"] >= ref_usage["prompt_tokens"] - 8
    assert 0 < rec["resume_prompt_tokens"] < 48 + 8  # the text so far and a few: not the original prompt
    # afterwards that slot holds the whole answer: both attempts' text, one after the other
    after = httpx.get(llama2.url + "/slots").json()[rec["slot"]]
    assert after["n_prompt_tokens"] >= ref_usage["prompt_tokens"] + 47
    # temperature 0 and a seed: the text reads as the uninterrupted one
    assert cut.text == alone.text, f"differs after {_common(cut.text, alone.text)} characters"


def _common(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_a_request_with_tools_is_never_suspended(llama2, gateway):
    # (this GGUF's template drops tools: the entry says the model takes them, so that they reach it)
    gw = gateway(config(llama2.url) + f'[[models]]\nname = "{MODEL_ID}"\ncapabilities = ["chat", "tools"]\n')
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        batch = [Stream(gw.url, story(f"Tools {i}", 24, tools=tools), "batch") for i in range(2)]
        done = [pool.submit(s.run) for s in batch]
        wait_until(lambda: all(len(s.contents()) >= 2 for s in batch), 120, what="both batch streams under way")
        chat = Stream(gw.url, {"model": MODEL_ID, "stream": True, "max_tokens": 2,
                               "messages": [{"role": "user", "content": "Hi"}]}, "interactive").run()
        for d in done:
            d.result(300)
    recs = [gw.log_for(s.request_id) for s in batch]
    assert all("suspensions" not in r and r["cause"] == "ok" for r in recs)
    assert chat.status == 200
    # it waited for a batch stream to end instead of cutting one
    assert gw.log_for(chat.request_id)["queue_ms"] > 100
    stats = httpx.get(gw.url + "/admin/stats").json()["preemption"]
    assert stats["suspended"] == 0 and stats["enabled"]
