"""The real embedded model's tool turns: SmolLM2-135M-Instruct on the real llama-server, shown the
tools by a chat template that renders them (passerelle/testing/chat_templates/
chatml-hermes-tools.jinja, given with ``--chat-template-file``; its own template drops them), and
``passerelle agentcheck`` run through passerelle in front of it.

A 135M model often writes no call, or one that does not fit the schema, so the test asserts what
must hold whatever it writes: the template shows the model the tools, the command runs every
turn (streamed and not) and reports each, and every answer it judges is a readable 200 that ended
as its API's client expects when it carried a call; the pass rate itself is reported, not asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from passerelle.runtimes import embedded
from tests.conftest import start_llama, upstream_config

pytestmark = pytest.mark.llama

TEMPLATE = Path(embedded.__file__).parent.parent / "testing" / "chat_templates" / "chatml-hermes-tools.jinja"
MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}


def test_agentcheck_reports_the_real_models_tool_turns(gateway, tmp_path: Path) -> None:
    binary, model = embedded.find_or_build_llama_server(), embedded.ensure_default_model()
    server = start_llama(binary, model, tmp_path / "llama-server.log", slots=1, ctx_per_slot=4096, alias=MODEL,
                         extra=("--jinja", "--chat-template-file", str(TEMPLATE)))
    try:
        rendered = httpx.post(server.url + "/apply-template", timeout=30,
                              json={"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]})
        prompt = rendered.json()["prompt"]
        assert "<tools>" in prompt and '"get_weather"' in prompt and "<tool_call>" in prompt

        gw = gateway(upstream_config(server.url, model=MODEL, slots=1))
        out = tmp_path / "report"
        proc = subprocess.run([sys.executable, "-m", "passerelle", "agentcheck", "--url", gw.url, "--model", MODEL,
                               "--runtime", "llama-server", "--repair", "off", "--client", "openai-python",
                               "--api", "chat", "--max-tokens", "24", "--timeout", "240", "--out", str(out)],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        server.stop()
    results = json.loads((out / "results.json").read_text())
    turns = {r["turn"] for r in results["rows"]}
    assert turns == {"openai-python/001-chat", "openai-python/003-chat", "openai-python/006-chat"}
    assert len(results["rows"]) == 2 * len(turns)
    for row in results["rows"]:
        kinds = {f[0] for f in row["failures"]}
        assert not kinds & {"http", "unreadable"}, row  # a real answer, read whole, every time
        if "no_tool_call" not in kinds:
            assert "stream_end" not in kinds, row
    (cell_json, cell_stream) = sorted(results["summary"], key=lambda c: c["stream"])
    assert (cell_json["turns"], cell_stream["turns"]) == (3, 3)
    assert "| llama-server | smollm2-135m-instruct | chat |" in (out / "report.md").read_text()
