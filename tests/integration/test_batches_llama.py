"""The openai SDK's files and batches flow through passerelle in front of a real llama-server:
upload, create, retrieve until done, the output's answers, list, cancel, delete."""

from __future__ import annotations

import io

import orjson
import pytest

from tests.conftest import MODEL_ID, upstream_config, wait_until

pytestmark = pytest.mark.llama


def batch_input(n: int, url: str = "/v1/chat/completions") -> bytes:
    def body(i: int) -> dict[str, object]:
        if url == "/v1/completions":
            return {"model": MODEL_ID, "prompt": f"Lighthouse number {i}", "max_tokens": 4}
        return {"model": MODEL_ID, "max_tokens": 4, "messages": [{"role": "user", "content": f"Count to {i}."}]}
    return b"".join(orjson.dumps({"custom_id": f"q{i}", "method": "POST", "url": url, "body": body(i)}) + b"\n"
                    for i in range(n))


def test_openai_sdk_batch_flow_on_llama_server(gateway, llama_server):
    gw = gateway(upstream_config(llama_server.url))
    client = gw.openai()
    f = client.files.create(file=("in.jsonl", io.BytesIO(batch_input(8))), purpose="batch")
    assert f.purpose == "batch" and client.files.retrieve(f.id).bytes == f.bytes
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(b.id).status == "completed", 120, what="the batch to complete")
    done = client.batches.retrieve(b.id)
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (8, 0)
    assert done.output_file_id is not None and done.error_file_id is None
    out = [orjson.loads(x) for x in client.files.content(done.output_file_id).content.splitlines()]
    assert [o["custom_id"] for o in out] == [f"q{i}" for i in range(8)]
    for o in out:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] <= 4
        line = gw.log_for(o["response"]["request_id"])
        assert line["priority"] == "batch" and line["cause"] == "ok" and line["client"] == "batch"
    assert b.id in [x.id for x in client.batches.list()]
    # completions too, and a cancel
    f2 = client.files.create(file=("c.jsonl", io.BytesIO(batch_input(40, "/v1/completions"))), purpose="batch")
    b2 = client.batches.create(input_file_id=f2.id, endpoint="/v1/completions", completion_window="1h")
    assert client.batches.cancel(b2.id).status in ("cancelling", "cancelled", "completed")
    wait_until(lambda: client.batches.retrieve(b2.id).status in ("cancelled", "completed"), 60, what="the cancel")
    ended = client.batches.retrieve(b2.id)
    assert ended.request_counts is not None and ended.request_counts.total == 40
    ids = []
    for fid in (ended.output_file_id, ended.error_file_id):
        if fid:
            ids += [orjson.loads(x)["custom_id"] for x in client.files.content(fid).content.splitlines()]
    assert sorted(ids) == sorted(f"q{i}" for i in range(40))
    assert client.files.delete(f.id).deleted
