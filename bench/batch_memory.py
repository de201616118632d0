"""The Batch API's memory: what an upload and many batches cost the gateway, from its /proc.

Against the fake runtime (slow, so that batches stay in progress), behind passerelle:

1. upload: one file of ``--upload-mib`` MiB made of tiny JSON objects (``{}`` lines, each one a
   line to check and refuse; with ``--valid``, the smallest valid requests), the gateway's peak
   RSS growth (VmHWM after less VmRSS before) and its ratio to the upload;
2. batches: ``--batches`` batches created as fast as one key can from one ``--file-mib`` MiB input,
   the RSS growth per batch while they are all in progress, then after all are cancelled and ended.

    .venv/bin/python bench/batch_memory.py [--src DIR] [--upload-mib 16] [--valid] [--file-mib 4] [--batches 40]

``--src``: the passerelle tree to run (default: this one), to measure a branch against another.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path
from typing import Any

import openai
import orjson

sys.path.insert(0, str(Path(__file__).parent))
from harness import MODEL, ROOT, WORK, free_port, report_head, serve, source_env, spawn, write_json

BOUNDARY = "bench-memory-boundary"


def status_kib(pid: int, field: str) -> int:
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith(field + ":"):
            return int(ln.split()[1])
    raise KeyError(field)


def tiny_objects(mib: float, valid: bool) -> bytes:
    """Lines of ``{}`` (the most lines, and parsed objects, per byte; each one refused), or the
    smallest valid requests (each one kept until the file's verdict)."""
    if not valid:
        return b"{}\n" * int(mib * (1 << 20) / 3)
    lines, size, i = [], 0, 0
    while size < mib * (1 << 20):
        ln = b'{"custom_id":"%d","url":"/v1/chat/completions","body":{"model":"m"}}\n' % i
        lines.append(ln)
        size += len(ln)
        i += 1
    return b"".join(lines)


def batch_file(mib: float) -> bytes:
    lines, size, i = [], 0, 0
    while size < mib * (1 << 20):
        ln = orjson.dumps({"custom_id": f"line-{i:07d}", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": MODEL, "max_tokens": 4,
                                    "messages": [{"role": "user", "content": "x" * 200}]}}) + b"\n"
        lines.append(ln)
        size += len(ln)
        i += 1
    return b"".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, default=ROOT)
    p.add_argument("--upload-mib", type=float, default=16)
    p.add_argument("--file-mib", type=float, default=4)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--valid", action="store_true", help="the upload's tiny objects are valid requests")
    p.add_argument("--out", type=Path, default=WORK / "batch-memory")
    a = p.parse_args()
    work = a.out
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    fake = spawn("fake", [sys.executable, "-m", "passerelle", "fake-backend", "--port", str(port), "--ttft-ms",
                          "2000", "--itl-ms", "50", "--model", MODEL, "--slots", "2"], work, env=source_env(a.src),
                 url=f"http://127.0.0.1:{port}")
    fake.wait_ready("/health", 30)
    cfg = work / "gw.toml"
    # (a tree from before these limits refuses their keys)
    limits = (f"max_batches_in_progress = {a.batches}\nmax_batches_per_key = {a.batches}"
              if "max_batches_per_key" in (a.src / "passerelle" / "config.py").read_text() else "")
    cfg.write_text(f"""
[server]
access_log = false
max_upload_bytes = {int((a.upload_mib + 1) * (1 << 20))}

[batches]
max_file_bytes = {int((a.upload_mib + 1) * (1 << 20))}
max_lines = 10000000
{limits}

[[backends]]
name = "fake"
kind = "openai"
url = "{fake.url}"
models = ["{MODEL}"]
max_concurrency = 2
""")
    gw = serve(work, cfg, name="gw", src=a.src)
    out: dict[str, Any] = {**report_head("batch_memory"), "src": str(a.src), "settings": vars(a) | {
        "src": str(a.src), "out": str(a.out)}}
    try:
        gw.wait_ready("/ready", 60)
        pid = gw.proc.pid
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        # 1. one upload of tiny objects
        content = tiny_objects(a.upload_mib, a.valid)
        rss0 = status_kib(pid, "VmRSS")
        t0 = time.perf_counter()
        try:
            client.files.create(file=("tiny.jsonl", io.BytesIO(content)), purpose="batch")
            answer = "accepted"
        except openai.APIStatusError as err:
            answer = f"{err.status_code}"
        hwm = status_kib(pid, "VmHWM")
        out["upload"] = {"mib": len(content) / (1 << 20), "answer": answer, "rss_before_mib": rss0 / 1024,
                         "peak_growth_mib": (hwm - rss0) / 1024, "ratio": (hwm - rss0) * 1024 / len(content),
                         "seconds": time.perf_counter() - t0}
        print("upload:", out["upload"], flush=True)
        # 2. many batches from one file
        f = client.files.create(file=("in.jsonl", io.BytesIO(batch_file(a.file_mib))), purpose="batch")
        time.sleep(1.0)
        rss1 = status_kib(pid, "VmRSS")
        ids, refused = [], 0
        t0 = time.perf_counter()
        for _ in range(a.batches):
            try:
                ids.append(client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
            except openai.APIStatusError:
                refused += 1
        made_s = time.perf_counter() - t0
        time.sleep(3.0)  # every batch has started
        rss2 = status_kib(pid, "VmRSS")
        for b in ids:
            client.batches.cancel(b)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if all(client.batches.retrieve(b).status in ("cancelled", "completed", "failed") for b in ids):
                break
            time.sleep(0.5)
        time.sleep(1.0)
        rss3 = status_kib(pid, "VmRSS")
        out["batches"] = {"file_mib": a.file_mib, "made": len(ids), "refused": refused, "made_s": made_s,
                          "rss_before_mib": rss1 / 1024, "rss_in_progress_mib": rss2 / 1024,
                          "growth_per_batch_mib": (rss2 - rss1) / 1024 / max(len(ids), 1),
                          "rss_after_cancel_mib": rss3 / 1024, "peak_mib": status_kib(pid, "VmHWM") / 1024}
        print("batches:", out["batches"], flush=True)
    finally:
        gw.stop()
        fake.stop()
    write_json(work / "results.json", out)


if __name__ == "__main__":
    main()
