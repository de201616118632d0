"""The Batch API on a real gateway process in front of ``passerelle fake-backend``: the openai
SDK's files and batches flow, and the crash test: the gateway is killed with SIGKILL in the middle
of a batch, started again on the same state, and the output is checked line by line (each
``custom_id`` exactly once, in the input's order, each answered 200)."""

from __future__ import annotations

import io
import signal
import time

import orjson

from tests.conftest import wait_until

LINES = 1500


def config(url: str, extra: str = "") -> str:
    return f"""
    [[backends]]
    name = "fake"
    kind = "openai"
    url = "{url}"
    models = ["fake-model"]
    max_concurrency = 16

    [batches]
    in_flight_per_batch = 16
    in_flight_per_key = 16
    {extra}
    """


def batch_input(n: int) -> bytes:
    return b"".join(orjson.dumps({"custom_id": f"line-{i:05d}", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": "fake-model", "max_tokens": 3,
                                           "messages": [{"role": "user", "content": f"number {i}"}]}}) + b"\n"
                    for i in range(n))


def test_openai_sdk_files_and_batches_flow(gateway, fake_backend):
    fake = fake_backend(ttft_ms=2, itl_ms=1, slots=16)
    gw = gateway(config(fake.url))
    client = gw.openai()
    f = client.files.create(file=("in.jsonl", io.BytesIO(batch_input(20))), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(batch_input(20))
    assert client.files.retrieve(f.id).filename == "in.jsonl"
    assert [x.id for x in client.files.list()] == [f.id]
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"run": "sdk"})
    assert b.status == "in_progress" and b.metadata == {"run": "sdk"}
    wait_until(lambda: client.batches.retrieve(b.id).status == "completed", 60, what="the batch to complete")
    done = client.batches.retrieve(b.id)
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (20, 0)
    assert done.output_file_id is not None
    out = [orjson.loads(x) for x in client.files.content(done.output_file_id).content.splitlines()]
    assert [o["custom_id"] for o in out] == [f"line-{i:05d}" for i in range(20)]
    assert [x.id for x in client.batches.list()] == [b.id]
    # a second batch, cancelled by the SDK
    b2 = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    c = client.batches.cancel(b2.id)
    assert c.status in ("cancelling", "cancelled", "completed")
    wait_until(lambda: client.batches.retrieve(b2.id).status in ("cancelled", "completed"), 60, what="cancel")
    assert client.files.delete(done.output_file_id).deleted


def test_a_gateway_killed_mid_batch_resumes_and_answers_each_line_exactly_once(gateway, fake_backend):
    fake = fake_backend(ttft_ms=3, itl_ms=1, slots=16)
    text = config(fake.url)
    gw = gateway(text)
    client = gw.openai()
    f = client.files.create(file=("in.jsonl", io.BytesIO(batch_input(LINES))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    def answered() -> int:
        counts = client.batches.retrieve(b.id).request_counts
        return counts.completed if counts is not None else 0

    wait_until(lambda: answered() >= LINES // 4, 60, what="a quarter of the batch answered")
    gw.proc.send_signal(signal.SIGKILL)
    gw.proc.wait(10)
    before = time.monotonic()
    again = gateway(text)  # the same configuration: the same state directory
    client = again.openai()
    wait_until(lambda: client.batches.retrieve(b.id).status == "completed", 120, what="the resumed batch")
    done = client.batches.retrieve(b.id)
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (LINES, LINES, 0)
    assert done.error_file_id is None and done.output_file_id is not None
    out = [orjson.loads(x) for x in client.files.content(done.output_file_id).content.splitlines()]
    assert len(out) == LINES
    for i, o in enumerate(out):  # line by line: each custom_id once, in order, answered
        assert o["custom_id"] == f"line-{i:05d}" and o["response"]["status_code"] == 200 and o["error"] is None
    assert len({o["id"] for o in out}) == LINES
    # the restarted gateway ran only what was not answered before the kill (and the few in flight)
    rerun = [line for line in again.access_log() if line.get("client") == "batch"]
    assert len(rerun) <= LINES - LINES // 4 + 16 + 16, (len(rerun), time.monotonic() - before)
