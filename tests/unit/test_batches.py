"""The Batch API in process against the fake runtime: files and batches as OpenAI defines them,
validation with line numbers, each limit's error, who sees what, cancel, expiry, quota pause,
resume after a stop, and every line answered exactly once at the batch class."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import orjson
import pytest

from passerelle.config import AdminConfig, BatchesConfig, ClassConfig
from passerelle.errors import Cause
from passerelle.tenants.keys import KeyStore
from passerelle.tenants.quota import parse_quota
from tests import waiting
from tests.inprocess import InProcessGateway, fake_runtime, gateway

BOUNDARY = "passerelle-test-boundary"


def line(cid: str, *, url: str = "/v1/chat/completions", model: str = "fake-model", **body: Any) -> dict[str, Any]:
    payload = {"model": model, "messages": [{"role": "user", "content": f"say {cid}"}], "max_tokens": 4, **body}
    if url == "/v1/embeddings":
        payload = {"model": model, "input": f"text {cid}"}
    return {"custom_id": cid, "method": "POST", "url": url, "body": payload}


def jsonl(rows: list[Any]) -> bytes:
    return b"".join((r if isinstance(r, bytes) else orjson.dumps(r)) + b"\n" for r in rows)


def multipart(content: bytes, purpose: str = "batch", filename: str = "in.jsonl") -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n{purpose}\r\n"
            f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{BOUNDARY}--\r\n".encode()


async def upload(gw: InProcessGateway, content: bytes, key: str | None = None, **kw: Any) -> Any:
    headers = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    return await gw.request("POST", "/v1/files", multipart(content, **kw), headers=headers)


def auth(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


async def create(gw: InProcessGateway, file_id: str, key: str | None = None, endpoint: str = "/v1/chat/completions",
                 window: str = "24h") -> Any:
    return await gw.post("/v1/batches", {"input_file_id": file_id, "endpoint": endpoint, "completion_window": window,
                                         "metadata": {"job": "test"}}, headers=auth(key))


async def completed(gw: InProcessGateway, batch_id: str, n: int) -> bool:
    """At least ``n`` of the batch's lines are completed."""
    return bool((await gw.get(f"/v1/batches/{batch_id}")).json()["request_counts"]["completed"] >= n)


async def settle(gw: InProcessGateway, batch_id: str, key: str | None = None, timeout: float = 20.0,
                 until: tuple[str, ...] = ("completed", "failed", "expired", "cancelled")) -> dict[str, Any]:
    async def ended() -> dict[str, Any] | None:
        doc = (await gw.get(f"/v1/batches/{batch_id}", headers=auth(key))).json()
        return doc if doc["status"] in until else None  # type: ignore[no-any-return]

    return await waiting.until(ended, timeout, f"batch {batch_id} {' or '.join(until)}", interval=0.02)


async def lines_of(gw: InProcessGateway, file_id: str | None, key: str | None = None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    resp = await gw.get(f"/v1/files/{file_id}/content", headers=auth(key))
    assert resp.status == 200
    return [orjson.loads(x) for x in resp.body.splitlines()]


async def test_files_and_a_chat_batch_end_to_end_each_line_once_at_the_batch_class(tmp_path):
    rows = [line(f"req-{i}") for i in range(12)]
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        up = await upload(gw, jsonl(rows))
        assert up.status == 200, up.body
        f = up.json()
        assert f["object"] == "file" and f["purpose"] == "batch" and f["filename"] == "in.jsonl"
        assert f["bytes"] == len(jsonl(rows))
        assert (await gw.get(f"/v1/files/{f['id']}/content")).body == jsonl(rows)
        assert [x["id"] for x in (await gw.get("/v1/files")).json()["data"]] == [f["id"]]
        made = await create(gw, f["id"])
        assert made.status == 200, made.body
        b = made.json()
        assert b["object"] == "batch" and b["status"] == "in_progress" and b["metadata"] == {"job": "test"}
        done = await settle(gw, b["id"])
        assert done["status"] == "completed" and done["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
        assert done["error_file_id"] is None and done["usage"]["output_tokens"] > 0
        out = await lines_of(gw, done["output_file_id"])
        assert [o["custom_id"] for o in out] == [r["custom_id"] for r in rows]
        assert all(o["response"]["status_code"] == 200 and o["error"] is None and o["id"].startswith("batch_req_")
                   and o["response"]["body"]["object"] == "chat.completion" for o in out)
        batch_lines = [r for r in gw.records if r.endpoint == "chat"]
        assert len(batch_lines) == 12 and {r.priority for r in batch_lines} == {"batch"}
        assert {r.cause for r in batch_lines} == {Cause.OK}
        listed = (await gw.get("/v1/batches")).json()
        assert [x["id"] for x in listed["data"]] == [b["id"]] and listed["has_more"] is False
        assert (await gw.request("DELETE", f"/v1/files/{f['id']}")).json()["deleted"] is True
        assert (await gw.get(f"/v1/files/{f['id']}")).status == 404


async def test_embeddings_batch(tmp_path):
    rows = [line(f"e{i}", url="/v1/embeddings") for i in range(3)]
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        f = (await upload(gw, jsonl(rows))).json()
        done = await settle(gw, (await create(gw, f["id"], endpoint="/v1/embeddings")).json()["id"])
        out = await lines_of(gw, done["output_file_id"])
        assert [o["response"]["body"]["object"] for o in out] == ["list"] * 3


async def test_a_bad_file_is_refused_with_the_line_numbers_of_its_errors(tmp_path):
    content = jsonl([line("a"), b"{not json", {"method": "POST", "url": "/v1/chat/completions", "body": {}},
                     line("a"), line("b", url="/v1/images"), line("c", stream=True)])
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        resp = await upload(gw, content)
        err = resp.json()["error"]
        assert resp.status == 400 and err["code"] == "invalid_file"
        for n, what in ((2, "not valid JSON"), (3, "custom_id"), (4, "also on line 1"), (5, "'url'"),
                        (6, "stream")):
            assert f"line {n}: " in err["message"] and what in err["message"]
        assert "line 1:" not in err["message"]
        assert (await upload(gw, b"\n\n")).json()["error"]["code"] == "invalid_file"
        assert (await upload(gw, jsonl([line("a")]), purpose="fine-tune")).status == 400
        assert (await gw.get("/v1/files")).json()["data"] == []


async def test_a_batch_whose_lines_do_not_fit_is_refused_with_line_numbers(tmp_path):
    content = jsonl([line("a"), line("b", model="no-such-model"), line("c", url="/v1/embeddings")])
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        f = (await upload(gw, content)).json()
        resp = await create(gw, f["id"])
        msg = resp.json()["error"]["message"]
        assert resp.status == 400 and "line 2: the model 'no-such-model' is not served" in msg and "line 3:" in msg
        bad = await gw.post("/v1/batches", {"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                            "completion_window": "forever"})
        assert bad.status == 400 and "completion_window" in bad.json()["error"]["message"]
        assert (await create(gw, "file-nope")).status == 404
        assert (await gw.get("/v1/batches")).json()["data"] == []


async def test_each_limit_has_its_error(tmp_path):
    limits = BatchesConfig(max_file_bytes=2048, max_lines=3, max_total_bytes=4096, retention_h=1.0)
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db", batches=limits) as gw:
        big = await upload(gw, jsonl([line(f"x{i}", pad="y" * 300) for i in range(8)]))
        assert big.status == 413 and big.json()["error"]["code"] == "file_too_large"
        many = await upload(gw, jsonl([line(f"m{i}") for i in range(4)]))
        assert many.status == 400 and many.json()["error"]["code"] == "too_many_lines"
        content = jsonl([line(f"t{i}", pad="z" * 400) for i in range(3)])
        assert len(content) > 1400
        first = await upload(gw, content)
        second = await upload(gw, content)
        assert first.status == 200 and second.status == 200
        full = await upload(gw, content)
        assert full.status == 413 and full.json()["error"]["code"] == "storage_full"
        done = await settle(gw, (await create(gw, first.json()["id"])).json()["id"])
        assert done["status"] == "completed"
        runner = gw.app.batches.runner
        assert await runner.sweep_once() == (0, 0)  # nothing is old enough yet
        swept = await runner.sweep_once(now=time.time() + 2 * 3600)
        assert swept == (1, 3)  # the batch; both inputs and the output
        assert (await gw.get(f"/v1/batches/{done['id']}")).status == 404
        assert (await gw.get("/v1/files")).json()["data"] == []


async def test_keys_see_only_their_own_files_and_batches_and_lines_run_as_their_key(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    key_a, secret_a = store.create("team-a", priority="interactive", max_priority="interactive")
    _, secret_b = store.create("team-b")
    store.close()
    admin = AdminConfig(key="admin-secret-" + "x" * 24)
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db", admin=admin) as gw:
        assert (await upload(gw, jsonl([line("a")]))).status == 401
        f = (await upload(gw, jsonl([line("a"), line("b")]), key=secret_a)).json()
        assert (await gw.get(f"/v1/files/{f['id']}", headers=auth(secret_b))).status == 404
        assert (await gw.get(f"/v1/files/{f['id']}/content", headers=auth(secret_b))).status == 404
        assert (await gw.request("DELETE", f"/v1/files/{f['id']}", headers=auth(secret_b))).status == 404
        assert (await gw.get("/v1/files", headers=auth(secret_b))).json()["data"] == []
        assert (await create(gw, f["id"], key=secret_b)).status == 404
        assert (await create(gw, f["id"], key=admin.key)).status == 403  # a batch runs for a key
        b = (await create(gw, f["id"], key=secret_a)).json()
        assert (await gw.get(f"/v1/batches/{b['id']}", headers=auth(secret_b))).status == 404
        assert (await gw.post(f"/v1/batches/{b['id']}/cancel", {}, headers=auth(secret_b))).status == 404
        done = await settle(gw, b["id"], key=secret_a)
        assert done["request_counts"]["completed"] == 2
        assert (await gw.get(f"/v1/files/{done['output_file_id']}/content", headers=auth(secret_b))).status == 404
        ran = [r for r in gw.records if r.endpoint == "chat"]
        # the key's own class is interactive: its batch lines still run at the batch class
        assert {(r.key_id, r.tenant, r.priority) for r in ran} == {(key_a.id, "team-a", "batch")}
        seen = (await gw.get("/v1/files", headers=auth(admin.key))).json()["data"]
        assert {x["id"] for x in seen} == {f["id"], done["output_file_id"]}
        assert [x["id"] for x in (await gw.get("/v1/batches", headers=auth(admin.key))).json()["data"]] == [b["id"]]
        stats = (await gw.get("/admin/stats", headers=auth(admin.key))).json()["batches"]
        assert stats["lines_done_since_start"] == 2 and stats["in_progress"] == 0


async def test_cancel_answers_each_line_once_done_or_cancelled(tmp_path):
    rows = [line(f"c{i}") for i in range(30)]
    cfg = BatchesConfig(in_flight_per_batch=2)
    async with fake_runtime(ttft_ms=40) as fake, gateway(fake.backend_config(), db=tmp_path / "k.db",
                                                         batches=cfg) as gw:
        f = (await upload(gw, jsonl(rows))).json()
        b = (await create(gw, f["id"])).json()
        await settle(gw, b["id"], until=("in_progress",))
        await waiting.until(lambda: completed(gw, b["id"], 2), 10)
        cancelled = await gw.post(f"/v1/batches/{b['id']}/cancel", {})
        assert cancelled.status == 200 and cancelled.json()["status"] in ("cancelling", "cancelled")
        done = await settle(gw, b["id"])
        assert done["status"] == "cancelled" and done["cancelled_at"]
        out = await lines_of(gw, done["output_file_id"])
        errs = await lines_of(gw, done["error_file_id"])
        assert sorted(o["custom_id"] for o in out + errs) == sorted(r["custom_id"] for r in rows)
        assert {e["error"]["code"] for e in errs} == {"batch_cancelled"} and len(out) >= 2
        assert done["request_counts"] == {"total": 30, "completed": len(out), "failed": len(errs)}
        # the lines cut were hung up like a client leaving: no gateway error
        assert {r.cause for r in gw.records} <= {Cause.OK, Cause.CLIENT_DISCONNECT}
        assert not gw.app.scheduler.waiting


async def test_lines_not_done_by_the_completion_window_expire(tmp_path):
    rows = [line(f"x{i}") for i in range(40)]
    cfg = BatchesConfig(in_flight_per_batch=1)
    # The window is counted in whole seconds from a whole-second created_at, so "3s" leaves between 2
    # and 3 s: enough for the first line (150 ms) on a busy machine, never enough for all 40 (6 s).
    async with fake_runtime(ttft_ms=150) as fake, gateway(fake.backend_config(), db=tmp_path / "k.db",
                                                          batches=cfg) as gw:
        f = (await upload(gw, jsonl(rows))).json()
        b = (await create(gw, f["id"], window="3s")).json()
        assert b["expires_at"] - b["created_at"] == 3
        done = await settle(gw, b["id"])
        assert done["status"] == "expired" and done["expired_at"]
        out = await lines_of(gw, done["output_file_id"])
        errs = await lines_of(gw, done["error_file_id"])
        assert 0 < len(errs) < 40 and {e["error"]["code"] for e in errs} == {"batch_expired"}
        assert sorted(o["custom_id"] for o in out + errs) == sorted(r["custom_id"] for r in rows)


async def test_a_batch_that_would_pass_its_keys_quota_pauses_instead_of_failing(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    _, secret = store.create("team", quotas=(parse_quota("60/day"),))
    store.close()
    rows = [line(f"q{i}") for i in range(10)]
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db") as gw:
        f = (await upload(gw, jsonl(rows), key=secret)).json()
        b = (await create(gw, f["id"], key=secret)).json()
        async def paused() -> bool:
            snap = (await gw.get("/admin/stats")).json()["batches"]["batches"]
            return bool(snap) and snap[0]["paused"] == "quota_exceeded"

        await waiting.until(paused, 10, "the batch paused for its quota", interval=0.02)
        now = (await gw.get(f"/v1/batches/{b['id']}", headers=auth(secret))).json()
        assert now["status"] == "in_progress" and now["request_counts"]["failed"] == 0
        assert now["request_counts"]["completed"] < 10
        await gw.post(f"/v1/batches/{b['id']}/cancel", {}, headers=auth(secret))
        done = await settle(gw, b["id"], key=secret)
        errs = await lines_of(gw, done["error_file_id"], key=secret)
        assert {e["error"]["code"] for e in errs} == {"batch_cancelled"}  # none failed on the quota


async def test_a_batch_resumes_after_the_gateway_stops_each_line_once(tmp_path):
    rows = [line(f"r{i}") for i in range(40)]
    cfg = BatchesConfig(in_flight_per_batch=2)
    async with fake_runtime(ttft_ms=20) as fake:
        async with gateway(fake.backend_config(), db=tmp_path / "k.db", batches=cfg) as gw:
            f = (await upload(gw, jsonl(rows))).json()
            b = (await create(gw, f["id"])).json()
            await waiting.until(lambda: completed(gw, b["id"], 3), 10)
        async with gateway(fake.backend_config(), db=tmp_path / "k.db", batches=cfg) as gw:
            done = await settle(gw, b["id"])
            assert done["status"] == "completed" and done["request_counts"]["completed"] == 40
            out = await lines_of(gw, done["output_file_id"])
            assert [o["custom_id"] for o in out] == [r["custom_id"] for r in rows]
            assert len(gw.records) < 40  # the lines answered before the stop were not run again


@pytest.mark.parametrize("wrong", [["/v1/chat/completions"], {"path": "/v1/chat/completions"}])
async def test_an_endpoint_or_url_that_is_a_list_or_an_object_is_a_400_not_a_gateway_error(wrong):
    # An unhashable value tested against the table of endpoints raised TypeError: internal_error (500).
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        bad_line = await upload(gw, jsonl([{**line("a"), "url": wrong}]))
        assert bad_line.status == 400 and "'url' must be one of" in bad_line.json()["error"]["message"]
        f = (await upload(gw, jsonl([line("a")]))).json()
        bad = await gw.post("/v1/batches", {"input_file_id": f["id"], "endpoint": wrong, "completion_window": "24h"})
        assert bad.status == 400 and "'endpoint' must be one of" in bad.json()["error"]["message"]


async def test_a_fault_in_one_retention_round_does_not_end_retention(caplog):
    # The sweeper caught only the store's errors: anything else ended its task, silently, and
    # finished batches and files were never deleted again until a restart.
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        runner = gw.app.batches.runner
        runner._sweeper.cancel()
        calls: list[int] = []

        async def sweep_once(now: float | None = None) -> tuple[int, int]:
            calls.append(1)
            if len(calls) == 1:
                raise KeyError("a bug")
            return (0, 0)

        runner.sweep_once = sweep_once  # type: ignore[method-assign]
        runner.cfg = dataclasses.replace(runner.cfg, retention_h=0.01 / 360)  # a round every 10 ms
        runner._sweeper = asyncio.ensure_future(runner._sweep())
        await waiting.until(lambda: len(calls) >= 3, 5, "retention rounds after the fault")
        assert not runner._sweeper.done() and "batch retention failed inside the gateway" in caplog.text


async def test_batch_lines_run_at_the_least_urgent_class_of_a_reloaded_configuration():
    # [[classes]] apply at a reload, but the Batch API kept the class name it was built with: once
    # a reload renamed the batch class, every line was refused (400, X-Priority) and counted failed.
    async with fake_runtime() as fake, gateway(fake.backend_config()) as gw:
        svc = gw.app.service
        classes = (ClassConfig("interactive", 0), ClassConfig("standard", 1), ClassConfig("bulk", 2, preemptible=True))
        svc.configure(dataclasses.replace(svc.cfg, classes=classes))  # (what a reload applies)
        f = (await upload(gw, jsonl([line(f"r{i}") for i in range(3)]))).json()
        done = await settle(gw, (await create(gw, f["id"])).json()["id"])
        assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert {r.priority for r in gw.records if r.client == "batch"} == {"bulk"}
