"""A headless Chromium (Debian's ``chromium``) driven over the DevTools protocol, with aiohttp's
websocket client: navigate, evaluate JavaScript, take screenshots. Never downloads a browser."""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import aiohttp

from tests.waiting import until

CHROMIUM = os.environ.get("PASSERELLE_CHROMIUM", "/usr/bin/chromium")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
         "--hide-scrollbars", "--mute-audio")


class Chromium:
    def __init__(self, profile_dir: Path, width: int = 1280, height: int = 900) -> None:
        self.profile_dir = profile_dir
        self.width, self.height = width, height
        self.proc: subprocess.Popen | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.console: list[str] = []

    async def __aenter__(self) -> Chromium:
        binary = shutil.which(CHROMIUM)
        assert binary, f"{CHROMIUM} is missing: install Debian's 'chromium' package (.ci/run does)"
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.profile_dir / "chromium.log", "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [binary, *FLAGS, "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile_dir}", f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        port_file = self.profile_dir / "DevToolsActivePort"

        def port() -> str | None:
            assert self.proc is not None and self.proc.poll() is None, \
                f"chromium exited: {(self.profile_dir / 'chromium.log').read_text(errors='replace')[-2000:]}"
            text = port_file.read_text() if port_file.exists() else ""
            return text.split()[0] if text.strip() else None

        devtools_port = await until(port, 30, "chromium's DevTools port", interval=0.1)
        self._session = aiohttp.ClientSession()

        async def page_target() -> str | None:
            async with self._session.get(f"http://127.0.0.1:{devtools_port}/json/list") as r:  # type: ignore[union-attr]
                targets = await r.json()
            return next((t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page"), None)

        ws_url = await until(page_target, 15, "chromium's page target", interval=0.1)
        self._ws = await self._session.ws_connect(ws_url, max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        await self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                        deviceScaleFactor=1, mobile=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the browser and its helpers
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    async def _read(self) -> None:
        assert self._ws is not None
        async for msg in self._ws:
            data = msg.json()
            fut = self._pending.pop(data.get("id", -1), None)
            if fut is not None and not fut.done():
                fut.set_result(data)
            elif data.get("method") == "Runtime.consoleAPICalled":
                self.console.append(" ".join(str(a.get("value", a.get("description", "")))
                                             for a in data["params"]["args"]))
            elif data.get("method") == "Runtime.exceptionThrown":
                self.console.append("exception: " + data["params"]["exceptionDetails"].get("text", ""))

    async def send(self, method: str, timeout: float = 30, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        i = next(self._ids)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        await self._ws.send_json({"id": i, "method": method, "params": params})
        data = await asyncio.wait_for(fut, timeout)
        if "error" in data:
            raise RuntimeError(f"{method}: {data['error']}")
        return data["result"]

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await until(lambda: self.evaluate("document.readyState === 'complete'"), 15, f"{url} to load", interval=0.1)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path, *, full_page: bool = True) -> Path:
        height = self.height
        if full_page:
            height = int(await self.evaluate("document.documentElement.scrollHeight"))
            await self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=height,
                            deviceScaleFactor=1, mobile=False)
        shot = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))
        return path
