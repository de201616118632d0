"""Priorities and preemption hold on another box's replica: the team's gateway (root namespace)
suspends a batch stream running on a box (its own passerelle and the real llama-server, 2 slots,
in a network namespace) for an interactive request, and resumes it there as a continuation; the
batch client reads one unbroken stream of the length it asked for."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import orjson
import pytest

from passerelle.runtimes.embedded import DEFAULT_MODEL_ID
from passerelle.testing.netns import Network, available
from tests.integration.boxes_support import boxes_config, llama_box_config, start_box
from tests.waiting import wait_until

pytestmark = pytest.mark.llama
MODEL = DEFAULT_MODEL_ID
CENTRAL = """
[auth]
anonymous_max_priority = "interactive"
[scheduler]
min_run_s = 0.5
"""


class Stream:
    def __init__(self, url: str, body: dict, priority: str) -> None:
        self.url, self.body, self.priority = url, body, priority
        self.events: list[dict | str] = []
        self.status, self.request_id = 0, ""
        self.stop = False  # the client leaves at its next event

    def run(self) -> Stream:
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=self.body, timeout=300,
                          headers={"X-Priority": self.priority}) as r:
            self.status, self.request_id = r.status_code, r.headers.get("x-request-id", "")
            for line in r.iter_lines():
                if self.stop:
                    break
                if line.startswith("data: "):
                    self.events.append("[DONE]" if line == "data: [DONE]" else orjson.loads(line[6:]))
        return self

    @property
    def chunks(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict)]

    def contents(self) -> list[str]:
        return [e["choices"][0]["delta"]["content"] for e in self.chunks
                if e.get("choices") and e["choices"][0]["delta"].get("content")]


def story(words: str, max_tokens: int) -> dict:
    return {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0, "seed": 42,
            "ignore_eos": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"{words} {time.time_ns()}: write a long story about it."}]}


def test_a_batch_stream_on_a_box_is_suspended_for_an_interactive_request_and_resumed_there(gateway, tmp_path):
    assert available() == ""
    with Network("bq", boxes=1) as net:
        (box,) = net.boxes
        start_box(box, tmp_path / "boxes", llama_box_config(net))
        gw = gateway(CENTRAL + boxes_config(net))
        replica = f"{box.name}/{MODEL}"
        batch = [Stream(gw.url, story(words, 64), "batch") for words in ("A sailor", "A lighthouse keeper")]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            done = [pool.submit(s.run) for s in batch]
            # both slots of the box busy with batch streams under way
            wait_until(lambda: all(len(s.contents()) >= 8 for s in batch), 120, what="both batch streams under way")
            chat = Stream(gw.url, {"model": MODEL, "stream": True, "max_tokens": 4,
                                   "messages": [{"role": "user", "content": f"Hello {time.time_ns()}"}]},
                          "interactive").run()
            for d in done:
                d.result(300)
        chat_rec = gw.log_for(chat.request_id)
        assert chat.status == 200 and chat_rec["backend"] == replica and chat_rec["queue_ms"] < 5000
        recs = [gw.log_for(s.request_id) for s in batch]
        # one of them (the one that had sent fewer tokens) was cut for it, and resumed on the box
        cut = [s for s, rec in zip(batch, recs, strict=True) if rec.get("suspensions", 0) >= 1]
        assert len(cut) >= 1, recs
        for s, rec in zip(batch, recs, strict=True):
            assert rec["backend"] == replica and rec["cause"] == "ok", rec
            # each one well-formed stream: one id, the end once, every token asked for, usage once
            assert s.status == 200 and s.events[-1] == "[DONE]"
            assert len({c["id"] for c in s.chunks}) == 1
            assert sum(1 for c in s.chunks if c.get("choices") and c["choices"][0].get("finish_reason")) == 1
            assert len(s.contents()) == 64 and s.chunks[-1]["usage"]["completion_tokens"] == 64
