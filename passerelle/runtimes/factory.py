"""What the configuration asks to run: its backends (the embedded default included), each as a
:class:`Backend` and, for those with a ``launch`` command, a supervised :class:`RuntimeProcess`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from passerelle.config import BackendConfig, Config, TimeoutConfig
from passerelle.errors import ConfigError
from passerelle.runtimes import embedded
from passerelle.runtimes.kinds import Backend, make_backend
from passerelle.runtimes.supervisor import RuntimeProcess


def embedded_backends(cfg: Config) -> tuple[BackendConfig, ...]:
    """The embedded llama-server (built once): one chat instance, and one for embeddings, since
    llama-server started with ``--embeddings`` serves only embeddings."""
    e = cfg.embedded
    binary = embedded.find_or_build_llama_server(e.llama_server or None)
    model = Path(e.model_path).expanduser() if e.model_path else embedded.ensure_default_model()
    if not model.is_file():
        raise ConfigError(f"model file {model} does not exist", file=cfg.source, key="embedded.model_path")
    # No max_concurrency: llama-server reports its slots (/props total_slots), see capacity.py.
    chat = BackendConfig(name="local", kind="llama-server", models=(e.model_id,), endpoints=("chat", "completions"),
                         launch=embedded.launch_command(binary, model, alias=e.model_id, slots=e.slots,
                                                        ctx_per_slot=e.ctx_per_slot, threads=e.threads,
                                                        extra=e.extra_args))
    if not e.embeddings:
        return (chat,)
    embed = BackendConfig(name="local-embed", kind="llama-server", models=(e.model_id,), endpoints=("embeddings",),
                          launch=embedded.launch_command(binary, model, alias=e.model_id, slots=1, ctx_per_slot=2048,
                                                         threads=e.threads, embeddings=True))
    return chat, embed


def expand(cfg: Config) -> Config:
    """``cfg`` with the embedded runtime spelled out when it lists no backend."""
    return dataclasses.replace(cfg, backends=embedded_backends(cfg)) if cfg.uses_embedded else cfg


def build_runtime(bc: BackendConfig, timeouts: TimeoutConfig) -> tuple[Backend, RuntimeProcess | None]:
    backend = make_backend(bc, timeouts)
    if not bc.launch:
        return backend, None
    return backend, RuntimeProcess(backend, bc.launch, ready_timeout_s=bc.ready_timeout_s,
                                   log_path=Path(bc.log_file) if bc.log_file else None)
