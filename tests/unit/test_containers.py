"""The Containerfiles and the compose file (deploy/containers/), checked on paper: this machine
has no container engine that could build them (no podman or buildah, no Docker daemon, no
registry to pull base images from; hadolint is not packaged). Each file is parsed here and held to
what the images must do: build llama-server with the flavour's CMake flags, run as a user that is
not root, keep state in a volume, answer a HEALTHCHECK on /health."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

DIR = Path(__file__).resolve().parents[2] / "deploy" / "containers"
FLAVOURS = {
    "cpu": {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON"},
    "vulkan": {"-DGGML_NATIVE=OFF", "-DGGML_VULKAN=ON"},
    "rocm": {"-DGGML_NATIVE=OFF", "-DGGML_HIP=ON", "-DAMDGPU_TARGETS=${AMDGPU_TARGETS}"},
    "cuda": {"-DGGML_NATIVE=OFF", "-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}"},
}
GPU_FLAGS = {"-DGGML_VULKAN=ON", "-DGGML_HIP=ON", "-DGGML_CUDA=ON"}
KNOWN = {"FROM", "RUN", "COPY", "ENV", "ARG", "WORKDIR", "USER", "VOLUME", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT",
         "CMD", "LABEL"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Containerfile: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        pending += (" " if pending else "") + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    assert not pending, "a continuation line ends the file"
    return out


def stages(text: str) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for ins in instructions(text):
        if ins[0] == "FROM":
            out.append([])
        assert out, "an instruction before the first FROM"
        out[-1].append(ins)
    return out


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, args in stage:
        if word == "ENV":
            for part in shlex.split(args):
                name, _, value = part.partition("=")
                env[name] = value
    return env


def cmake_flags(text: str) -> set[str]:
    found: set[str] = set()
    for m in re.finditer(r'PASSERELLE_LLAMA_CMAKE_FLAGS="([^"]*)"', text):
        found |= set(m.group(1).split())
    return found


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_each_containerfile_builds_its_flavour_and_runs_unprivileged_with_a_health_check(flavour):
    text = (DIR / f"Containerfile.{flavour}").read_text()
    parts = stages(text)
    assert len(parts) == 2, "a build stage and a runtime stage"
    for word, args in instructions(text):
        assert word in KNOWN, f"unknown instruction {word}"
        if word == "FROM":
            image = args.split()[0]
            assert re.fullmatch(r"docker\.io/[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), image
    build, run = parts
    assert build[0][1].endswith(" AS build")
    # llama-server built with the flavour's flags, and only its own GPU's
    flags = cmake_flags(text)
    assert FLAVOURS[flavour] <= flags, flags
    assert not (GPU_FLAGS - FLAVOURS[flavour]) & flags
    assert any(w == "RUN" and "passerelle setup" in a for w, a in build)
    assert env_of(build)["PASSERELLE_LLAMA_FLAVOUR"] == env_of(run)["PASSERELLE_LLAMA_FLAVOUR"]
    # the runtime stage: what the build made, an unprivileged user, the state in a volume, /health
    copies = [a for w, a in run if w == "COPY"]
    assert any(a.startswith("--from=build") and "/opt/passerelle" in a for a in copies)
    users = [a for w, a in run if w == "USER"]
    assert users and users[-1] not in ("root", "0") and users[-1] == "passerelle"
    assert any(w == "RUN" and "useradd --system --uid 10001" in a for w, a in run)
    env = env_of(run)
    assert env["PASSERELLE_STATE"] == "/var/lib/passerelle"
    volumes = [json.loads(a) for w, a in run if w == "VOLUME"]
    assert volumes == [[env["PASSERELLE_STATE"]]]
    health = [a for w, a in run if w == "HEALTHCHECK"]
    assert len(health) == 1 and "http://127.0.0.1:8080/health" in health[0] and "CMD" in health[0]
    entry = json.loads(next(a for w, a in run if w == "ENTRYPOINT"))
    assert entry[:2] == ["passerelle", "serve"] and entry[entry.index("--port") + 1] == "8080"
    assert entry[entry.index("--host") + 1] == "0.0.0.0"
    assert [a for w, a in run if w == "EXPOSE"] == ["8080"]


def test_the_compose_file_runs_the_four_services_and_mounts_what_exists():
    text = (DIR / "compose.yaml").read_text()
    services = re.findall(r"^  ([a-z][\w-]*):\s*$", text.split("\nvolumes:\n")[0], re.MULTILINE)
    assert services == ["passerelle", "vllm", "prometheus", "grafana"]
    # every file mounted or built from exists, relative to the compose file
    for path in re.findall(r"^\s+- (\.\.?/[^:]+):", text, re.MULTILINE):
        assert (DIR / path).exists(), path
    assert (DIR / "../.." / re.search(r"dockerfile: (\S+)", text).group(1)).exists()
    assert "passerelle-state:/var/lib/passerelle" in text and "127.0.0.1:8080/health" in text
    # Prometheus scrapes passerelle on the compose network, and passerelle lets it
    prom = (DIR / "prometheus.yml").read_text()
    assert '"passerelle:8080"' in prom and '"vllm:8000"' in prom
    conf = (DIR / "passerelle.toml").read_text()
    assert 'url = "http://vllm:8000"' in conf and 'hosts = ["passerelle"]' in conf


def test_the_compose_gateway_configuration_loads(tmp_path):
    from passerelle.config import load_config

    cfg = load_config(DIR / "passerelle.toml")
    assert cfg.server.host == "0.0.0.0" and [b.url for b in cfg.backends] == ["http://vllm:8000"]
    assert "passerelle" in cfg.admin.hosts
