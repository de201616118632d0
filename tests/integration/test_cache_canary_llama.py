"""Caches stay with their owner: concurrent sessions of two tenants through passerelle and a real
llama-server (4 slots, its RAM prompt cache and idle-slot caching on, as llama-server's defaults and
the embedded runtime have them), each session's context carrying its tenant's planted marker. No
answer may contain the other tenant's marker (a prompt cache that restored another conversation's
context would show it). And ``cached_tokens`` reaches the client in each API's usage shape, from the
runtime's own figures, through passerelle's assembled non-stream answers too.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from passerelle.tenants.keys import KeyStore
from tests.conftest import MODEL_ID, upstream_config

pytestmark = pytest.mark.llama

MARKERS = {"harbour": "ZEBRA4417", "orchard": "OTTER9021"}
# Shared by every session of both tenants (as a front-end's system prompt is): what makes the
# runtime's cache look for, and find, a long common prefix among other people's conversations.
PREAMBLE = ("Ledger of the coastal town, kept by the archivist. Each line records one entry in the order it came. "
            "The ledger is read aloud at the end of each season. ") * 6


def prompt(tenant: str, session: int, turn: int, history: str) -> str:
    own = f"Entry: {MARKERS[tenant]}. "
    return f"{PREAMBLE}\nBook {session} of the {tenant}.\n{own * 3}{history}Entry:"


async def run_session(client: httpx.AsyncClient, secret: str, tenant: str, session: int, turns: int,
                      answers: list[tuple[str, str, dict]]) -> None:
    history = ""
    for turn in range(turns):
        body = {"model": MODEL_ID, "prompt": prompt(tenant, session, turn, history), "max_tokens": 8,
                "temperature": 0}
        resp = await client.post("/v1/completions", json=body, headers={
            "authorization": f"Bearer {secret}", "x-session-id": f"{tenant}-{session}"})
        assert resp.status_code == 200, resp.text
        obj = resp.json()
        text = obj["choices"][0]["text"]
        answers.append((tenant, text, obj.get("usage") or {}))
        history += f"Entry:{text.strip()}\n"


def test_no_answer_carries_the_other_tenants_marker(gateway, llama_server, tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    secrets = {t: store.create(t)[1] for t in MARKERS}
    store.close()
    gw = gateway(upstream_config(llama_server.url) + f'\n[auth]\ndb = "{tmp_path / "keys.db"}"\n')
    answers: list[tuple[str, str, dict]] = []

    async def drive() -> None:
        async with httpx.AsyncClient(base_url=gw.url, timeout=300) as client:
            # 6 sessions on 4 slots, three turns each: slots are taken over, idle slots saved to the
            # cache and restored while the other tenant's sessions run
            await asyncio.gather(*(run_session(client, secrets[t], t, s, 3, answers)
                                   for s in range(3) for t in MARKERS))
            # then one session alone, two turns: its second turn is served from the cache
            await run_session(client, secrets["harbour"], "harbour", 9, 2, answers)

    asyncio.run(drive())
    assert len(answers) == 20
    for tenant, text, _ in answers:
        other = next(m for t, m in MARKERS.items() if t != tenant)
        assert other not in text, f"{tenant}'s answer carries the other tenant's marker: {text!r}"
    # the canary can sing: sessions do repeat their own marker (else the check above proves nothing)
    for tenant, marker in MARKERS.items():
        assert any(marker in text for t, text, _ in answers if t == tenant)
    # passerelle reports the runtime's own cache figures (under concurrent load with more sessions
    # than slots this llama-server reports none reused, direct as through passerelle: bench/sessions.py)
    cached = [u.get("prompt_tokens_details", {}).get("cached_tokens") for _, _, u in answers]
    assert all(isinstance(n, int) for n in cached) and cached[-1] > 0
    recs = [r for r in gw.access_log() if r.get("endpoint") == "completions"]
    assert recs[-1]["cached_tokens"] == cached[-1]


def test_cached_tokens_in_each_apis_usage_shape(gateway, llama_server):
    gw = gateway(upstream_config(llama_server.url))
    text = PREAMBLE + " Say one word."
    shapes = {
        "/v1/chat/completions": ({"messages": [{"role": "user", "content": text}], "max_tokens": 2},
                                 lambda u: u["prompt_tokens_details"]["cached_tokens"]),
        "/v1/responses": ({"input": text, "max_output_tokens": 2},
                          lambda u: u["input_tokens_details"]["cached_tokens"]),
        "/v1/messages": ({"messages": [{"role": "user", "content": text}], "max_tokens": 2},
                         lambda u: u["cache_read_input_tokens"]),
    }
    with httpx.Client(base_url=gw.url, timeout=300) as client:
        for path, (body, cached) in shapes.items():
            seen = []
            for _ in range(2):  # the same prompt twice, one session: the second is served from the cache
                resp = client.post(path, json={"model": MODEL_ID, **body}, headers={"x-session-id": path})
                assert resp.status_code == 200, resp.text
                seen.append(cached(resp.json()["usage"]))
            assert seen[1] > 0, (path, seen)
