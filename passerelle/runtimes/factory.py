"""What the configuration asks to run: its backends (the embedded default included), each as a
:class:`Backend` and, for those with a ``launch`` command, a supervised :class:`RuntimeProcess`."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

from passerelle.config import CACHED_LLAMA_SERVER, BackendConfig, Config, ModelConfig, TimeoutConfig
from passerelle.endpoints import ENDPOINTS
from passerelle.errors import ConfigError
from passerelle.runtimes import embedded, rpc, tiny_reranker
from passerelle.runtimes.kinds import Backend, make_backend
from passerelle.runtimes.llama_server import clean_saved_kv
from passerelle.runtimes.prerequisites import MissingPrerequisites
from passerelle.runtimes.supervisor import RuntimeProcess

# What the embedded chat instance serves: every endpoint but those that need llama-server started
# in another mode (--embeddings, --reranking), each a process of its own.
CHAT_ENDPOINTS = tuple(e.name for e in ENDPOINTS if not e.mode)


def embedded_backends(cfg: Config) -> tuple[BackendConfig, ...]:
    """The embedded llama-server (built once): one chat instance, one for embeddings and one for
    reranking, since llama-server started with ``--embeddings`` or ``--reranking`` serves only that."""
    e = cfg.embedded
    try:
        build = embedded.llama_server_build(e.llama_server or None, flavour=e.flavour)
    except (MissingPrerequisites, subprocess.CalledProcessError) as exc:  # a flavour that cannot be built here
        raise ConfigError(f"flavour {e.flavour!r}: {exc}", file=cfg.source, key="embedded.flavour") from None
    binary = build.binary
    flavour = build.flavour
    # a GPU flavour offloads every layer unless extra_args says otherwise
    offload = () if {"-ngl", "--n-gpu-layers", "--gpu-layers"} & set(e.extra_args) else build.launch_args

    def env(cmd: tuple[str, ...]) -> tuple[str, ...]:  # e.g. lavapipe: GGML_VK_VISIBLE_DEVICES, via env(1)
        return ("env", *build.launch_env, *cmd) if build.launch_env else cmd

    builtin = None if e.model_path else embedded.BUILTIN[e.model]
    model = Path(e.model_path).expanduser() if builtin is None else embedded.ensure_model(builtin.id)
    if not model.is_file():
        raise ConfigError(f"model file {model} does not exist", file=cfg.source, key="embedded.model_path")
    endpoints: tuple[str, ...] = CHAT_ENDPOINTS
    fim: tuple[str, ...] = ()
    if builtin is not None:
        # Text only (no multimodal projector: no /v1/audio/transcriptions), and /infill only where
        # the model has fill-in-the-middle tokens: Gemma 3 has none, so three of its unused special
        # tokens stand for them and /infill runs llama-server's real infill path (the text is not a
        # coder model's); SmolLM2 has none and no unused token to spare, so its /infill is not served.
        # A GGUF of one's own gets every route; what its runtime refuses is dropped once it is up
        # (LlamaServerBackend.unserved).
        fim = builtin.fim
        endpoints = tuple(x for x in CHAT_ENDPOINTS if x != "transcriptions" and (x != "infill" or fim))
    served = e.served_id
    # No max_concurrency: each llama-server reports its slots (/props total_slots), see capacity.py.
    out = [BackendConfig(name="local", kind="llama-server", models=(served,), endpoints=endpoints,
                         flavour=flavour,
                         launch=env(embedded.launch_command(binary, model, alias=served, slots=e.slots,
                                                        ctx_per_slot=e.ctx_per_slot, threads=e.threads,
                                                        extra=(*offload, *fim, *e.extra_args))))]
    if e.embeddings:
        # The context /v1/models advertises for the model (the chat runtime's slot): an input to
        # embed may be that long.
        out.append(BackendConfig(
            name="local-embed", kind="llama-server", models=(served,), endpoints=("embeddings",),
            flavour=flavour, launch=env(embedded.launch_command(binary, model, alias=served, slots=1,
                                                                ctx_per_slot=e.ctx_per_slot, threads=e.threads,
                                                                embeddings=True, extra=offload))))
    if e.rerank:
        ranker = Path(e.rerank_model_path).expanduser() if e.rerank_model_path else tiny_reranker.ensure_tiny_reranker()
        if not ranker.is_file():
            raise ConfigError(f"model file {ranker} does not exist", file=cfg.source, key="embedded.rerank_model_path")
        out.append(BackendConfig(
            name="local-rerank", kind="llama-server", models=(e.rerank_model_id,), endpoints=("rerank",),
            flavour=flavour, launch=env(embedded.launch_command(binary, ranker, alias=e.rerank_model_id, slots=1,
                                                                ctx_per_slot=2048, threads=e.threads,
                                                                reranking=True, extra=offload))))
    return tuple(out)


# What the embedded default model can do: a small text model (no vision, no audio), declared so
# that an image or audio part sent to it gets a clear 400 (proxy/capabilities.py), not the runtime's 500.
EMBEDDED_CAPABILITIES = ("chat", "completions", "embeddings")


def embedded_models(cfg: Config) -> tuple[ModelConfig, ...]:
    """The catalogue entry of the embedded default model: its capabilities, and its client aliases
    (``[embedded] aliases``, the ``claude-*`` and ``gpt-*`` names coding agents ask for); none when a
    ``[[models]]`` entry already describes that model (the file's entries replace it). A model of
    the operator's own (``embedded.model_path``) may see or hear: its capabilities are not declared."""
    e = cfg.embedded
    if any(m.target == e.served_id or m.name == e.served_id for m in cfg.models):
        return ()
    capabilities = () if e.model_path else EMBEDDED_CAPABILITIES
    if not capabilities and not e.aliases:
        return ()
    return (ModelConfig(name=e.served_id, aliases=e.aliases, capabilities=capabilities),)


def expand(cfg: Config) -> Config:
    """``cfg`` with the embedded runtime spelled out when it lists no backend, and the routes
    ``[server] extra_routes`` adds given to every backend."""
    if cfg.uses_embedded:
        cfg = dataclasses.replace(cfg, backends=embedded_backends(cfg), models=(*cfg.models, *embedded_models(cfg)))
    if any(b.launch[:1] == (CACHED_LLAMA_SERVER,) for b in cfg.backends):
        cfg = dataclasses.replace(cfg, backends=tuple(_with_cached_binary(b, cfg.source) for b in cfg.backends))
    extra = cfg.server.extra_routes
    if extra:
        cfg = dataclasses.replace(cfg, backends=tuple(
            dataclasses.replace(b, extra_routes=tuple(dict.fromkeys((*extra, *b.extra_routes))))
            for b in cfg.backends))
    return cfg


def _with_cached_binary(bc: BackendConfig, source: str) -> BackendConfig:
    """``launch = ["{llama-server}", …]`` → the cached build's path (never a build here: minutes)."""
    if bc.launch[:1] != (CACHED_LLAMA_SERVER,):
        return bc
    binary = embedded.cached_binary()
    if not binary.is_file():
        raise ConfigError(f"backend {bc.name!r} launches {CACHED_LLAMA_SERVER}, the cached llama-server build, "
                          f"and there is none at {binary}: run `passerelle setup` first", file=source,
                          key="backends.launch")
    return dataclasses.replace(bc, launch=(str(binary), *bc.launch[1:]))


def build_runtime(bc: BackendConfig, timeouts: TimeoutConfig,
                  state: Path | None = None) -> tuple[Backend, RuntimeProcess | None]:
    """The backend for ``bc``, and its process if passerelle launches it; its output goes to
    ``log_file``, else to ``logs/NAME.log`` in the instance's state directory ``state``."""
    backend = make_backend(bc, timeouts)
    if not bc.launch:
        return backend, None
    log_path = Path(bc.log_file) if bc.log_file else state / "logs" / f"{bc.name}.log" if state else None
    launch = rpc.head_command(bc)  # a split's head: the members and the layer split added
    if bc.kind == "llama-server" and runs_llama_server(launch):
        launch, backend.slot_save_dir = with_slot_save_path(launch, state / "slot-kv" / bc.name if state else None)
    proc = RuntimeProcess(backend, launch, ready_timeout_s=bc.ready_timeout_s, log_path=log_path)
    if bc.rpc:
        rpc.SplitGroup(proc, bc.rpc)  # a split: its health needs every member (attached as its watcher)
    return backend, proc


def rpc_workers(cfg: Config) -> list[RuntimeProcess]:
    """The supervised rpc-servers this box lends its memory with (``[[rpc_workers]]``)."""
    return [rpc.worker_runtime(w, cfg.timeouts, cfg.state_path(), source=cfg.source) for w in cfg.rpc_workers]


def runs_llama_server(launch: tuple[str, ...]) -> bool:
    """Whether the command starts llama-server itself (directly or through a wrapper such as
    ``nice`` or ``env``): only then is ``--slot-save-path`` added, so a stand-in that speaks its API
    (a test's fake runtime, a script of the user's) is launched as written."""
    return any(Path(arg).name.startswith("llama-server") for arg in launch[:4])


def with_slot_save_path(launch: tuple[str, ...], default: Path | None) -> tuple[tuple[str, ...], Path | None]:
    """A llama-server's command with a ``--slot-save-path`` (its own, else ``default``), and that
    directory, emptied of saved KV no gateway knows any more (sessions' KV, scheduling/session_kv.py)."""
    given = next((launch[i + 1] for i, a in enumerate(launch[:-1]) if a == "--slot-save-path"), None)
    directory = Path(given) if given else default
    if directory is None:
        return launch, None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return launch, None
    clean_saved_kv(directory)
    return (launch if given else (*launch, "--slot-save-path", str(directory))), directory
