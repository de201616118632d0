"""Sessions keep their KV through passerelle and a real llama-server it launches (Gemma 3 270M, one
slot, its RAM prompt cache off so that only passerelle's save and restore can bring a prefix back):
a session whose slot another session took gets its KV restored (its next turn computes only the new
part); a canary that two tenants with the same session id and the same prompt never share KV; the
space bound evicts the least recently used file and removes it; a save past its deadline costs a
recompute, never the request; a request that waits for a held slot has its KV saved meanwhile and
takes the slot once saved; where held slots mostly go to other sessions, a turn's KV is saved as it
ends."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import orjson
import pytest

from passerelle.tenants.keys import KeyStore
from tests.conftest import MODEL_ID, wait_until

pytestmark = pytest.mark.llama

LAUNCHED = """
[[backends]]
name = "own"
kind = "llama-server"
launch = ["{binary}", "-m", "{model}", "--alias", "{alias}", "--port", "{{port}}", "-np", "1", "-c", "4096",
          "-t", "1", "--metrics", "--slots", "--no-webui", "--cache-ram", "0", "--swa-full"]
models = ["{alias}"]
max_concurrency = 1

[sessions]
hold_default_s = {hold}
{sessions}
"""
WORDS = ["harbour", "ledger", "storm", "beacon", "pier", "tide", "lantern", "rope", "anchor", "gull", "reef"]


def context(tag: str, n: int = 250) -> str:
    return f"Notes of {tag}: " + " ".join(WORDS[(i * 7 + len(tag)) % len(WORDS)] for i in range(n))


def start(gateway, llama_paths, tmp_path: Path, sessions: str = "", auth: str = "", hold: float = 0):
    binary, model = llama_paths
    return gateway(LAUNCHED.format(binary=binary, model=model, alias=MODEL_ID, sessions=sessions, hold=hold) + auth)


def turn(gw, messages: list[dict], session: str, key: str = "") -> dict:
    """One streamed chat turn: llama-server's prompt_n / cache_n, the answer, the status."""
    headers = {"x-session-id": session, **({"authorization": f"Bearer {key}"} if key else {})}
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    out: dict = {"text": ""}
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = orjson.loads(line[6:])
            for ch in obj.get("choices") or []:
                out["text"] += (ch.get("delta") or {}).get("content") or ""
            if isinstance(obj.get("timings"), dict):
                out["prompt_n"] = obj["timings"]["prompt_n"]
                out["cache_n"] = obj["timings"].get("cache_n", 0)
    assert out["status"] == 200 and "prompt_n" in out, out
    return out


def metric(gw, name: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def saved_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "state" / "slot-kv" / "own").glob("*.kv"))


def follow_up(messages: list[dict], answer: str, n: int) -> list[dict]:
    return [*messages, {"role": "assistant", "content": answer or "ok"},
            {"role": "user", "content": f"Tool result {n}: exit 0, 3 files changed."}]


def test_a_session_whose_slot_was_taken_gets_its_kv_restored(gateway, llama_paths, tmp_path):
    gw = start(gateway, llama_paths, tmp_path)
    a = [{"role": "system", "content": context("agent-a")}, {"role": "user", "content": "Summarise."}]
    b = [{"role": "system", "content": context("agent-b")}, {"role": "user", "content": "Summarise."}]
    first = turn(gw, a, "agent-a")
    assert first["prompt_n"] > 250
    other = turn(gw, b, "agent-b")  # takes the one slot: agent-a's KV is saved first
    assert other["prompt_n"] > 250
    assert metric(gw, 'passerelle_session_kv_saves_total{outcome="ok"}') == 1
    assert len(saved_files(tmp_path)) == 1
    a2 = follow_up(a, first["text"], 1)
    again = turn(gw, a2, "agent-a")  # agent-b's KV saved, agent-a's restored before the turn
    assert metric(gw, 'passerelle_session_kv_restores_total{outcome="ok"}') == 1
    # only the new part is computed: the answer and the tool result (about 30 tokens), not the 270
    assert again["prompt_n"] < 60 and again["cache_n"] > 250, again
    assert metric(gw, "passerelle_session_cached_prompt_tokens_total") >= again["cache_n"]
    # and without a session id the same follow-up computes everything (no hold, no restore for it)
    plain = httpx.post(gw.url + "/v1/chat/completions", json={"model": MODEL_ID, "messages": follow_up(
        b, other["text"], 1), "max_tokens": 4}, timeout=300)
    assert plain.status_code == 200
    assert metric(gw, 'passerelle_session_kv_restores_total{outcome="ok"}') == 1


def test_canary_no_kv_crosses_tenants_or_sessions(gateway, llama_paths, tmp_path):
    """Two tenants use the same session id and the same prompt: the second never starts from the
    first's KV (the slot is erased as it passes, nothing is restored for it, its whole prompt is
    computed), and each tenant's session gets back only its own."""
    store = KeyStore(tmp_path / "keys.db")
    keys = {t: store.create(t)[1] for t in ("acme", "evil")}
    store.close()
    gw = start(gateway, llama_paths, tmp_path, auth=f'\n[auth]\ndb = "{tmp_path / "keys.db"}"\n')
    msgs = [{"role": "system", "content": context("secret-plan")}, {"role": "user", "content": "Summarise."}]
    acme = turn(gw, msgs, "same-id", keys["acme"])
    evil = turn(gw, msgs, "same-id", keys["evil"])  # same id, same text, another tenant
    assert evil["cache_n"] == 0 and evil["prompt_n"] >= acme["prompt_n"] - 1, evil
    assert metric(gw, "passerelle_session_kv_erases_total") == 1
    assert metric(gw, 'passerelle_session_kv_restores_total{outcome="ok"}') == 0
    # and another session of the same tenant never gets acme's saved KV either
    other = turn(gw, msgs, "another-id", keys["acme"])
    assert metric(gw, 'passerelle_session_kv_restores_total{outcome="ok"}') == 0
    assert other["cache_n"] == 0, other
    # each tenant's own session comes back to its own KV
    acme2 = turn(gw, follow_up(msgs, acme["text"], 1), "same-id", keys["acme"])
    assert acme2["prompt_n"] < 60, acme2
    evil2 = turn(gw, follow_up(msgs, evil["text"], 1), "same-id", keys["evil"])
    assert evil2["prompt_n"] < 60, evil2
    assert metric(gw, 'passerelle_session_kv_restores_total{outcome="ok"}') == 2


def test_the_space_bound_evicts_the_least_recently_used_and_removes_its_file(gateway, llama_paths, tmp_path):
    gw = start(gateway, llama_paths, tmp_path, sessions="max_saved_files = 1")
    convs = {s: [{"role": "system", "content": context(s)}, {"role": "user", "content": "Go."}]
             for s in ("s1", "s2", "s3")}
    firsts = {s: turn(gw, m, s) for s, m in convs.items()}  # s1 saved, then s2 saved and s1 evicted
    files = saved_files(tmp_path)
    assert len(files) == 1
    assert metric(gw, "passerelle_session_kv_evictions_total") == 1
    assert metric(gw, "passerelle_session_kv_files") == 1
    assert metric(gw, "passerelle_session_kv_bytes") == files[0].stat().st_size
    # s1's KV is gone: its next turn is computed in full, and is still answered
    back = turn(gw, follow_up(convs["s1"], firsts["s1"]["text"], 1), "s1")
    assert back["prompt_n"] > 250
    assert metric(gw, 'passerelle_session_kv_restores_total{outcome="ok"}') == 0


def test_a_save_past_its_deadline_costs_a_recompute_not_the_request(gateway, llama_paths, tmp_path):
    gw = start(gateway, llama_paths, tmp_path, sessions="save_timeout_s = 0.0001")
    a = [{"role": "system", "content": context("agent-a")}, {"role": "user", "content": "Summarise."}]
    b = [{"role": "system", "content": context("agent-b")}, {"role": "user", "content": "Summarise."}]
    first = turn(gw, a, "agent-a")
    turn(gw, b, "agent-b")  # the save of agent-a's KV gets no answer in time: the turn goes on
    assert metric(gw, 'passerelle_session_kv_saves_total{outcome="failed"}') == 1
    again = turn(gw, follow_up(a, first["text"], 1), "agent-a")  # nothing to restore: computed again
    assert again["prompt_n"] > 250
    assert metric(gw, 'passerelle_session_kv_restores_total{outcome="ok"}') == 0


def test_a_request_waiting_for_a_held_slot_takes_it_once_its_kv_is_saved(gateway, llama_paths, tmp_path):
    """One slot, held for agent-a's next turn; agent-b's class would leave a held slot alone for
    120 s: agent-a's KV is saved while agent-b waits, agent-b takes the slot as soon as it is
    (a save is a fraction of a second), and agent-a's next turn gets its KV back by a restore."""
    classes = '\n[[classes]]\nname = "standard"\nrank = 1\nsession_wait_s = 120\nmax_queue_wait_s = 300\n'
    gw = start(gateway, llama_paths, tmp_path, sessions="hold_max_s = 600", auth=classes, hold=600)
    a = [{"role": "system", "content": context("agent-a")}, {"role": "user", "content": "Summarise."}]
    b = [{"role": "system", "content": context("agent-b")}, {"role": "user", "content": "Summarise."}]
    first = turn(gw, a, "agent-a")
    assert metric(gw, 'passerelle_session_kv_saves_total{outcome="ok"}') == 0
    t0 = time.monotonic()
    other = turn(gw, b, "agent-b")
    assert time.monotonic() - t0 < 60, "agent-b waited out its class's budget: nothing was saved ahead"
    assert other["prompt_n"] > 250
    assert metric(gw, 'passerelle_session_kv_saves_total{outcome="ok"}') == 1
    assert metric(gw, 'passerelle_session_holds_total{outcome="taken"}') == 1
    again = turn(gw, follow_up(a, first["text"], 1), "agent-a")
    assert metric(gw, 'passerelle_session_kv_restores_total{outcome="ok"}') == 1
    assert again["prompt_n"] < 60 and again["cache_n"] > 250, again


def test_where_held_slots_go_to_other_sessions_a_turns_kv_is_saved_as_it_ends(gateway, llama_paths, tmp_path):
    """One slot, two agents in turn: each turn takes the slot held for the other. Once most holds
    went that way, a turn's KV is saved as the turn ends, before anyone asks for the slot, and the
    other agent's next turn gets its own KV restored. (That such a turn saves nothing first is
    tests/unit/test_session_kv.py's: here the save as its turn ends may come before the count is read.)"""
    classes = '\n[[classes]]\nname = "standard"\nrank = 1\nsession_wait_s = 120\nmax_queue_wait_s = 300\n'
    gw = start(gateway, llama_paths, tmp_path, sessions="hold_max_s = 600", auth=classes, hold=600)
    convs = {s: [{"role": "system", "content": context(s)}, {"role": "user", "content": "Summarise."}]
             for s in ("agent-a", "agent-b")}

    def go(session: str, n: int) -> dict:
        out = turn(gw, convs[session], session)
        convs[session] = follow_up(convs[session], out["text"], n + 1)
        return out

    def saves() -> float:
        return metric(gw, 'passerelle_session_kv_saves_total{outcome="ok"}')

    for n in range(2):
        for s in ("agent-a", "agent-b"):
            go(s, n)
    # three holds taken (agent-b's first turn, then each after it): each saved while the next waited;
    # agent-b's last turn had its KV saved as it ended, with nobody waiting
    assert metric(gw, 'passerelle_session_holds_total{outcome="taken"}') == 3
    wait_until(lambda: saves() == 4, 30, what="agent-b's KV saved as its turn ended")
    again = go("agent-a", 2)
    assert metric(gw, 'passerelle_session_kv_restores_total{outcome="ok"}') == 3
    assert again["prompt_n"] < 60 and again["cache_n"] > 250, again
    wait_until(lambda: saves() == 5, 30, what="agent-a's KV saved as its turn ended")
