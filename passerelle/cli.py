"""The ``passerelle`` command: serve, setup, keys, bench, fake-backend."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from passerelle import __version__

log = logging.getLogger("passerelle")


def _setup_logging(fmt: str = "text") -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _version_text() -> str:
    from passerelle import embedded

    info = embedded.build_info()
    runtime = (f"llama.cpp from llama-cpp-python {info['llama_cpp_python']} ({info['flavour']}; "
               f"{' / '.join(info['llama_server_version'])})" if info
               else f"llama.cpp from llama-cpp-python {embedded.LLAMA_CPP_PYTHON_VERSION} (not built yet)")
    return f"passerelle {__version__}\nembedded runtime: {runtime}"


def _parse_upstream(spec: str, index: int):
    """``URL`` or ``KIND=URL`` → a BackendConfig, asking the server for its kind and models."""
    from passerelle.backends import KINDS, detect_upstream
    from passerelle.config import BackendConfig
    from passerelle.errors import ConfigError

    kind, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
    if kind and kind not in KINDS:
        raise ConfigError(f"unknown kind '{kind}'; expected one of {', '.join(KINDS)}", file="--upstream")
    url = url.rstrip("/").removesuffix("/v1")
    try:
        detected, models, slots = asyncio.run(detect_upstream(url))
    except Exception as exc:
        raise ConfigError(f"cannot read {url}/v1/models: {exc}", file="--upstream") from None
    if not models:
        raise ConfigError(f"{url}/v1/models lists no model", file="--upstream")
    return BackendConfig(name=f"upstream{index}", kind=kind or detected, url=url, models=tuple(models),
                         max_concurrency=slots or 16)


def _embedded_backends(cfg):
    """Build (once) and describe the embedded llama-server: one chat instance, one for embeddings."""
    from passerelle import embedded
    from passerelle.config import BackendConfig

    e = cfg.embedded
    binary = embedded.find_or_build_llama_server(e.llama_server or None)
    model = Path(e.model_path).expanduser() if e.model_path else embedded.ensure_default_model()
    if not model.is_file():
        from passerelle.errors import ConfigError

        raise ConfigError(f"model file {model} does not exist", file=cfg.source, key="embedded.model_path")
    chat = BackendConfig(name="local", kind="llama-server", models=(e.model_id,), endpoints=("chat", "completions"),
                         max_concurrency=e.slots,
                         launch=embedded.launch_command(binary, model, alias=e.model_id, slots=e.slots,
                                                        ctx_per_slot=e.ctx_per_slot, threads=e.threads,
                                                        extra=e.extra_args))
    out = [chat]
    if e.embeddings:
        out.append(BackendConfig(name="local-embed", kind="llama-server", models=(e.model_id,),
                                 endpoints=("embeddings",), max_concurrency=1,
                                 launch=embedded.launch_command(binary, model, alias=e.model_id, slots=1,
                                                                ctx_per_slot=2048, threads=e.threads,
                                                                embeddings=True)))
    return out


def build_app(cfg):
    """The ASGI app for ``cfg`` with its supervised runtimes (nothing started yet)."""
    import dataclasses

    from passerelle.app import App
    from passerelle.backends import make_backend
    from passerelle.supervisor import RuntimeProcess, Supervisor

    if cfg.uses_embedded:
        cfg = dataclasses.replace(cfg, backends=tuple(_embedded_backends(cfg)))
    backends, processes = [], []
    for bc in cfg.backends:
        backend = make_backend(bc, cfg.timeouts)
        backends.append(backend)
        if bc.launch:
            processes.append(RuntimeProcess(backend, bc.launch, ready_timeout_s=bc.ready_timeout_s,
                                            log_path=Path(bc.log_file) if bc.log_file else None))
    return App(cfg, backends, Supervisor(processes))


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from passerelle.config import load_config, with_server
    from passerelle.errors import ConfigError

    _setup_logging()
    try:
        upstreams = tuple(_parse_upstream(u, i) for i, u in enumerate(args.upstream or [], 1))
        cfg = load_config(args.config, upstreams=upstreams)
        cfg = with_server(cfg, host=args.host, port=args.port, log_format=args.log_format)
        app = build_app(cfg)
    except ConfigError as exc:
        print(f"passerelle: configuration error: {exc}", file=sys.stderr)
        return 2
    server = uvicorn.Server(uvicorn.Config(
        app, host=cfg.server.host, port=cfg.server.port, loop="uvloop", http="httptools", lifespan="on",
        access_log=False, log_level="warning", timeout_graceful_shutdown=int(cfg.server.shutdown_grace_s),
        timeout_keep_alive=30))
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, through the handlers that were
    # in place before it started; no-op handlers make a graceful stop exit with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1


def cmd_setup(args: argparse.Namespace) -> int:
    from passerelle import embedded

    binary = embedded.find_or_build_llama_server()
    model = embedded.ensure_default_model()
    print(f"llama-server: {binary}\nmodel: {model}\n{_version_text()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="passerelle",
        description="An OpenAI-compatible gateway in front of local LLM runtimes: streaming pass-through, "
                    "priority and fair share, metrics, runtime supervision, multi-user benchmarks.")
    parser.add_argument("--version", action="store_true", help="show versions (passerelle, embedded llama.cpp)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve the gateway (default: an embedded llama-server with Gemma 3 270M)")
    serve.add_argument("--config", type=Path, help="TOML configuration file (see passerelle.example.toml)")
    serve.add_argument("--upstream", action="append", metavar="[KIND=]URL",
                       help="serve an existing OpenAI-compatible server (repeatable; KIND one of "
                            "llama-server, vllm, ollama, sglang, openai; detected when omitted)")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8080)")
    serve.add_argument("--log-format", choices=("json", "text"), help="access log format (default json)")
    serve.set_defaults(func=cmd_serve)

    setup = sub.add_parser("setup", help="build llama-server and assemble the default model (idempotent)")
    setup.set_defaults(func=cmd_setup)

    from passerelle.bench.cli import add_parser as add_bench_parser
    from passerelle.fake_backend import add_parser as add_fake_parser

    add_bench_parser(sub)
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
    return args.func(args)
