"""The Batch API's bounds and faults: its lifecycle's moves, the limits of batches in progress (429
with Retry-After), the memory a batch and an upload hold, and a real full disk (a small tmpfs as
the state folder): an upload gets a JSON 507 and leaves no ``.part``, a batch whose store fails can
be cancelled and ends ``cancelled``, ``.part`` files count in the bytes kept and a killed upload's
are removed at start."""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from passerelle.batches.status import BatchStatus, move
from passerelle.batches.validate import BLOCK
from passerelle.config import BatchesConfig
from passerelle.errors import Cause
from passerelle.tenants.keys import KeyStore
from tests.disk import SmallDisk
from tests.disk import small_disk as mounted
from tests.inprocess import fake_runtime, gateway
from tests.unit.test_batches import auth, create, jsonl, line, settle, upload
from tests.waiting import until


def test_a_batch_moves_only_as_its_diagram_says_and_old_rows_still_load():
    doc = {"id": "b", "status": "validating"}
    move(doc, BatchStatus.IN_PROGRESS, 10)
    assert doc == {"id": "b", "status": "in_progress", "in_progress_at": 10}
    with pytest.raises(RuntimeError, match="illegal transition in_progress -> completed"):
        move(doc, BatchStatus.COMPLETED, 11)  # not without finalizing
    move(doc, BatchStatus.CANCELLING, 12)
    with pytest.raises(RuntimeError):
        move(doc, BatchStatus.IN_PROGRESS, 13)  # a cancelled batch never runs again
    move(doc, BatchStatus.CANCELLED, 14)
    assert doc["status"] == "cancelled" and doc["cancelled_at"] == 14
    for end in ("completed", "failed", "expired", "cancelled"):
        assert BatchStatus(end).ended and not BatchStatus(end).live
        with pytest.raises(RuntimeError):
            move({"status": end}, BatchStatus.CANCELLING, 0)  # an ended batch is not cancelled
    finalizing = {"status": "finalizing", "_final": "cancelled"}  # a row written before the table
    move(finalizing, BatchStatus.CANCELLED, 1)
    assert [s.value for s in BatchStatus if s.live] == ["validating", "in_progress"]


async def test_batches_in_progress_are_limited_per_key_and_in_all_with_a_429_and_retry_after(tmp_path):
    store = KeyStore(tmp_path / "k.db")
    _, key_a = store.create("team-a")
    _, key_b = store.create("team-b")
    store.close()
    limits = BatchesConfig(max_batches_per_key=2, max_batches_in_progress=3)
    async with fake_runtime(ttft_ms=5000) as fake, \
            gateway(fake.backend_config(), db=tmp_path / "k.db", batches=limits) as gw:
        fa = (await upload(gw, jsonl([line("a")]), key=key_a)).json()["id"]
        fb = (await upload(gw, jsonl([line("b")]), key=key_b)).json()["id"]
        a1 = (await create(gw, fa, key=key_a)).json()["id"]
        assert (await create(gw, fa, key=key_a)).status == 200
        refused = await create(gw, fa, key=key_a)
        assert refused.status == 429 and refused.headers[b"retry-after"] == b"60"
        err = refused.json()["error"]
        assert (err["code"], err["type"]) == ("too_many_batches", "rate_limit_error")
        assert "max_batches_per_key" in err["message"]
        assert (await create(gw, fb, key=key_b)).status == 200  # another key has its own share
        everyone = await create(gw, fb, key=key_b)  # 3 in all
        assert everyone.status == 429 and "max_batches_in_progress" in everyone.json()["error"]["message"]
        assert (await gw.post(f"/v1/batches/{a1}/cancel", {}, headers=auth(key_a))).status == 200
        assert (await settle(gw, a1, key=key_a))["status"] == "cancelled"
        assert (await create(gw, fa, key=key_a)).status == 200  # a place came back


async def test_a_running_batch_holds_only_the_lines_in_flight_not_its_file(tmp_path):
    rows = [line(f"m{i:04d}", pad="p" * 2000) for i in range(400)]  # 0.8 MB of input
    limits = BatchesConfig(in_flight_per_batch=3, in_flight_per_key=3)
    async with fake_runtime(ttft_ms=20) as fake, \
            gateway(fake.backend_config(), db=tmp_path / "k.db", batches=limits) as gw:
        f = (await upload(gw, jsonl(rows))).json()["id"]
        b = (await create(gw, f)).json()["id"]
        runner = gw.app.batches.runner
        most = 0
        deadline = time.monotonic() + 60
        while (run := runner.runs.get(b)) is not None and run.doc["status"] == "in_progress":
            held = len(run.ahead) + len(run.back) + len(run.running)
            buffered = len(run.reader.buf) if run.reader is not None else 0
            most = max(most, held)
            assert held <= 2 * 16 + 3, held  # a block read ahead, and the lines running
            assert buffered <= 2 * BLOCK, buffered  # never the file (0.8 MB)
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        done = await settle(gw, b)
        assert done["request_counts"] == {"total": 400, "completed": 400, "failed": 0} and most > 0
        # each line's usage is its record's (the gateway's own count), not a parse of its answer
        ran = [r for r in gw.records if r.endpoint == "chat" and r.cause is Cause.OK]
        assert done["usage"]["input_tokens"] == sum(r.prompt_tokens or 0 for r in ran)
        assert done["usage"]["output_tokens"] == sum(r.completion_tokens or 0 for r in ran) > 0


async def test_an_upload_of_tiny_objects_is_checked_without_amplifying_it(tmp_path):
    content = b'{"a":1}\n' * (2 << 20 >> 3)  # 2 MiB: 262,144 objects, the most objects per byte
    limits = BatchesConfig(max_lines=1 << 20)
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=tmp_path / "k.db", batches=limits) as gw:
        tracemalloc.start()
        try:
            resp = await upload(gw, content)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert resp.status == 400 and "(and 262134 more lines)" in resp.json()["error"]["message"]
        assert peak < 4 * len(content), peak / len(content)  # the body, the form's copy; not x30


def rss_mib() -> float:
    for ln in Path("/proc/self/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_many_batches_of_one_file_cost_little_and_give_it_back_once_cancelled(tmp_path):
    content = b"".join(orjson.dumps(line(f"g{i:06d}", pad="x" * 200)) + b"\n" for i in range(8000))  # 2.6 MB
    limits = BatchesConfig(max_batches_per_key=20, max_lines=10000, max_file_bytes=4 << 20)
    async with fake_runtime(ttft_ms=3000, slots=2) as fake, \
            gateway(fake.backend_config(max_concurrency=2), db=tmp_path / "k.db", batches=limits) as gw:
        f = (await upload(gw, content)).json()["id"]
        gc.collect()
        before = rss_mib()
        ids = [(await create(gw, f)).json()["id"] for _ in range(20)]
        runner = gw.app.batches.runner
        while any(runner.runs[b].reader is None for b in ids):  # every batch has begun reading
            await asyncio.sleep(0.01)
        running = rss_mib() - before
        for b in ids:
            assert (await gw.post(f"/v1/batches/{b}/cancel", {})).json()["status"] == "cancelling"
        for b in ids:
            assert (await settle(gw, b, timeout=120))["status"] == "cancelled"
        gc.collect()
        after = rss_mib() - before
        # each batch held its file parsed (16 MiB a batch of 4 MB); cancelled, little came back
        assert running < 20 and after < 20, (running, after)


# -- a real full disk ---------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with mounted(tmp_path / "disk", "16m") as disk:
        yield disk


async def test_an_upload_on_a_full_disk_gets_a_json_507_and_leaves_no_part_file(small_disk):
    async with fake_runtime() as fake, gateway(fake.backend_config(), db=small_disk / "k.db") as gw:
        assert (await upload(gw, jsonl([line("before")]))).status == 200
        small_disk.fill()
        resp = await upload(gw, jsonl([line(f"f{i}", pad="q" * 1000) for i in range(200)]))
        assert resp.status == 507 and resp.headers[b"content-type"] == b"application/json"
        assert resp.json()["error"]["code"] == "disk_full"
        assert list((small_disk / "batch-files").glob("*.part")) == []
        small_disk.free()
        assert (await upload(gw, jsonl([line("after")]))).status == 200


async def test_a_batch_whose_store_fails_can_be_cancelled_and_ends_cancelled(small_disk):
    rows = [line(f"s{i}") for i in range(40)]
    limits = BatchesConfig(in_flight_per_batch=2, in_flight_per_key=2)
    async with fake_runtime(ttft_ms=150) as fake, \
            gateway(fake.backend_config(), db=small_disk / "k.db", batches=limits) as gw:
        b = (await create(gw, (await upload(gw, jsonl(rows))).json()["id"])).json()["id"]
        small_disk.fill()
        filled_at = time.perf_counter()
        await until(lambda: any(r.endpoint == "chat" and r.t_end > filled_at for r in gw.records)
                    and not gw.app.gateway.open, 20, "a line answered on the full disk", interval=0.02)
        # lines were answered on the full disk, their rows could not be written, and no line runs
        cancel = await gw.post(f"/v1/batches/{b}/cancel", {})
        assert cancel.status == 200 and cancel.json()["status"] == "cancelling"
        got = await gw.get(f"/v1/batches/{b}")
        assert got.status == 200 and got.json()["status"] == "cancelling"
        small_disk.free()  # space again: the batch ends
        done = await settle(gw, b, timeout=60)
        assert done["status"] == "cancelled"
        counts = done["request_counts"]
        assert counts["total"] == 40 and counts["completed"] + counts["failed"] == 40


async def test_part_files_count_in_the_bytes_kept_and_a_killed_uploads_are_removed_at_start(tmp_path):
    limits = BatchesConfig(max_file_bytes=4096, max_total_bytes=8192)
    content = jsonl([line("k", pad="r" * 1500)])
    async with fake_runtime() as fake:
        async with gateway(fake.backend_config(), db=tmp_path / "k.db", batches=limits) as gw:
            part = tmp_path / "batch-files" / "file-killed.part"
            part.write_bytes(b"x" * 7000)  # an upload being written (or one a kill left)
            refused = await upload(gw, content)
            assert refused.status == 413 and refused.json()["error"]["code"] == "storage_full"
        async with gateway(fake.backend_config(), db=tmp_path / "k.db", batches=limits) as gw:
            assert not part.exists()  # removed at start
            assert (await upload(gw, content)).status == 200


def test_the_input_of_a_batch_is_read_back_line_by_line(tmp_path):
    from passerelle.batches.validate import LineReader
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([line(f"r{i}") for i in range(3)]) + b"\n  \n" + orjson.dumps(line("last")))
    with open(path, "rb") as f:
        reader = LineReader(f, 1 << 16)
        got = reader.read(2) + reader.read(10) + reader.read(10)
    assert [(n, orjson.loads(raw)["custom_id"]) for n, raw in got] == [(1, "r0"), (2, "r1"), (3, "r2"), (6, "last")]
