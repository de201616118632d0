"""The continuation of a suspended stream and the splice of its attempts (proxy/resume.py), on the
event shapes llama-server and vLLM stream (llama-server's continued message repeated at the start
of the continuation, its per-token ``timings``; vLLM's continuous usage)."""

from __future__ import annotations

import orjson
import pytest

from passerelle.proxy.resume import Splice, suspendable


class FakeResp:
    closed = False

    def close(self) -> None:
        self.closed = True


class Client:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, message) -> None:
        self.bodies.append(message.get("body", b""))

    def events(self) -> list[dict | str]:
        out: list[dict | str] = []
        for line in b"".join(self.bodies).split(b"\n"):
            if line.startswith(b"data: "):
                payload = line[6:]
                out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
        return out

    def text(self) -> str:
        parts = []
        for e in self.events():
            if isinstance(e, dict) and e.get("choices"):
                ch = e["choices"][0]
                parts.append((ch.get("delta") or {}).get("content") or ch.get("text") or "")
        return "".join(parts)


def ev(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_chunk(cid: str, content=None, *, role=False, finish=None, timings=None):
    delta = {"role": "assistant", "content": None} if role else ({"content": content} if content is not None else {})
    obj = {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], "created": 100 if cid == "A" else 200,
           "id": f"chatcmpl-{cid}", "model": "m", "object": "chat.completion.chunk"}
    if timings:
        obj["timings"] = timings
    return obj


def timings(prompt_n, cache_n, predicted_n):
    return {"prompt_n": prompt_n, "cache_n": cache_n, "predicted_n": predicted_n, "prompt_ms": 1.0}


def usage_chunk(cid: str, prompt, completion):
    return {"choices": [], "created": 1, "id": f"chatcmpl-{cid}", "model": "m", "object": "chat.completion.chunk",
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": 0}}}


DATA = {"model": "m", "stream": True, "max_tokens": 10, "temperature": 0,
        "messages": [{"role": "user", "content": "Tell a story."}]}


async def test_a_chat_stream_cut_and_continued_on_llama_server_is_one_stream_with_true_usage():
    client = Client()
    splice = Splice(DATA, "chat")
    first = splice.request_data("llama-server")
    assert first["timings_per_token"] is True and first["messages"] == DATA["messages"]
    send = splice.watch(FakeResp(), client, "llama-server")
    await send({"type": "http.response.body", "more_body": True, "body": ev(chat_chunk("A", role=True))
                + ev(chat_chunk("A", "Once", timings=timings(12, 0, 1)))})
    await send({"type": "http.response.body", "more_body": True,
                "body": ev(chat_chunk("A", " upon", timings=timings(12, 0, 2)))
                + ev(chat_chunk("A", " a", timings=timings(12, 0, 3)))})
    assert splice.suspend() is True
    # after the cut: what the runtime still sent is not the client's (the continuation makes it again)
    await send({"type": "http.response.body", "more_body": True, "body": ev(chat_chunk("A", " time"))})
    splice.resumed()

    cont = splice.request_data("llama-server")
    assert cont["messages"][-1] == {"role": "assistant", "content": "Once upon a"}
    assert cont["continue_final_message"] is True and cont["add_generation_prompt"] is False
    assert cont["max_tokens"] == 7  # 10 less the 3 already sent
    send = splice.watch(FakeResp(), client, "llama-server")
    # llama-server repeats the continued message at the start of its first delta
    await send({"type": "http.response.body", "more_body": True, "body": ev(chat_chunk("B", role=True))
                + ev(chat_chunk("B", "Once upon a time", timings=timings(1, 15, 1)))})
    await send({"type": "http.response.body", "more_body": True,
                "body": ev(chat_chunk("B", ",", timings=timings(1, 15, 2)))
                + ev(chat_chunk("B", finish="stop")) + ev(usage_chunk("B", 15, 2)) + b"data: [DONE]\n\n"})

    events = client.events()
    assert client.text() == "Once upon a time,"
    dicts = [e for e in events if isinstance(e, dict)]
    assert {e["id"] for e in dicts} == {"chatcmpl-A"} and {e["created"] for e in dicts if e["choices"]} == {100}
    assert sum(1 for e in dicts if e["choices"] and "role" in e["choices"][0]["delta"]) == 1
    assert not any("timings" in e for e in dicts if e["choices"])  # asked for by passerelle, not the client
    assert events[-1] == "[DONE]"
    usage = dicts[-1]["usage"]
    # the original prompt once (12), every generated token once (3 + 2)
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (12, 5, 17)
    assert splice.totals(15, 2) == (12, 5)
    assert (splice.resume_prompt_processed, splice.resume_prompt_cached) == (1, 15)


async def test_a_continuation_that_does_not_repeat_the_message_loses_nothing():
    client = Client()
    splice = Splice(DATA, "chat")
    send = splice.watch(FakeResp(), client, "llama-server")
    await send({"body": ev(chat_chunk("A", role=True)) + ev(chat_chunk("A", "Once")), "more_body": True})
    splice.suspend()
    splice.resumed()
    splice.request_data("llama-server")
    send = splice.watch(FakeResp(), client, "llama-server")  # an older llama-server: new tokens only
    await send({"body": ev(chat_chunk("B", " upon")) + ev(chat_chunk("B", " a time")), "more_body": True})
    assert client.text() == "Once upon a time"
    assert splice.totals(9, 2) == (8, 3)  # no counts per event: the prompt grew by what was sent


async def test_completions_continue_the_prompt_and_vllm_counts_come_from_continuous_usage():
    data = {"model": "m", "prompt": "The river", "max_tokens": 8, "stream": True}
    client = Client()
    splice = Splice(data, "completions")
    first = splice.request_data("vllm")
    assert first["stream_options"] == {"continuous_usage_stats": True}

    def chunk(cid, text, used, finish=None):
        return {"id": cid, "created": 5, "object": "text_completion",
                "choices": [{"index": 0, "text": text, "finish_reason": finish}],
                "usage": {"prompt_tokens": 2 if cid == "A" else 4, "completion_tokens": used}}

    send = splice.watch(FakeResp(), client, "vllm")
    await send({"body": ev(chunk("A", " carried", 1)) + ev(chunk("A", " boats", 2)), "more_body": True})
    assert splice.suspend()
    splice.resumed()
    cont = splice.request_data("vllm")
    assert cont["prompt"] == "The river carried boats" and cont["max_tokens"] == 6
    assert "continue_final_message" not in cont
    send = splice.watch(FakeResp(), client, "vllm")
    await send({"body": ev(chunk("B", " past", 1)) + ev(chunk("B", "", 1, finish="length")), "more_body": True})
    assert client.text() == " carried boats past"
    assert all("usage" not in e for e in client.events() if isinstance(e, dict))
    assert splice.totals(4, 1) == (2, 3)


async def test_what_cannot_be_continued_is_not_suspended():
    splice = Splice(DATA, "chat")
    assert splice.suspend() is False  # no attempt running
    client = Client()
    send = splice.watch(FakeResp(), client, "llama-server")
    await send({"body": ev(chat_chunk("A", "x", timings=timings(3, 0, 7))), "more_body": True})
    assert splice.suspend() is False  # 3 tokens left of 10: it ends by itself
    splice2 = Splice(DATA, "chat")
    send = splice2.watch(FakeResp(), client, "llama-server")
    tool = chat_chunk("A")
    tool["choices"][0]["delta"] = {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}
    await send({"body": ev(tool), "more_body": True})
    assert splice2.suspend() is False  # tool calls in the output
    splice3 = Splice(DATA, "chat")
    send = splice3.watch(FakeResp(), client, "llama-server")
    await send({"body": ev(chat_chunk("A", "caf\ufffd")), "more_body": True})
    assert splice3.suspend() is False  # bytes that were no text: the continuation cannot give them back


@pytest.mark.parametrize(("extra", "ok"), [
    ({}, True),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, False),
    ({"tools": []}, True),
    ({"response_format": {"type": "json_object"}}, False),
    ({"grammar": "root ::= \"a\""}, False),
    ({"n": 2}, False),
    ({"n": 1}, True),
    ({"logprobs": True}, False),
    ({"logprobs": False}, True),
    ({"frequency_penalty": 0.5}, False),
    ({"repeat_penalty": 1.0}, True),
])
def test_suspendable_requests(extra, ok):
    assert suspendable({**DATA, **extra}, "chat") is ok


def test_suspendable_prompts_and_endpoints():
    assert suspendable({"model": "m", "prompt": "x"}, "completions")
    assert not suspendable({"model": "m", "prompt": ["x", "y"]}, "completions")
    assert not suspendable({"model": "m", "input": "x"}, "embeddings")
    parts = {"model": "m", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [{}]}]}
    assert not suspendable(parts, "chat")


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])  # llama-server and older vLLM; vLLM >= 0.16
async def test_a_stream_that_produced_reasoning_is_never_suspended(field):
    client = Client()
    plain = Splice(DATA, "chat")
    send = plain.watch(FakeResp(), client, "llama-server")
    await send({"body": ev(chat_chunk("A", "x", timings=timings(3, 0, 1))), "more_body": True})
    assert plain.suspend() is True  # the same stream without reasoning may be cut
    splice = Splice(DATA, "chat")
    send = splice.watch(FakeResp(), client, "llama-server")
    think = chat_chunk("A")
    think["choices"][0]["delta"] = {field: "Let me think"}
    await send({"body": ev(think), "more_body": True})
    await send({"body": ev(chat_chunk("A", "x", timings=timings(3, 0, 2))), "more_body": True})
    assert splice.suspend() is False  # the continuation would lose the reasoning


async def test_a_stream_says_when_it_ends_by_itself_at_its_own_pace(monkeypatch):
    """left_s: the tokens left at the attempt's pace, what the scheduler weighs before cutting a
    stream (a slot about to free by itself is waited for instead)."""
    import math

    from passerelle.proxy import resume

    now = [100.0]
    monkeypatch.setattr(resume.time, "monotonic", lambda: now[0])
    splice = Splice(DATA, "chat")  # max_tokens 10
    send = splice.watch(FakeResp(), Client(), "llama-server")
    await send({"type": "http.response.body", "body": ev(chat_chunk("A", role=True))
                + ev(chat_chunk("A", "Once", timings=timings(12, 0, 1)))})
    assert splice.left_s == math.inf  # one token: no pace yet
    for n, word in ((2, " upon"), (3, " a"), (4, " time")):
        now[0] += 0.05
        await send({"type": "http.response.body", "body": ev(chat_chunk("A", word, timings=timings(12, 0, n)))})
    assert splice.left_s == pytest.approx(6 * 0.05)  # 6 tokens left, 50 ms each
    now[0] += 0.02
    assert splice.left_s == pytest.approx(6 * 0.05 - 0.02)  # from its latest token: it falls with time
    now[0] -= 0.02
    assert splice.suspend() is True
    splice.resumed()
    splice.watch(FakeResp(), Client(), "llama-server")
    assert splice.left_s == math.inf  # a new attempt, a new pace (it may run beside other work)
    unbounded = Splice({**DATA, "max_tokens": None}, "chat")
    send = unbounded.watch(FakeResp(), Client(), "llama-server")
    for n in (1, 2, 3):
        now[0] += 0.05
        await send({"type": "http.response.body", "body": ev(chat_chunk("A", "x", timings=timings(12, 0, n)))})
    assert unbounded.left_s == math.inf  # no max_tokens: its end is not in sight
