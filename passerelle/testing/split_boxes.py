"""passerelle on boxes that are network namespaces, for the tests and the benchmark of a model split
with llama.cpp's RPC (runtimes/rpc.py) and of replicas on two boxes: the configurations of a head,
a lending box and a box of its own, and a gateway started inside a box.

Example::

    with Network("sb", boxes=2) as net:
        head, member = net.boxes
        lend = start_in_box(member, worker_config(member.address, admin=net.subnet), folder / "m")
        big = start_in_box(head, split_config(head.address, binary, model, [f"{member.address}:50052"],
                                              admin=net.subnet), folder / "h")
        big.wait("/ready")
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from passerelle.testing.netns import Box

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_PORT = 8080
RPC_PORT = 50052


def _admin(subnet: str) -> str:
    # the team's side of the bridge (the test or the benchmark) reads /admin/runtimes
    return f'[admin]\nallow = ["127.0.0.0/8", "{subnet}.0/24"]\n'


def llama_launch(binary: Path | str, model: Path | str, *, alias: str, slots: int, ctx_per_slot: int = 1024,
                 threads: int = 1, extra: tuple[str, ...] = ()) -> str:
    """A ``launch = [...]`` line for a llama-server passerelle supervises."""
    parts = [str(binary), "-m", str(model), "--alias", alias, "--host", "127.0.0.1", "--port", "{port}",
             "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(threads), "--metrics", "--slots",
             "--no-webui", *extra]
    return "launch = [" + ", ".join(f'"{p}"' for p in parts) + "]"


def box_config(address: str, binary: Path | str, model: Path | str, *, alias: str, slots: int = 4,
               threads: int = 1, admin: str, name: str = "one", port: int = GATEWAY_PORT) -> str:
    """A box serving the whole model with one llama-server of its own."""
    return f"""[server]
host = "{address}"
port = {port}
{_admin(admin)}
[[backends]]
name = "{name}"
kind = "llama-server"
models = ["{alias}"]
max_concurrency = {slots}
ready_timeout_s = 180
{llama_launch(binary, model, alias=alias, slots=slots, threads=threads)}
"""


def split_config(address: str, binary: Path | str, model: Path | str, members: list[str], *, alias: str,
                 slots: int = 4, threads: int = 1, layers_on_members: int = 9, admin: str,
                 name: str = "split", port: int = GATEWAY_PORT) -> str:
    """The head of a split: its llama-server keeps some layers and puts ``layers_on_members`` on
    the members (a CPU head: ``-ngl`` is what the RPC devices hold)."""
    quoted = ", ".join(f'"{m}"' for m in members)
    return f"""[server]
host = "{address}"
port = {port}
{_admin(admin)}
[[backends]]
name = "{name}"
kind = "llama-server"
models = ["{alias}"]
max_concurrency = {slots}
ready_timeout_s = 180
rpc = [{quoted}]
{llama_launch(binary, model, alias=alias, slots=slots, threads=threads, extra=("-ngl", str(layers_on_members)))}
"""


def worker_table(address: str, *, rpc_server: Path | str = "", threads: int = 1, rpc_port: int = RPC_PORT) -> str:
    """The ``[[rpc_workers]]`` table of a box that lends its memory (on its own address)."""
    binary = f'rpc_server = "{rpc_server}"\n' if rpc_server else ""
    return f"""
[[rpc_workers]]
name = "lend"
host = "{address}"
port = {rpc_port}
threads = {threads}
{binary}"""


def worker_config(address: str, *, admin: str, rpc_server: Path | str = "", threads: int = 1,
                  port: int = GATEWAY_PORT, rpc_port: int = RPC_PORT) -> str:
    """A box that only lends its memory: a supervised rpc-server on its own address."""
    return (f'[server]\nhost = "{address}"\nport = {port}\n{_admin(admin)}'
            + worker_table(address, rpc_server=rpc_server, threads=threads, rpc_port=rpc_port))


def replicas_config(urls: list[str], *, alias: str, slots: int, port: int, host: str = "127.0.0.1") -> str:
    """One gateway over replicas on other boxes, each a ``[[backends]]`` URL."""
    out = f'[server]\nhost = "{host}"\nport = {port}\n'
    for i, url in enumerate(urls, 1):
        out += f"""
[[backends]]
name = "box{i}"
kind = "openai"
url = "{url}"
models = ["{alias}"]
max_concurrency = {slots}
"""
    return out


@dataclass
class BoxGateway:
    """``passerelle serve`` running in a box (or on this machine: ``box`` None)."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, path: str = "/ready", timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"passerelle at {self.url} exited with {self.proc.returncode}:\n"
                                   f"{self.log_text()[-3000:]}")
            try:
                if httpx.get(self.url + path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"passerelle at {self.url}: {path} not 200 after {timeout:g} s:\n{self.log_text()[-3000:]}")

    def runtimes(self) -> dict[str, dict[str, object]]:
        rows = httpx.get(self.url + "/admin/runtimes", timeout=10).json()["runtimes"]
        return {str(r["name"]): r for r in rows}

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_gateway(config: str, folder: Path, *, box: Box | None = None, host: str = "127.0.0.1",
                  port: int = GATEWAY_PORT) -> BoxGateway:
    """Write ``config`` and start ``passerelle serve`` with it (inside ``box`` when given), its
    state and log in ``folder``; this checkout's code, whatever the virtualenv has installed."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "passerelle.toml"
    path.write_text(config)
    log_path = folder / "passerelle.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PASSERELLE_STATE": str(folder / "state"),
           "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "passerelle", "serve", "--config", str(path)]
    with open(log_path, "ab") as logf:
        if box is not None:
            proc = box.popen(argv, stdout=logf, env=env, cwd=ROOT)
            host = box.address
        else:
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    process_group=0)  # (not a session: see Box.popen)
    return BoxGateway(url=f"http://{host}:{port}", proc=proc, log_path=log_path)
