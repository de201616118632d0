"""Boxes for the several-boxes tests: a network namespace each (passerelle/testing/netns.py) with
its own passerelle bound to its own address, and the team's gateway in the root namespace
listing them in ``[[boxes]]``."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import httpx

from passerelle.testing.netns import Box, Network
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
PORT = 8080
# A box key as an operator makes one (the [admin] key check refuses weak ones).
BOX_KEY = "bk_" + secrets.token_urlsafe(24)


@dataclass
class BoxGateway:
    box: Box
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{self.box.address}:{PORT}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def box_admin(net: Network) -> str:
    """The [admin] table of a box: the box key, and the team's gateway (the bridge's address) allowed."""
    return f"""
    [admin]
    key = "{BOX_KEY}"
    allow = ["{net.address}/32", "127.0.0.0/8"]
    """


def fake_box_config(net: Network, *, slots: int = 2, ttft_ms: int = 50, itl_ms: int = 20,
                    on_demand: bool = False, model: str = "fake-model") -> str:
    """A box serving the fake runtime (launched and supervised by the box's passerelle)."""
    launch = [sys.executable, "-m", "passerelle", "fake-backend", "--port", "{port}", "--slots", str(slots),
              "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms), "--model", model]
    quoted = ", ".join(f'"{a}"' for a in launch)
    return box_admin(net) + f"""
    [[backends]]
    name = "fake"
    kind = "llama-server"
    launch = [{quoted}]
    models = ["{model}"]
    max_concurrency = {slots}
    on_demand = {str(on_demand).lower()}
    memory_gib = 0.5
    """


def llama_box_config(net: Network) -> str:
    """A box serving the embedded default (the real llama-server and its small model), kept small."""
    return box_admin(net) + """
    [embedded]
    slots = 2
    ctx_per_slot = 2048
    threads = 1
    embeddings = false
    rerank = false
    aliases = []
    """


def start_box(box: Box, folder: Path, config: str, *, timeout: float = 180) -> BoxGateway:
    """``passerelle serve`` inside ``box``, bound to its address; returns once it is ready."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = folder / f"{box.name}.toml"
    cfg.write_text(textwrap.dedent(config))
    log_path = folder / f"{box.name}.log"
    with open(log_path, "ab") as logf:
        proc = box.popen([sys.executable, "-m", "passerelle", "serve", "--config", str(cfg), "--host", box.address,
                          "--port", str(PORT)], stdout=logf, cwd=REPO,
                         env={**os.environ, "PYTHONUNBUFFERED": "1",
                              "PASSERELLE_STATE": str(folder / f"{box.name}-state")})
    bg = BoxGateway(box, proc, log_path)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"box {box.name} exited with {proc.returncode}:\n{bg.log_text()[-3000:]}")
        try:
            return httpx.get(bg.url + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(ready, timeout, what=f"box {box.name} ready")
    return bg


def boxes_config(net: Network, *, extra: str = "", poll_s: float = 0.5, timeout_s: float = 1.0) -> str:
    """The team's gateway: every box of ``net`` in [[boxes]]."""
    out = extra
    for box in net.boxes:
        out += f"""
    [[boxes]]
    name = "{box.name}"
    url = "http://{box.address}:{PORT}"
    key = "{BOX_KEY}"
    poll_s = {poll_s}
    timeout_s = {timeout_s}
    """
    return out


def stop_box(bg: BoxGateway) -> None:
    if bg.proc.poll() is None:
        bg.proc.send_signal(signal.SIGTERM)
        try:
            bg.proc.wait(30)
        except subprocess.TimeoutExpired:
            bg.box.kill()
