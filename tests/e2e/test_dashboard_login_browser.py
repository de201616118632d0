"""The dashboard with ``[admin] key`` set, in a real headless Chromium: /ui shows the login form, the
key logs the browser in (an HttpOnly cookie that the page's script cannot read), and the page then
polls /admin/stats with that cookie and shows live figures. The fake runtime stands behind the
gateway: the point is the browser's part, not the model."""

from __future__ import annotations

import json

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
