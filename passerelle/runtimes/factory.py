"""What the configuration asks to run: its backends (the embedded default included), each as a
:class:`Backend` and, for those with a ``launch`` command, a supervised :class:`RuntimeProcess`."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

from passerelle.config import BackendConfig, Config, TimeoutConfig
from passerelle.errors import ConfigError
from passerelle.runtimes import embedded, tiny_reranker
from passerelle.runtimes.kinds import Backend, make_backend
from passerelle.runtimes.prerequisites import MissingPrerequisites
from passerelle.runtimes.supervisor import RuntimeProcess

# What the embedded chat instance serves: everything but embeddings and rerank, which need
# llama-server started in another mode (--embeddings, --reranking), each a process of its own.
CHAT_ENDPOINTS = ("chat", "completions", "responses", "responses_input_tokens", "messages", "count_tokens",
                  "tokenize", "detokenize", "apply_template", "infill", "transcriptions")


def embedded_backends(cfg: Config) -> tuple[BackendConfig, ...]:
    """The embedded llama-server (built once): one chat instance, one for embeddings and one for
    reranking, since llama-server started with ``--embeddings`` or ``--reranking`` serves only that."""
    e = cfg.embedded
    try:
        build = embedded.llama_server_build(e.llama_server or None, backend=e.backend)
    except (MissingPrerequisites, subprocess.CalledProcessError) as exc:  # a flavour that cannot be built here
        raise ConfigError(f"backend {e.backend!r}: {exc}", file=cfg.source, key="embedded.backend") from None
    binary = build.binary
    flavour = build.flavour
    # a GPU flavour offloads every layer unless extra_args says otherwise
    offload = () if {"-ngl", "--n-gpu-layers", "--gpu-layers"} & set(e.extra_args) else build.launch_args

    def env(cmd: tuple[str, ...]) -> tuple[str, ...]:  # e.g. lavapipe: GGML_VK_VISIBLE_DEVICES, via env(1)
        return ("env", *build.launch_env, *cmd) if build.launch_env else cmd
    model = Path(e.model_path).expanduser() if e.model_path else embedded.ensure_default_model()
    if not model.is_file():
        raise ConfigError(f"model file {model} does not exist", file=cfg.source, key="embedded.model_path")
    # Gemma 3 has no fill-in-the-middle tokens; three of its unused special tokens stand for them,
    # so /infill runs llama-server's real infill path (the text is not a coder model's)
    fim = () if e.model_path else embedded.GEMMA_FIM_OVERRIDES
    # No max_concurrency: each llama-server reports its slots (/props total_slots), see capacity.py.
    out = [BackendConfig(name="local", kind="llama-server", models=(e.model_id,), endpoints=CHAT_ENDPOINTS,
                         flavour=flavour,
                         launch=env(embedded.launch_command(binary, model, alias=e.model_id, slots=e.slots,
                                                        ctx_per_slot=e.ctx_per_slot, threads=e.threads,
                                                        extra=(*offload, *fim, *e.extra_args))))]
    if e.embeddings:
        out.append(BackendConfig(
            name="local-embed", kind="llama-server", models=(e.model_id,), endpoints=("embeddings",),
            flavour=flavour, launch=env(embedded.launch_command(binary, model, alias=e.model_id, slots=1,
                                                                ctx_per_slot=2048, threads=e.threads,
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


def expand(cfg: Config) -> Config:
    """``cfg`` with the embedded runtime spelled out when it lists no backend, and the routes
    ``[server] extra_routes`` adds given to every backend."""
    if cfg.uses_embedded:
        cfg = dataclasses.replace(cfg, backends=embedded_backends(cfg))
    extra = cfg.server.extra_routes
    if extra:
        cfg = dataclasses.replace(cfg, backends=tuple(
            dataclasses.replace(b, extra_routes=tuple(dict.fromkeys((*extra, *b.extra_routes))))
            for b in cfg.backends))
    return cfg


def build_runtime(bc: BackendConfig, timeouts: TimeoutConfig) -> tuple[Backend, RuntimeProcess | None]:
    backend = make_backend(bc, timeouts)
    if not bc.launch:
        return backend, None
    return backend, RuntimeProcess(backend, bc.launch, ready_timeout_s=bc.ready_timeout_s,
                                   log_path=Path(bc.log_file) if bc.log_file else None)
