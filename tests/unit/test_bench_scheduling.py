"""bench/scheduling.py's account of where preemption's time goes: the interactive requests of a
phase from a gateway's access log, and from llama-server's own log the time from a cut stream's
cancel to the next request the runtime started (the log lines as this llama-server writes them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the scripts import each other by name, as `python bench/X.py` does

import scheduling  # noqa: E402

LLAMA_LOG = """\
0.00.001.000 I main: loading model
1.10.000.000 I slot launch_slot_: id  2 | task 10 | processing task, is_child = 0
1.12.500.000 W srv          stop: cancel task, id_task = 10
1.12.500.100 I slot      release: id  2 | task 10 | stop processing: n_tokens = 52, truncated = 0
1.12.560.000 I slot get_availabl: id  2 | task -1 | selected slot by id (2)
1.12.561.000 I slot launch_slot_: id  2 | task 11 | processing task, is_child = 0
1.19.800.000 W srv          stop: cancel task, id_task = 11
1.19.900.000 I slot launch_slot_: id  1 | task 12 | processing task, is_child = 0
"""


def test_a_cancel_is_timed_to_the_next_launch_a_release_to_its_slots_and_the_phase_end_is_left_out(tmp_path):
    log = tmp_path / "llama.log"
    log.write_text(LLAMA_LOG)
    # the phase: 70 s to 80 s after llama-server started; the cancel at 79.8 s is its clients leaving
    cancels, idle = scheduling.llama_gaps(log, 70.0, 80.0)
    assert cancels == [pytest.approx(0.061)]
    assert idle == [pytest.approx(0.0609)]  # slot 2 released, slot 2 launched again (not slot 1's launch)
    assert scheduling.llama_gaps(log, 0.0, 60.0) == ([], [])


def test_the_interactive_records_of_a_phase_window(tmp_path):
    log = tmp_path / "gateway.log"
    recs = [{"ts": 100.5, "priority": "interactive", "queue_ms": 3.0, "ttft_ms": 300.0},
            {"ts": 100.6, "priority": "batch", "queue_ms": 3.0, "ttft_ms": 300.0},
            {"ts": 100.7, "priority": "interactive", "queue_ms": 9.0, "ttft_ms": None},  # no first token
            {"ts": 130.0, "priority": "interactive", "queue_ms": 1.0, "ttft_ms": 200.0}]  # another phase
    log.write_text("INFO: passerelle ready\n" + "".join(json.dumps(r) + "\n" for r in recs))
    assert scheduling.interactive_log(log, 100.0, 120.0) == [recs[0]]
