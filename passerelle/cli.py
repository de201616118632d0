"""The ``passerelle`` command: serve, setup, keys, bench, fake-backend."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

from passerelle import __version__

log = logging.getLogger("passerelle")


def _setup_logging(fmt: str = "text") -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _version_text() -> str:
    from passerelle.runtimes import embedded

    info = embedded.build_info()
    runtime = (f"llama.cpp from llama-cpp-python {info['llama_cpp_python']} ({info['flavour']}; "
               f"{' / '.join(info['llama_server_version'])})" if info
               else f"llama.cpp from llama-cpp-python {embedded.LLAMA_CPP_PYTHON_VERSION} (not built yet)")
    return f"passerelle {__version__}\nembedded runtime: {runtime}"


def _parse_upstream(spec: str, index: int):
    """``URL`` or ``KIND=URL`` → a BackendConfig, asking the server for its kind and models."""
    from passerelle.config import BackendConfig
    from passerelle.errors import ConfigError
    from passerelle.runtimes.kinds import KINDS, detect_upstream

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


def build_app(cfg, loader=None):
    """The ASGI app for ``cfg`` with its supervised runtimes (nothing started yet); ``loader``
    re-reads the configuration on reload."""
    from passerelle.runtimes.factory import build_runtime, expand
    from passerelle.server.app import App

    cfg = expand(cfg)
    built = [build_runtime(bc, cfg.timeouts) for bc in cfg.backends]
    return App(cfg, [b for b, _ in built], [p for _, p in built if p is not None], loader=loader)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from passerelle.config import load_config, with_server
    from passerelle.errors import ConfigError

    _setup_logging()
    try:
        upstreams = tuple(_parse_upstream(u, i) for i, u in enumerate(args.upstream or [], 1))
        def loader():
            return with_server(load_config(args.config, upstreams=upstreams), host=args.host, port=args.port,
                               log_format=args.log_format)

        cfg = loader()
        app = build_app(cfg, loader)
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
    from passerelle.runtimes import embedded

    binary = embedded.find_or_build_llama_server()
    model = embedded.ensure_default_model()
    print(f"llama-server: {binary}\nmodel: {model}\n{_version_text()}")
    return 0


def _store(args: argparse.Namespace):
    from passerelle.config import load_config
    from passerelle.tenants.keys import KeyStore

    cfg = load_config(args.config)
    return cfg, KeyStore(args.db or cfg.auth.db or None)


def cmd_keys(args: argparse.Namespace) -> int:
    from passerelle.errors import ConfigError

    try:
        cfg, store = _store(args)
    except ConfigError as exc:
        print(f"passerelle: configuration error: {exc}", file=sys.stderr)
        return 2
    classes = [c.name for c in cfg.classes]
    if args.keys_command == "create":
        for value in (args.priority, args.max_priority):
            if value is not None and value not in classes:
                print(f"passerelle: unknown class '{value}'; expected one of {', '.join(classes)}", file=sys.stderr)
                return 2
        key, secret = store.create(args.tenant, priority=args.priority, max_priority=args.max_priority,
                                   rpm=args.rpm, tpm=args.tpm, max_concurrency=args.max_concurrency,
                                   weight=args.weight)
        print(secret)
        print(f"key {key.id} for tenant '{key.tenant}' created; the key above is shown only once "
              f"(store: {store.path})", file=sys.stderr)
        return 0
    if args.keys_command == "list":
        rows = store.list()
        print(f"{'ID':14}{'TENANT':18}{'CLASS':13}{'MAX CLASS':13}{'RPM':>6}{'TPM':>9}{'CONC':>6}{'WEIGHT':>8}"
              f"  {'CREATED':20}STATUS")
        for k in rows:
            print(f"{k.id:14}{k.tenant:18}{k.priority or '-':13}{k.max_priority or '-':13}{k.rpm or '-':>6}"
                  f"{k.tpm or '-':>9}{k.max_concurrency or '-':>6}{k.weight:>8g}  "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(k.created)):20}"
                  f"{'revoked' if k.revoked else 'active'}")
        return 0
    if args.keys_command == "revoke":
        if store.revoke(args.id):
            print(f"key {args.id} revoked")
            return 0
        print(f"passerelle: no active key with id {args.id}", file=sys.stderr)
        return 1
    return 2


def _parse_since(text: str | None) -> float:
    """``2026-11-30``, ``2026-11-30T12:00``, or a duration back from now: ``90m``, ``24h``, ``7d``."""
    if not text:
        return 0.0
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if text[-1] in units and text[:-1].replace(".", "", 1).isdigit():
        return time.time() - float(text[:-1]) * units[text[-1]]
    from datetime import datetime

    return datetime.fromisoformat(text).timestamp()


def cmd_usage(args: argparse.Namespace) -> int:
    from passerelle.tenants.usage import summarize

    try:
        since = _parse_since(args.since)
    except ValueError:
        print(f"passerelle: cannot read --since {args.since!r}; use 2026-11-30, 2026-11-30T12:00 or 24h",
              file=sys.stderr)
        return 2
    _, store = _store(args)
    rows = summarize(store.conn, since)
    print(f"{'TENANT':20}{'CLASS':13}{'REQUESTS':>10}{'PROMPT TOK':>12}{'COMPL TOK':>12}{'NOT OK':>8}")
    for tenant, cls, n, p, c, bad in rows:
        print(f"{tenant:20}{cls:13}{n:>10}{p or 0:>12}{c or 0:>12}{bad or 0:>8}")
    return 0


def _admin_call(args: argparse.Namespace, method: str, path: str) -> tuple[int, bytes]:
    import os
    import urllib.error
    import urllib.request

    url = (args.url or os.environ.get("PASSERELLE_URL") or "http://127.0.0.1:8080").rstrip("/") + path
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    key = args.admin_key or os.environ.get("PASSERELLE_ADMIN_KEY")
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
    status, body = _admin_call(args, "POST", "/admin/reload")
    return _admin_result(status, body)


def _add_admin_client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="the gateway (or its admin port); default $PASSERELLE_URL or http://127.0.0.1:8080")
    p.add_argument("--admin-key", help="[admin] key, when set (default $PASSERELLE_ADMIN_KEY)")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait (a start may take long)")


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

    keys = sub.add_parser("keys", help="create, list and revoke API keys (stored hashed in SQLite)")
    keys.add_argument("--config", type=Path, help="configuration file (for [auth] db and the classes)")
    keys.add_argument("--db", help="the SQLite store (default: [auth] db, else "
                      "~/.local/state/passerelle/passerelle.db)")
    ksub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    create = ksub.add_parser("create", help="create a key and print it once")
    create.add_argument("--tenant", required=True, help="who the key belongs to (fair share and usage)")
    create.add_argument("--priority", help="class of its requests (default: the anonymous class)")
    create.add_argument("--max-priority", help="most urgent class X-Priority may raise it to (default: --priority)")
    create.add_argument("--rpm", type=int, default=0, help="requests per minute (0: unlimited)")
    create.add_argument("--tpm", type=int, default=0, help="tokens per minute, prompt + max_tokens (0: unlimited)")
    create.add_argument("--max-concurrency", type=int, default=0, help="requests at once (0: unlimited)")
    create.add_argument("--weight", type=float, default=1.0, help="fair-share weight of the tenant (default 1)")
    ksub.add_parser("list", help="list keys (never their secrets)")
    revoke = ksub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("id")
    keys.set_defaults(func=cmd_keys)

    usage = sub.add_parser("usage", help="requests and tokens per tenant and class")
    usage.add_argument("--config", type=Path)
    usage.add_argument("--db", help="the SQLite store")
    usage.add_argument("--since", help="2026-11-30, 2026-11-30T12:00, or back from now: 90m, 24h, 7d")
    usage.set_defaults(func=cmd_usage)

    runtime = sub.add_parser("runtime", help="list (state; memory estimated vs measured; the budget and swaps), "
                                             "start, stop, restart the runtimes a running gateway launched, "
                                             "or show their logs")
    runtime.add_argument("action", choices=("list", "start", "stop", "restart", "logs"))
    runtime.add_argument("name", nargs="?", help="the backend name (all but list)")
    runtime.add_argument("--lines", type=int, default=100, help="lines of log to show (logs)")
    _add_admin_client_flags(runtime)
    runtime.set_defaults(func=cmd_runtime)

    reload_ = sub.add_parser("reload", help="make a running gateway re-read its configuration (like SIGHUP)")
    _add_admin_client_flags(reload_)
    reload_.set_defaults(func=cmd_reload)

    setup = sub.add_parser("setup", help="build llama-server and assemble the default model (idempotent)")
    setup.set_defaults(func=cmd_setup)

    from passerelle.bench.cli import add_parser as add_bench_parser
    from passerelle.testing.fake_runtime import add_parser as add_fake_parser

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
