"""Preemption in front of a real vLLM (the tiny local Llama, one sequence at a time): a batch stream
cut for an interactive request continues with ``continue_final_message``, its client gets one
stream with the usage of one request, and at temperature 0 the text an uninterrupted run gives up
to the cut, then the text vLLM gives when asked to continue that text itself. (Not the uninterrupted
text to the end: vLLM computes a continued text's cache anew in one prefill, in bfloat16, and that
is not bit for bit what decoding token by token left; where two words of the random model score
within its rounding, the continuation takes the other one.)

The tiny model's weights are random: left alone it emits byte tokens that are no valid UTF-8 (the
client sees U+FFFD, and such a stream is never suspended, since its text cannot be given back), and
words in pieces its tokenizer would not make. ``logit_bias`` keeps it to whole words, so the stream
is text a continuation can carry on."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from passerelle.testing import vllm_setup
from tests.conftest import Gateway, free_port, http_ok, wait_until
from tests.integration.test_preemption_llama import Stream

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MODEL = vllm_setup.MODEL_ID


@pytest.fixture(scope="module")
def vgw(tmp_path_factory) -> Iterator[Gateway]:
    paths = vllm_setup.ensure()
    tmp = tmp_path_factory.mktemp("vllm-preempt")
    backend = vllm_setup.backend_toml(paths, tmp, name="vllm", priority=False, max_concurrency=1,
                                      log_file=tmp / "vllm.log", extra=("--max-num-seqs", "1"))
    cfg = tmp / "gateway.toml"
    cfg.write_text('[auth]\nanonymous_max_priority = "interactive"\n[scheduler]\nmin_run_s = 0.5\n' + backend)
    port = free_port()
    log_path = tmp / "gateway.log"
    with open(log_path, "wb") as logf:
        cmd = [sys.executable, "-m", "passerelle", "serve", "--config", str(cfg), "--port", str(port)]
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "PASSERELLE_STATE": str(tmp / "state")})
    gw = Gateway(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path, model=MODEL)
    try:
        wait_until(lambda: proc.poll() is None and http_ok(gw.url + "/ready"), 600, interval=1.0,
                   what="the gateway with vLLM ready")
        yield gw
    finally:
        gw.stop(timeout=60)


def word_bias() -> dict[str, int]:
    """-100 for every token but a space and a word of ASCII letters (" gateway"): the stream's text
    then reads back as the tokens that made it. The model's weights are random, so it may emit a
    word in pieces no tokenizer would make ("gin" + "eng"); a continuation gives the runtime that
    text, tokenized its own way, and a random model goes elsewhere from there. A real model emits
    what its tokenizer makes; the test keeps the splice's behaviour apart from that."""
    vocab = json.loads((vllm_setup.ensure().model / "tokenizer.json").read_text())["model"]["vocab"]
    return {str(i): -100 for token, i in vocab.items()
            if not (token.startswith("\u0120") and len(token) > 2 and token[1:].isascii() and token[1:].isalpha())}


def body(max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0, "seed": 1,
            "ignore_eos": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Tell me about the gateway {time.time_ns()}."}], **extra}


def test_a_vllm_batch_stream_is_cut_and_continued_as_one_stream(vgw):
    target = body(300, logit_bias=word_bias())  # about 2 s: the interactive request comes mid-way
    alone = Stream(vgw.url, target, "batch").run()
    assert alone.status == 200 and len(alone.contents()) > 0
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        cut = Stream(vgw.url, target, "batch")
        done = pool.submit(cut.run)
        wait_until(lambda: len(cut.contents()) >= 8, 300, what="the batch stream under way")
        chat = Stream(vgw.url, {**body(3), "messages": [{"role": "user", "content": "Hi"}]}, "interactive").run()
        done.result(600)
    rec = vgw.log_for(cut.request_id)
    assert rec["suspensions"] == 1 and rec["cause"] == "ok" and chat.status == 200
    assert len({c["id"] for c in cut.chunks}) == 1 and cut.events[-1] == "[DONE]"
    assert sum(1 for c in cut.chunks if c.get("choices") and "role" in c["choices"][0]["delta"]) == 1
    assert all("usage" not in c for c in cut.chunks if c.get("choices"))  # asked per chunk by passerelle only
    usage, ref = cut.chunks[-1]["usage"], alone.chunks[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (ref["prompt_tokens"], ref["completion_tokens"])
    (at,) = rec["suspended_at_tokens"]  # one content event per token: the text so far is its first `at`
    before = "".join(cut.contents()[:at])
    assert 8 <= at < 300 - 4 and before == "".join(alone.contents()[:at])
    ask = {**target, "messages": [*target["messages"], {"role": "assistant", "content": before}],
           "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 300 - at}
    itself = Stream(vgw.url, ask, "batch").run()
    assert itself.status == 200 and cut.text == before + itself.text
    stats = httpx.get(vgw.url + "/admin/stats").json()["preemption"]
    assert stats["suspended"] == 1 and stats["resumed"] == 1
