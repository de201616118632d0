"""The dashboard's "Models on this box" panel in a real headless Chromium, with two on-demand
llama-servers of two different models (Gemma, the tiny Llama) under a budget that holds one: it
shows which model is loaded, a request waiting for the other one's load, then the swap (why,
drain, load), and its numbers match /admin/stats."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from passerelle.testing.tiny_llama_gguf import MODEL_ID as TINY_ID
from tests.conftest import MODEL_ID
from tests.e2e.cdp import Chromium
from tests.e2e.test_dashboard_browser import PAGE_NUMBERS, mismatches
from tests.integration.test_replicas_llama import replica
from tests.waiting import until

pytestmark = pytest.mark.llama


async def stream(session: aiohttp.ClientSession, url: str, model: str, max_tokens: int) -> None:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me about lighthouses."}]}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        await r.read()


async def test_models_panel_shows_loaded_models_waiting_requests_and_swaps(gateway, llama_paths, tiny_llama_path,
                                                                          tmp_path):
    binary, model = llama_paths
    od = "on_demand = true\n"
    gw = gateway("[runtimes]\nmax_loaded_gib = 0.55\nmin_resident_s = 0\n"
                 + replica("a", binary, model, models=(MODEL_ID,), extra=od)
                 + replica("b", binary, tiny_llama_path, models=(TINY_ID,), extra=od))
    async with Chromium(tmp_path / "chromium") as browser, aiohttp.ClientSession() as http:
        await browser.navigate(gw.url + "/ui")

        async def text(selector: str) -> str:
            return await browser.evaluate(f"(document.querySelector('{selector}') || {{}}).textContent || ''")

        await until(lambda: _contains(text("#models"), "not loaded"), 30, "both runtimes shown, not loaded",
                    interval=0.1)
        # a's stream runs until the page has shown b waiting and a draining, then its client leaves:
        # a condition, not a race between 40 tokens and the page's poll
        long_a = asyncio.create_task(stream(http, gw.url, MODEL_ID, 1500))
        await until(lambda: _contains(text('tr[data-runtime="a"]'), "● loaded"), 60, "a shown loaded", interval=0.1)
        for_b = asyncio.create_task(stream(http, gw.url, TINY_ID, 2))
        # b waits while a drains its stream: the page shows the request waiting for b's load
        await until(lambda: _contains(text('[data-runtime-waiting="b"]'), "1"), 30, "b's waiting request shown",
                    interval=0.1)
        await until(lambda: _contains(text('tr[data-runtime="a"]'), "unloading"), 30, "a shown draining", interval=0.1)
        long_a.cancel()
        await asyncio.gather(long_a, return_exceptions=True)
        await asyncio.wait_for(for_b, 120)
        await until(lambda: _contains(text("#swaps"), "its residency was over"), 30, "the swap listed", interval=0.1)
        row = await text("#swaps tr")
        assert "a" in row and "b" in row
        assert "● loaded" in await text('tr[data-runtime="b"]')

        async def agree() -> bool:
            async with http.get(gw.url + "/admin/stats") as r:
                stats = await r.json()
            bad = mismatches(await browser.evaluate(PAGE_NUMBERS), stats)
            agree.last = bad  # type: ignore[attr-defined]
            return not bad

        try:
            await until(agree, 10, "every number on the page to match /admin/stats", interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {getattr(agree, 'last', None)}") from None
        assert "GiB budget loaded" in await text("#budget")
        assert not [m for m in browser.console if m.startswith("exception")], browser.console
        await browser.screenshot(tmp_path / "dashboard-models.png")


async def _contains(value, needle: str) -> bool:
    return needle in (await value)
