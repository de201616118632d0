"""Shared fixtures: a real llama-server (built by ``make setup``), the fake backend, and the
gateway as a real subprocess on loopback; and, for every test, a watch on the gateways it ran: an
``internal_error`` (a fault of the gateway itself) fails the test, unless the test is marked
``@pytest.mark.internal_error_expected`` because it provokes one on purpose."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from passerelle.runtimes.supervisor import free_port
from tests.waiting import wait_until

MODEL_ID = "gemma-3-270m"
# Every gateway subprocess a test started (Gateway objects register themselves): the watch below reads
# what each logged during each test.
GATEWAYS: list[Gateway] = []


def http_ok(url: str) -> bool:
    return httpx.get(url, timeout=1.0).status_code == 200


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    model: str = MODEL_ID
    extra: dict = field(default_factory=dict)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(10)
        return self.proc.returncode


@dataclass
class Gateway(Server):
    def __post_init__(self) -> None:
        GATEWAYS.append(self)

    def openai(self):
        """An OpenAI SDK client for this gateway, closed when the test ends."""
        import openai

        client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)
        self.extra.setdefault("clients", []).append(client)
        return client

    def anthropic(self, api_key: str = "unused"):
        """An Anthropic SDK client for this gateway (it sends the key as x-api-key)."""
        import anthropic

        client = anthropic.Anthropic(base_url=self.url, api_key=api_key, max_retries=0)
        self.extra.setdefault("clients", []).append(client)
        return client

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        for client in self.extra.pop("clients", []):
            client.close()
        return super().stop(sig, timeout)

    def access_log(self) -> list[dict]:
        """The access log's lines so far. A request's line is written after its last byte went out,
        on the gateway's next event-loop pass: one more request answered by the gateway (its
        ``/health``) orders this read after that pass for every response the test has already read."""
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(self.url + "/health", timeout=5)
        out = []
        for line in self.log_text().splitlines():
            if line.startswith("{") and '"request_id"' in line:
                out.append(json.loads(line))
        return out

    def log_for(self, request_id: str, timeout: float = 5.0) -> dict:
        return wait_until(lambda: next((r for r in self.access_log() if r["request_id"] == request_id), None),
                          timeout, what=f"access log line of {request_id}")

    def children(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


def _log_size(gw: Gateway) -> int:
    try:
        return gw.log_path.stat().st_size
    except OSError:
        return 0


def _internal_errors_logged(gw: Gateway, since: int) -> list[str]:
    """Access-log lines with cause internal_error that ``gw`` wrote after byte ``since``."""
    if gw.proc.poll() is None and _log_size(gw) > since:
        # a request's line is written on the gateway's next pass after its last byte: one more
        # request orders this read after it (see Gateway.access_log)
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(gw.url + "/health", timeout=5)
    try:
        with open(gw.log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.startswith("{") and '"cause":"internal_error"' in line]


@pytest.fixture(autouse=True)
def own_state(tmp_path_factory, monkeypatch) -> None:
    """Every test's gateways keep their keys, usage, batch files and learned memory in a directory
    of the test's own ($PASSERELLE_STATE), never in the user's ~/.local/state/passerelle: that one
    is shared by every run on the machine (SQLite files written by tests running side by side) and
    what the tests wrote there stayed behind."""
    monkeypatch.setenv("PASSERELLE_STATE", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(autouse=True)
def no_internal_error(request, monkeypatch) -> Iterator[None]:
    """Fail the test when a gateway it ran ended a request with ``internal_error``: the in-process
    apps' records (every ``Gateway.account``) and the access logs of the gateway subprocesses
    (those started during the test, and the lines a shared one wrote during it). Not for a test
    marked ``internal_error_expected`` (it injects one on purpose)."""
    from passerelle.errors import Cause
    from passerelle.proxy.gateway import Gateway as InProcess

    if request.node.get_closest_marker("internal_error_expected"):
        yield
        return
    seen: list[str] = []
    account = InProcess.account

    def watched(self, rec) -> None:
        if rec.cause is Cause.INTERNAL_ERROR:
            seen.append(f"{rec.endpoint} {rec.id}: {rec.error}")
        account(self, rec)

    monkeypatch.setattr(InProcess, "account", watched)
    offsets = {id(gw): _log_size(gw) for gw in GATEWAYS}
    yield
    for gw in list(GATEWAYS):
        seen += _internal_errors_logged(gw, offsets.get(id(gw), 0))
        if gw.proc.poll() is not None:
            GATEWAYS.remove(gw)  # (stopped: nothing more to read)
    if seen:
        pytest.fail("a gateway ended requests with internal_error (a fault of the gateway; mark the test "
                    "internal_error_expected only if it provokes one on purpose):\n" + "\n".join(seen[:10]),
                    pytrace=False)


@pytest.fixture(scope="session")
def llama_paths() -> tuple[Path, Path]:
    from passerelle.runtimes import embedded

    return embedded.find_or_build_llama_server(), embedded.ensure_gemma()


@pytest.fixture(scope="session")
def tiny_llama_path() -> Path:
    """A second chat model, genuinely different from Gemma (a small random-weight Llama, 137 MB,
    about 0.3 GiB loaded): written once (about a second), cached under ~/.cache/passerelle/models."""
    from passerelle.testing.tiny_llama_gguf import ensure_tiny_llama

    return ensure_tiny_llama()


def start_llama(binary: Path, model: Path, log_path: Path, *, slots: int = 4, ctx_per_slot: int = 2048,
                extra: tuple[str, ...] = (), alias: str = MODEL_ID) -> Server:
    port = free_port()
    logf = open(log_path, "wb")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen([str(binary), "-m", str(model), "--alias", alias, "--host", "127.0.0.1",
                             "--port", str(port), "-np", str(slots), "-c", str(slots * ctx_per_slot),
                             # one thread: the other core stays for the gateway and the test itself
                             "--metrics", "--slots", "--no-webui", "-t", "1", *extra],
                            # (its own process group, not its own session: a session is a scheduler
                            # autogroup of its own, which took the CPU from the gateway and the test
                            # for seconds at a time; passerelle/testing/netns.py)
                            stdout=logf, stderr=subprocess.STDOUT, process_group=0)
    logf.close()
    server = Server(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path, model=alias)
    try:
        wait_until(lambda: (proc.poll() is not None and (_ for _ in ()).throw(
            AssertionError(f"llama-server exited:\n{server.log_text()[-2000:]}"))) or http_ok(server.url + "/health"),
            120, what="llama-server /health")
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return server


@pytest.fixture(scope="session")
def llama_server(llama_paths, tmp_path_factory) -> Iterator[Server]:
    """A real llama-server (Gemma 3 270M, 4 slots) shared by the session; with the embedded
    default's fill-in-the-middle tokens, so /infill runs."""
    from passerelle.runtimes.embedded import GEMMA_FIM_OVERRIDES

    binary, model = llama_paths
    server = start_llama(binary, model, tmp_path_factory.mktemp("llama") / "llama-server.log",
                         extra=GEMMA_FIM_OVERRIDES)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reranker_server(llama_paths, tmp_path_factory) -> Iterator[Server]:
    """A real llama-server started with --reranking on the tiny reranking GGUF the embedded default
    makes (runtimes/tiny_reranker.py), shared by the session."""
    from passerelle.runtimes.tiny_reranker import MODEL_ID as RERANK_ID
    from passerelle.runtimes.tiny_reranker import write_tiny_reranker

    binary, _ = llama_paths
    folder = tmp_path_factory.mktemp("reranker")
    model = write_tiny_reranker(folder / "tiny-reranker.gguf")
    server = start_llama(binary, model, folder / "llama-server.log", slots=1,
                         extra=("--reranking", "-b", "2048", "-ub", "2048"), alias=RERANK_ID)
    yield server
    server.stop()


def tokens_decoded(server_url: str) -> int:
    """Tokens generated so far by the busiest slot (0 during prompt processing)."""
    out = 0
    for s in httpx.get(server_url + "/slots", timeout=2).json():
        if s.get("is_processing"):
            nxt = s.get("next_token") or [{}]
            out = max(out, int((nxt[0] if isinstance(nxt, list) else nxt).get("n_decoded", 0)))
    return out


def slots_busy(server_url: str) -> int:
    return sum(1 for s in httpx.get(server_url + "/slots", timeout=2).json() if s.get("is_processing"))


@pytest.fixture
def fake_backend(tmp_path) -> Callable[..., Server]:
    """Start ``passerelle fake-backend`` with the given options; stopped after the test."""
    started: list[Server] = []

    def start(**opts) -> Server:
        port = free_port()
        args = [sys.executable, "-m", "passerelle", "fake-backend", "--port", str(port)]
        for k, v in opts.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        log_path = tmp_path / f"fake-{port}.log"
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT)
        server = Server(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path,
                        model=opts.get("model", "fake-model"))
        started.append(server)
        wait_until(lambda: http_ok(server.url + "/health"), 30, what="fake backend /health")
        return server

    yield start
    for s in started:
        s.stop(signal.SIGKILL)


@pytest.fixture
def gateway(tmp_path) -> Callable[..., Gateway]:
    """Start ``passerelle serve`` as a subprocess with a TOML configuration text."""
    started: list[Gateway] = []

    def start(config: str = "", *, args: tuple[str, ...] = (), env: dict[str, str] | None = None,
              wait_ready: bool = True, timeout: float = 120) -> Gateway:
        port = free_port()
        cfg_path = tmp_path / f"gateway-{port}.toml"
        cfg_path.write_text(textwrap.dedent(config))
        log_path = tmp_path / f"gateway-{port}.log"
        cmd = [sys.executable, "-m", "passerelle", "serve", "--config", str(cfg_path), "--port", str(port), *args]
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1",
                                         "PASSERELLE_STATE": str(tmp_path / "state"), **(env or {})})
        gw = Gateway(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path, extra={"config": cfg_path})
        started.append(gw)

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"gateway exited with {proc.returncode}:\n{gw.log_text()[-3000:]}")
            return http_ok(gw.url + ("/ready" if wait_ready else "/health"))

        wait_until(up, timeout, what="gateway readiness")
        return gw

    yield start
    for gw in started:
        gw.stop()


def upstream_config(url: str, *, model: str = MODEL_ID, kind: str = "llama-server", slots: int = 4,
                    extra: str = "") -> str:
    return f"""
    [[backends]]
    name = "b1"
    kind = "{kind}"
    url = "{url}"
    models = ["{model}"]
    max_concurrency = {slots}
    {extra}
    """


@pytest.fixture
def llama_server_on_path(tmp_path, monkeypatch):
    """A `llama-server` on PATH, as an installed llama.cpp provides it (the example configuration
    launches one, and the configuration checks that the program exists)."""
    stub = tmp_path / "bin" / "llama-server"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stub.parent}:{os.environ['PATH']}")
