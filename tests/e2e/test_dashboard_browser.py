"""The dashboard in a real headless Chromium (Debian's ``chromium``, over the DevTools protocol):
loaded while real traffic from llama-server flows, it updates live, and every number it shows
matches ``/admin/stats``. A screenshot is saved in the test's folder (and copied to
``$PASSERELLE_DASHBOARD_PNG`` when set, which is how docs/dashboard.png is made)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import MODEL_ID, upstream_config
from tests.e2e.cdp import Chromium
from tests.waiting import until

pytestmark = pytest.mark.llama

PAGE_NUMBERS = """Array.from(document.querySelectorAll('[data-k]'))
  .map(e => [e.dataset.k, e.dataset.f, e.textContent.trim()])"""


def lookup(stats: dict[str, Any], path: str) -> Any:
    value: Any = stats
    for part in path.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def shown_number(text: str, unit_scale: dict[str, float]) -> tuple[float, float]:
    """(value, half a unit of its last digit) of a number as the page writes it, e.g. '1.25 s'."""
    m = re.fullmatch(r"(-?\d+(?:\.(\d+))?)\s*(\S*)", text)
    assert m, f"not a number: {text!r}"
    scale = unit_scale.get(m.group(3), 0.0)
    assert scale, f"unexpected unit in {text!r}"
    decimals = len(m.group(2) or "")
    return float(m.group(1)) * scale, 0.5 * 10 ** -decimals * scale + 1e-9


def mismatches(items: list[list[str]], stats: dict[str, Any]) -> list[str]:
    """Every number on the page that does not say what ``stats`` says (empty: all agree)."""
    bad = []
    for key, fmt, text in items:
        try:
            ok = _agrees(fmt, text, lookup(stats, key))
        except (AssertionError, KeyError, IndexError) as exc:  # the page's copy is a poll older: a
            ok, text = False, f"{text} ({exc})"  # number not shown yet, a row not there yet
        if not ok:
            bad.append(f"{key}: page shows {text!r}, /admin/stats says {lookup_or_none(stats, key)!r}")
    return bad


def _agrees(fmt: str, text: str, want: Any) -> bool:
    """Does the page's ``text`` say ``want`` in the format ``fmt``?"""
    if fmt == "ago":
        ok = re.fullmatch(r"\d+ s ago|\d+ min ago|—", text) is not None
    elif fmt == "up":
        ok = text.startswith("● up") if want else text.startswith("● down")
    elif want is None:
        ok = text in ("—", "not reported")
    elif fmt == "int":
        ok = text == str(int(want))
    elif fmt == "ms":
        got, tol = shown_number(text, {"ms": 1.0, "s": 1000.0})
        ok = abs(got - want) <= tol
    elif fmt == "pct":
        got, tol = shown_number(text, {"%": 0.01})
        ok = abs(got - want) <= tol
    else:  # rates: the page's copy is up to a second older and rates are over a growing window
        got, tol = shown_number(text, {"": 1.0})
        ok = abs(got - want) <= tol + 0.1 * abs(want)
    return ok


def lookup_or_none(stats: dict[str, Any], path: str) -> Any:
    try:
        return lookup(stats, path)
    except (KeyError, IndexError):
        return None


async def traffic(url: str, stop: asyncio.Event, counts: dict[str, int]) -> None:
    """Two clients, one standard and one batch, streaming until told to stop (at most 40 each);
    and one request for a model that does not exist, so that a failure shows."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.post(url + "/v1/chat/completions", json={"model": "no-such-model", "messages": [
                {"role": "user", "content": "hi"}]}) as r:
            assert r.status == 404

        async def client(priority: str) -> None:
            for i in range(40):
                if stop.is_set():
                    return
                body = {"model": MODEL_ID, "stream": True, "max_tokens": 6, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"Write about lighthouse {i} ({priority})."}]}
                async with session.post(url + "/v1/chat/completions", json=body,
                                        headers={"X-Priority": priority}) as r:
                    assert r.status == 200
                    await r.read()
                counts[priority] = counts.get(priority, 0) + 1

        await asyncio.gather(client("standard"), client("batch"))


async def test_dashboard_in_chromium_is_live_and_matches_admin_stats(gateway, llama_server, tmp_path):
    gw = gateway(upstream_config(llama_server.url))
    stop, counts = asyncio.Event(), {}
    async with Chromium(tmp_path / "chromium") as browser, aiohttp.ClientSession() as http:
        await browser.navigate(gw.url + "/ui")
        load = asyncio.create_task(traffic(gw.url, stop, counts))
        try:
            async def page_value(key: str) -> str | None:
                return await browser.evaluate(f"(document.querySelector('[data-k=\"{key}\"]') || {{}}).textContent")

            # live: the page fills in and keeps refreshing while requests flow
            async def has_latency(cls: str) -> bool:
                return (await page_value(f"classes.{cls}.ttft_ms.p95") or "—") != "—"

            await until(lambda: has_latency("standard"), 30, "a standard request's TTFT on the page", interval=0.1)
            await until(lambda: has_latency("batch"), 30, "a batch request's TTFT on the page", interval=0.1)
            first = int(await page_value("totals.requests"))
            await until(lambda: _gt(page_value("totals.requests"), first), 30, "the request count to go up",
                        interval=0.1)
            assert (await page_value("backends.0.slots_total")) == "4"
            assert (await page_value("backends.0.up")).startswith("● up")
        finally:
            stop.set()
            await load
        assert counts.get("standard", 0) >= 1 and counts.get("batch", 0) >= 1

        async def agree() -> bool:
            async with http.get(gw.url + "/admin/stats") as r:
                stats = await r.json()
            items = await browser.evaluate(PAGE_NUMBERS)
            bad = mismatches(items, stats)
            agree.last = bad  # type: ignore[attr-defined]
            return not bad and stats["totals"]["requests"] == counts["standard"] + counts["batch"] + 1

        try:
            await until(agree, 10, "every number on the page to match /admin/stats", interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {getattr(agree, 'last', None)}") from None
        items = await browser.evaluate(PAGE_NUMBERS)
        keys = {k for k, _, _ in items}
        assert {"classes.standard.ttft_ms.p50", "classes.batch.itl_ms.p95", "totals.tokens_per_s",
                "causes.ok", "causes.invalid_request", "backends.0.slots_busy", "backends.0.queue_depth"} <= keys
        # one TTFT line per class that had traffic, p95 and p50 each; a tokens/s line per class
        assert await browser.evaluate("document.querySelectorAll('#ttft-chart svg path').length") == 4
        assert await browser.evaluate("document.querySelectorAll('#tps-chart svg path').length") == 2
        assert "no-such-model" in await browser.evaluate("document.getElementById('errors').textContent")
        assert not [m for m in browser.console if m.startswith("exception")], browser.console
        shot = await browser.screenshot(tmp_path / "dashboard.png")
    assert shot.stat().st_size > 10_000
    if target := os.environ.get("PASSERELLE_DASHBOARD_PNG"):
        shutil.copyfile(shot, Path(target))


async def _gt(value, than: int) -> bool:
    text = await value
    return text is not None and text.isdigit() and int(text) > than
