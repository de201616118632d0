"""The ``passerelle`` command: serve, setup, keys, bench, agentcheck, fake-backend."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from passerelle import __version__

if TYPE_CHECKING:
    from passerelle.config import BackendConfig, Config
    from passerelle.server.app import App

log = logging.getLogger("passerelle")


def _setup_logging(fmt: str = "text") -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _version_text() -> str:
    from passerelle.runtimes import embedded

    built = embedded.built_flavours()
    runtime = "; ".join(f"llama.cpp from llama-cpp-python {i['llama_cpp_python']} ({i['flavour']}; "
                        f"{' / '.join(i['llama_server_version'])})" for i in built) if built \
        else f"llama.cpp from llama-cpp-python {embedded.LLAMA_CPP_PYTHON_VERSION} (not built yet)"
    return f"passerelle {__version__}\nembedded runtime: {runtime}"


def _parse_upstream(spec: str, index: int) -> BackendConfig:
    """``URL`` or ``KIND=URL`` → a BackendConfig, asking the server for its kind and models."""
    from passerelle.config import BackendConfig
    from passerelle.errors import ConfigError
    from passerelle.runtimes.kinds import KINDS, detect_upstream

    kind, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
    if kind and kind not in KINDS:
        raise ConfigError(f"unknown kind '{kind}'; expected one of {', '.join(KINDS)}", file="--upstream")
    url = url.rstrip("/").removesuffix("/v1")
    try:
        detected, models = asyncio.run(detect_upstream(url))
    except Exception as exc:
        raise ConfigError(f"cannot read {url}/v1/models: {exc}", file="--upstream") from None
    if not models:
        raise ConfigError(f"{url}/v1/models lists no model", file="--upstream")
    # No max_concurrency: the backend asks the runtime, or learns it (runtimes/capacity.py).
    return BackendConfig(name=f"upstream{index}", kind=kind or detected, url=url, models=tuple(models))


def build_app(cfg: Config, loader: Callable[[], Config] | None = None) -> App:
    """The ASGI app for ``cfg`` with its supervised runtimes (nothing started yet); ``loader``
    re-reads the configuration on reload."""
    from passerelle.runtimes.factory import build_runtime, expand, rpc_workers
    from passerelle.server.app import App

    configured = not cfg.uses_embedded
    cfg = expand(cfg)
    built = [build_runtime(bc, cfg.timeouts, cfg.state_path()) for bc in cfg.backends]
    return App(cfg, [b for b, _ in built], [*(p for _, p in built if p is not None), *rpc_workers(cfg)],
               loader=loader, backends_configured=configured)


def cmd_serve(args: argparse.Namespace) -> int:
    from passerelle.config import load_config, with_server
    from passerelle.errors import ConfigError
    from passerelle.server.sdnotify import Notifier
    from passerelle.server.serving import gateway_server

    _setup_logging()
    # systemd's notify socket, taken out of the environment before a runtime is launched
    notifier = Notifier.from_env()
    try:
        upstreams = tuple(_parse_upstream(u, i) for i, u in enumerate(args.upstream or [], 1))
        def loader() -> Config:
            return with_server(load_config(args.config, upstreams=upstreams), host=args.host, port=args.port,
                               log_format=args.log_format)

        cfg = loader()
        app = build_app(cfg, loader)
    except ConfigError as exc:
        print(f"passerelle: configuration error: {exc}", file=sys.stderr)
        return 2
    # Bind before anything starts, so a port in use is said first and plainly (not after the
    # runtimes started and the start-up lines claimed the gateway was serving).
    try:
        sock = _bind(cfg.server.host, cfg.server.port)
    except OSError as exc:
        print(f"passerelle: cannot listen on {cfg.server.host}:{cfg.server.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    app.notifier = notifier  # READY, watchdog, RELOADING, STOPPING (server/sdnotify.py)
    server = gateway_server(app, app.cfg)  # client limits, descriptor budget, clean shutdown: server/serving.py
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, through the handlers that were
    # in place before it started; no-op handlers make a graceful stop exit with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    return 0 if server.started else 1


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def cmd_setup(args: argparse.Namespace) -> int:
    import subprocess

    from passerelle.runtimes import embedded
    from passerelle.runtimes.prerequisites import MissingPrerequisites

    try:
        build = embedded.llama_server_build(flavour=args.flavour)
    except MissingPrerequisites as exc:
        print(f"passerelle: {exc}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as exc:  # CMake printed why; its work folder is kept to resume
        print(f"passerelle: the llama-server build failed ({' '.join(exc.cmd[:2])}… exited {exc.returncode}); "
              "CMake's output above says why", file=sys.stderr)
        return 1
    model = embedded.ensure_default_model()
    gemma = embedded.ensure_gemma()  # the other built-in model ([embedded] model), which the tests use
    detected = f" (detected: {build.detection.reason})" if build.detection and args.flavour == "auto" else ""
    rpc_server = embedded.cached_rpc_server(build.spec) if build.spec is not None else None
    worker = f"rpc-server: {rpc_server}\n" if rpc_server is not None and rpc_server.is_file() else ""
    print(f"llama-server: {build.binary}\n{worker}flavour: {build.flavour}{detected}\nmodel: {model}\nalso: {gemma}\n"
          f"{_version_text()}")
    return 0


def cmd_bench_flavours(args: argparse.Namespace) -> int:
    """``passerelle bench flavours``: the builds and their launches come from the embedded runtime,
    the measuring from the bench."""
    from passerelle.bench import flavours as bench
    from passerelle.bench.cli import _command, build_levels
    from passerelle.runtimes import embedded

    if args.bench_command == "backends":
        print("passerelle: `bench backends` is deprecated; it is called `bench flavours` now", file=sys.stderr)
    if args.out is None:
        print("passerelle: bench flavours: --out DIR is required", file=sys.stderr)
        return 2
    model = Path(args.model_file).expanduser() if args.model_file else embedded.ensure_default_model()
    if not model.is_file():
        print(f"passerelle: bench flavours: model file {model} does not exist", file=sys.stderr)
        return 2
    args = bench.sized(args)
    try:
        launches = embedded.flavour_launches(model, alias=bench.MODEL_ALIAS, slots=args.slots,
                                             ctx_per_slot=args.ctx_per_slot, threads=args.threads,
                                             wanted=args.flavours.split(",") if args.flavours else None)
    except ValueError as exc:
        print(f"passerelle: bench flavours: {exc}", file=sys.stderr)
        return 2
    if not launches:
        print("passerelle: bench flavours: no llama-server build cached; run `passerelle setup --flavour …`",
              file=sys.stderr)
        return 2
    flavours = [bench.Flavour(x["name"], x["command"], x["env"], x["info"], x["driver"]) for x in launches]
    command = bench.command_line(args, _command(args, "bench flavours"))
    return bench.finish(bench.run(args, flavours, model, build_levels, command), args.out)


def admin_address(cfg: Config) -> str:
    """Where a gateway run with ``cfg`` answers its admin routes: the admin port when it has one,
    else the main one (an address listening everywhere is reached on loopback)."""
    host, port = (cfg.admin.host, cfg.admin.port) if cfg.admin.port else (cfg.server.host, cfg.server.port)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def _admin_call(args: argparse.Namespace, method: str, path: str) -> tuple[int, bytes]:
    import os
    import urllib.error
    import urllib.request

    base, key = args.url, args.admin_key
    if getattr(args, "config", None) is not None:  # port and admin key from the gateway's own file
        from passerelle.config import load_config
        from passerelle.errors import ConfigError

        try:
            cfg = load_config(args.config)
        except ConfigError as exc:
            return 0, f"configuration error: {exc}".encode()
        base, key = base or admin_address(cfg), key or cfg.admin.key or None
    url = (base or os.environ.get("PASSERELLE_URL") or "http://127.0.0.1:8080").rstrip("/") + path
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    key = key or os.environ.get("PASSERELLE_ADMIN_KEY")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError as exc:
        return 0, f"cannot reach the gateway at {url}: {exc}".encode()


def _admin_result(status: int, body: bytes, ok_text: str | None = None) -> int:
    if status == 200:
        print(ok_text if ok_text is not None else body.decode(errors="replace").rstrip())
        return 0
    try:
        import orjson

        message = orjson.loads(body)["error"]["message"]
    except Exception:
        message = body.decode(errors="replace")
    print(f"passerelle: {message}", file=sys.stderr)
    return 1


def cmd_runtime(args: argparse.Namespace) -> int:
    from passerelle.server.control import render

    if args.action == "list":
        status, body = _admin_call(args, "GET", "/admin/runtimes")
        return _admin_result(status, body, render(body) if status == 200 else None)
    if not args.name:
        print(f"passerelle: runtime {args.action} needs a NAME", file=sys.stderr)
        return 2
    if args.action == "logs":
        status, body = _admin_call(args, "GET", f"/admin/runtimes/{args.name}/logs?lines={args.lines}")
        return _admin_result(status, body)
    status, body = _admin_call(args, "POST", f"/admin/runtimes/{args.name}/{args.action}")
    return _admin_result(status, body)


def cmd_reload(args: argparse.Namespace) -> int:
    status, body = _admin_call(args, "POST", "/admin/reload?force=1" if args.force else "/admin/reload")
    return _admin_result(status, body)


def cmd_service(args: argparse.Namespace) -> int:
    import shlex

    from passerelle.server.unit import UnitOptions, render

    config = str(Path(args.config).resolve()) if args.config else UnitOptions.config
    program = f"{shlex.quote(sys.executable)} -m passerelle"  # this installation, virtualenv or not
    text = render(UnitOptions(exec_start=program, config=config, user=args.user or ""))
    if args.output == "-":
        print(text, end="")
        return 0
    out = Path(args.output)
    try:
        out.write_text(text)
        out.chmod(0o644)
    except OSError as exc:
        print(f"passerelle: cannot write {out}: {exc.strerror or exc} (run it as root, or --output - to print it)",
              file=sys.stderr)
        return 1
    if not Path(config).exists():
        print(f"note: {config} does not exist yet (copy passerelle.example.toml there)", file=sys.stderr)
    print(f"wrote {out}\nnext: systemctl daemon-reload && systemctl enable --now {out.stem}")
    return 0


def _add_admin_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="the gateway's configuration file: its port (or admin port) and "
                                               "[admin] key")
    p.add_argument("--url", help="the gateway (or its admin port); default: from --config, $PASSERELLE_URL or "
                                 "http://127.0.0.1:8080")
    p.add_argument("--admin-key", help="[admin] key, when set (default: from --config, $PASSERELLE_ADMIN_KEY)")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait (a start may take long)")


class _Renamed(argparse.Action):
    """An option's old name: still taken (a command line only grows), with a note naming the new one."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"passerelle: {option_string} is deprecated; it is called --{self.dest} now", file=sys.stderr)
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="passerelle",
        description="An OpenAI-compatible gateway in front of local LLM runtimes: streaming pass-through, "
                    "priority and fair share, metrics, runtime supervision, multi-user benchmarks.")
    parser.add_argument("--version", action="store_true", help="show versions (passerelle, embedded llama.cpp)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from passerelle.config import EMBEDDED_MODELS, EmbeddedConfig

    default = EmbeddedConfig().model  # what a bare `serve` really serves
    others = [m for m in EMBEDDED_MODELS if m != default]
    serve = sub.add_parser("serve", help=f"serve the gateway (default: an embedded llama-server with {default}; "
                                         f"[embedded] model also takes {', '.join(others)})")
    serve.add_argument("--config", type=Path, help="TOML configuration file (see passerelle.example.toml)")
    serve.add_argument("--upstream", action="append", metavar="[KIND=]URL",
                       help="serve an existing OpenAI-compatible server (repeatable; KIND one of "
                            "llama-server, vllm, ollama, sglang, openai; detected when omitted)")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8080)")
    serve.add_argument("--log-format", choices=("json", "text"), help="access log format (default json)")
    serve.set_defaults(func=cmd_serve)

    from passerelle.tenants.cli import add_parsers as add_key_parsers

    add_key_parsers(sub)

    runtime = sub.add_parser("runtime", help="list (state; memory estimated vs measured; the budget and swaps), "
                                             "start, stop, restart the runtimes a running gateway launched, "
                                             "or show their logs")
    runtime.add_argument("action", choices=("list", "start", "stop", "restart", "logs"))
    runtime.add_argument("name", nargs="?", help="the backend name (all but list)")
    runtime.add_argument("--lines", type=int, default=100, help="lines of log to show (logs)")
    _add_admin_client_flags(runtime)
    runtime.set_defaults(func=cmd_runtime)

    reload_ = sub.add_parser("reload", help="make a running gateway re-read its configuration (like SIGHUP)")
    reload_.add_argument("--force", action="store_true",
                         help="reload even a file that lists no backend while backends are configured "
                              "(refused otherwise: it would drain them all for the embedded default)")
    _add_admin_client_flags(reload_)
    reload_.set_defaults(func=cmd_reload)

    from passerelle.server.unit import DEFAULT_CONFIG, DEFAULT_PATH

    service = sub.add_parser("service", help="install the systemd unit that runs this gateway as a service")
    service.add_argument("action", choices=("install",))
    service.add_argument("--config", help=f"the configuration file the service serves (default {DEFAULT_CONFIG})")
    service.add_argument("--user", help="run as this user (default: a dynamic user systemd allocates)")
    service.add_argument("--output", default=DEFAULT_PATH, help=f"where to write the unit (default {DEFAULT_PATH}; "
                                                               "- prints it)")
    service.set_defaults(func=cmd_service)

    from passerelle.config import EMBEDDED_FLAVOURS

    setup = sub.add_parser("setup", help="build llama-server and assemble the default model (idempotent)")
    setup.add_argument("--flavour", choices=EMBEDDED_FLAVOURS, default="auto",
                       help="the llama-server build: auto (this machine's GPU: CUDA, ROCm, a Vulkan GPU, else CPU), "
                            "or one by name; builds are cached side by side (default auto)")
    setup.add_argument("--backend", dest="flavour", choices=EMBEDDED_FLAVOURS, default=argparse.SUPPRESS,
                       action=_Renamed, help=argparse.SUPPRESS)  # --flavour's old name
    setup.set_defaults(func=cmd_setup)

    from passerelle.bench.agentcheck_cli import add_parser as add_agentcheck_parser
    from passerelle.bench.cli import add_parser as add_bench_parser
    from passerelle.testing.fake_runtime import add_parser as add_fake_parser

    add_bench_parser(sub, cmd_bench_flavours)
    add_agentcheck_parser(sub)
    add_fake_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(_version_text())
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)
