"""The dashboard with ``[admin] key`` set, in a real headless Chromium: /ui shows the login form, the
key logs the browser in (an HttpOnly cookie that the page's script cannot read), and the page then
polls /admin/stats with that cookie and shows live figures. The fake runtime stands behind the
gateway: the point is the browser's part, not the model."""

from __future__ import annotations

import asyncio
import json
import signal
import textwrap

import httpx

from tests.conftest import upstream_config
from tests.e2e.cdp import Chromium
from tests.waiting import until

KEY = "e2e-6a1f9c3b0d8e27f4c1b5"  # strong enough for [admin] key


async def test_the_dashboard_logs_in_with_the_admin_key_and_goes_live(gateway, fake_backend, tmp_path):
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    gw = gateway(upstream_config(fake.url, model="fake-model") + f'\n[admin]\nkey = "{KEY}"\n')
    async with Chromium(tmp_path / "chromium") as browser:
        async def page(expression: str) -> bool:  # False while a navigation replaces the page
            try:
                return bool(await browser.evaluate(expression))
            except RuntimeError:
                return False

        await browser.navigate(gw.url + "/ui")
        assert await browser.evaluate("!!document.querySelector('form[action=\"/admin/login\"] input[name=key]')")
        await browser.evaluate("document.querySelector('input[name=key]').value = 'wrong';"
                               "document.querySelector('form').submit(); true")
        await until(lambda: page("document.body.textContent.includes('not the admin key')"), 15,
                    "the login form to say the key is wrong", interval=0.1)
        await browser.evaluate(f"document.querySelector('input[name=key]').value = {json.dumps(KEY)};"
                               "document.querySelector('form').submit(); true")
        await until(lambda: page("location.pathname === '/ui' && !!document.getElementById('status')"), 15,
                    "the dashboard after the login", interval=0.1)
        await until(lambda: page("document.getElementById('status').textContent.startsWith('updated')"), 15,
                    "the dashboard's first figures from /admin/stats", interval=0.1)
        assert await browser.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
        assert await browser.evaluate("getComputedStyle(document.getElementById('keybox')).display") == "none"
        assert not [m for m in browser.console if m.startswith("exception")], browser.console


def _former_key_polls(gw, key: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10, headers={"Authorization": f"Bearer {key}"}).text
    name = 'passerelle_admin_key_failures_total{reason="former_key",route="admin"}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def test_after_the_key_changes_the_open_dashboard_stops_polling_and_asks_for_a_login(
        gateway, fake_backend, tmp_path):
    # It polled /admin/stats every second whatever the answer: with its cookie of the former key,
    # sixty failed attempts at the admin key a minute from the admin's own browser.
    fake = fake_backend(ttft_ms=5, itl_ms=1)
    backend = upstream_config(fake.url, model="fake-model")
    gw = gateway(backend + f'\n[admin]\nkey = "{KEY}"\n')
    async with Chromium(tmp_path / "chromium") as browser:
        async def page(expression: str) -> bool:
            try:
                return bool(await browser.evaluate(expression))
            except RuntimeError:
                return False

        await browser.navigate(gw.url + "/ui")
        await browser.evaluate(f"document.querySelector('input[name=key]').value = {json.dumps(KEY)};"
                               "document.querySelector('form').submit(); true")
        await until(lambda: page("document.getElementById('status').textContent.startsWith('updated')"), 15,
                    "the dashboard's first figures", interval=0.1)
        new_key = "e2e-0d8e27f4c1b56a1f9c3b"
        gw.extra["config"].write_text(textwrap.dedent(backend) + f'\n[admin]\nkey = "{new_key}"\n')
        gw.proc.send_signal(signal.SIGHUP)
        await until(lambda: page("getComputedStyle(document.getElementById('keybox')).display === 'block'"), 15,
                    "the dashboard asking for the admin key", interval=0.1)
        polls = _former_key_polls(gw, new_key)
        await asyncio.sleep(3)  # (three polls' worth: the dashboard must make none)
        assert _former_key_polls(gw, new_key) == polls <= 2
        assert await page("document.getElementById('status').textContent.includes('log in again')")
