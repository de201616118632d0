"""Trace replay: arrivals on time (within 5 %), lengths as recorded; traces exported from the usage
store and the access log by ``passerelle usage --export-trace``."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import pytest

from passerelle.bench.trace import TraceEntry, TraceError, load_trace
from passerelle.cli import main
from passerelle.tenants.keys import connect
from passerelle.tenants.trace import access_log_rows, usage_rows, write_trace
from passerelle.testing.fake_runtime import start_fake_backend

ARRIVALS = [0.0, 0.3, 0.45, 0.9, 1.0, 1.35, 1.8, 2.0, 2.05, 2.6]


def write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.mark.parametrize("speed", [1.0, 2.0])
def test_replay_sends_on_the_trace_s_clock_with_its_lengths(tmp_path, speed):
    trace = write(tmp_path / "t.jsonl", [{"t": 100 + t, "prompt_tokens": 20 + 7 * k, "output_tokens": 2 + k}
                                         for k, t in enumerate(ARRIVALS)])
    with start_fake_backend(ttft_ms=5, itl_ms=1) as fake:
        assert main(["bench", "--url", fake.url, "--name", "fake", "--trace", str(trace), "--trace-speed", str(speed),
                     "--out", str(tmp_path / "out")]) == 0
    with (tmp_path / "out" / "requests.csv").open() as fh:
        rows = sorted(csv.DictReader(fh), key=lambda r: float(r["t_send_s"]))
    assert len(rows) == len(ARRIVALS) and all(r["ok"] == "True" for r in rows)
    sent = [float(r["t_send_s"]) for r in rows]
    for k, t in enumerate(ARRIVALS[1:], 1):
        want = t / speed
        assert abs((sent[k] - sent[0]) - want) <= 0.05 * want, (k, sent[k] - sent[0], want)
    # each request has the recorded lengths: the fake counts words, calibrated against it
    assert [int(r["output_tokens"]) for r in rows] == [2 + k for k in range(len(ARRIVALS))]
    assert [int(r["prompt_tokens"]) for r in rows] == [20 + 7 * k for k in range(len(ARRIVALS))]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    load = results["load"]
    assert load["trace_requests"] == 10 and load["trace_span_s"] == pytest.approx(2.6 / speed)
    assert results["runs"][0]["rate"] == pytest.approx(9 / (2.6 / speed), rel=1e-3)  # the mean arrival rate
    assert "trace replay:" in (tmp_path / "out" / "report.md").read_text()


def test_trace_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 0, "prompt_tokens": 5, "output_tokens": 5}\n# a comment\n{"t": 1, "prompt_tokens": 0}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:3: 'prompt_tokens' must be an integer >= 1"):
        load_trace(bad)
    bad.write_text("not json\n")
    with pytest.raises(TraceError, match=r"bad.jsonl:1: not JSON"):
        load_trace(bad)
    bad.write_text("")
    with pytest.raises(TraceError, match="no request"):
        load_trace(bad)


def test_trace_usage_errors(tmp_path, capsys):
    trace = write(tmp_path / "t.jsonl", [{"t": 0, "prompt_tokens": 5, "output_tokens": 5}])
    for extra, message in ((["--rate", "2"], "drop --rate"), (["--scenario", str(trace)], "not both"),
                           (["--trace-speed", "0"], "must be > 0")):
        assert main(["bench", "--url", "http://127.0.0.1:1", "--trace", str(trace), "--out", str(tmp_path),
                     *extra]) == 2
        assert message in capsys.readouterr().err


def test_export_from_the_usage_store_and_replay_it(tmp_path, capsys):
    db = tmp_path / "passerelle.db"
    conn = connect(db)
    now = time.time()
    conn.executemany("INSERT INTO usage (ts, tenant, class, model, cause, prompt_tokens, completion_tokens) "
                     "VALUES (?,?,?,?,?,?,?)", [
        (now - 10.0, "alice", "interactive", "m", "ok", 120, 30),
        (now - 9.5, "bob", "batch", "m", "ok", 800, 200),
        (now - 9.0, "bob", "batch", "m", "upstream_error", 800, 0),  # not served: left out
        (now - 8.0, "alice", "interactive", "m", "ok", 60, 12),
        (now - 4000.0, "old", "standard", "m", "ok", 10, 10),  # before --since
    ])
    conn.close()
    out = tmp_path / "week.jsonl"
    assert main(["usage", "--db", str(db), "--since", "1h", "--export-trace", str(out)]) == 0
    assert "3 requests from the usage store" in capsys.readouterr().err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["t"], x["prompt_tokens"], x["output_tokens"]) for x in lines] == [(0.0, 120, 30), (0.5, 800, 200),
                                                                               (2.0, 60, 12)]
    assert lines[1]["tenant"] == "bob" and lines[1]["priority"] == "batch"
    assert load_trace(out) == (TraceEntry(0.0, 120, 30), TraceEntry(0.5, 800, 200), TraceEntry(2.0, 60, 12))


def test_export_from_access_log_lines_uses_exact_arrivals(tmp_path, capsys):
    log = tmp_path / "access.log"
    log.write_text("\n".join([
        'Nov 30 12:00:01 box passerelle[1]: {"ts": 1000.5, "endpoint": "chat", "cause": "ok", '
        '"duration_ms": 500.0, "prompt_tokens": 100, "completion_tokens": 20, "tenant": "a", "priority": "standard"}',
        '{"ts": 1001.0, "endpoint": "chat", "cause": "client_disconnect", "duration_ms": 10, "prompt_tokens": 5, '
        '"completion_tokens": 1}',
        '{"ts": 1003.0, "endpoint": "embeddings", "cause": "ok", "duration_ms": 3, "prompt_tokens": 5, '
        '"completion_tokens": 0}',
        '{"ts": 1004.0, "endpoint": "completions", "cause": "ok", "duration_ms": 2500.0, "prompt_tokens": 50, '
        '"completion_tokens": 80}',
        "12:00:05 INFO passerelle: not a request line",
    ]) + "\n")
    rows = list(access_log_rows(log.read_text().splitlines()))
    assert [(r["arrival"], r["prompt_tokens"], r["output_tokens"]) for r in rows] == [(1000.0, 100, 20),
                                                                                      (1001.5, 50, 80)]
    buf = io.StringIO()
    assert write_trace(rows, buf) == 2
    assert [json.loads(x)["t"] for x in buf.getvalue().splitlines()] == [0.0, 1.5]
    assert main(["usage", "--access-log", str(log), "--export-trace", str(tmp_path / "t.jsonl")]) == 0
    assert "2 requests from the access log" in capsys.readouterr().err
    assert main(["usage", "--access-log", str(tmp_path / "missing.log"), "--export-trace", "-"]) == 2


def test_usage_rows_reads_only_served_requests(tmp_path):
    conn = connect(tmp_path / "p.db")
    cols = "INSERT INTO usage (ts, tenant, class, model, cause, prompt_tokens, completion_tokens) VALUES "
    conn.execute(cols + "(1.0, 't', 'standard', 'm', 'ok', 0, 5)")  # no prompt: skipped
    conn.execute(cols + "(2.0, 't', 'standard', 'm', 'ok', 7, 5)")
    assert [r["prompt_tokens"] for r in usage_rows(conn)] == [7]
    conn.close()
