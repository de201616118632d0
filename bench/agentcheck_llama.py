"""The real-model part of docs/agentcheck.md: the embedded model (SmolLM2-135M-Instruct) on the
embedded llama-server, shown the tools by a chat template that renders them (ChatML with
Hermes-style tools: passerelle/testing/chat_templates/chatml-hermes-tools.jinja), its tool turns
replayed by ``passerelle agentcheck``:

* ``direct --jinja``: llama-server with ``--jinja --chat-template-file``: its own tool-call parsing;
* ``direct --no-jinja``: llama-server with its built-in ChatML template and no Jinja (tools are
  not shown to the model, and nothing is parsed);
* ``passerelle off`` / ``passerelle on``: passerelle launching that llama-server
  (``[[backends]] launch = ["{llama-server}", ..., "--chat-template-file", T]``), with
  ``[[models]] tool_calls = "hermes"`` for ``on`` (``--repair``).

    PYTHONPATH=. python bench/agentcheck_llama.py --out /tmp/agentcheck-llama [--repair] [--client codex ...]

A 135M model often writes no call, or a call that is not valid: the figures say what it does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from harness import ROOT, Service, free_port, serve, spawn

from passerelle.bench import agentcheck, agentcheck_report
from passerelle.runtimes import embedded

TEMPLATE = ROOT / "passerelle" / "testing" / "chat_templates" / "chatml-hermes-tools.jinja"
MODEL = "smollm2-135m-instruct"
CTX = 8192


def llama_args(model: Path, port: str, jinja: bool, threads: int) -> list[str]:
    template = ["--jinja", "--chat-template-file", str(TEMPLATE)] if jinja else ["--no-jinja", "--chat-template",
                                                                                  "chatml"]
    return ["-m", str(model), "--alias", MODEL, "--host", "127.0.0.1", "--port", port, "-np", "1", "-c", str(CTX),
            "-t", str(threads), "--no-webui", "--metrics", "--slots", *template]


def start_llama(work: Path, binary: Path, model: Path, jinja: bool, threads: int) -> Service:
    port = free_port()
    svc = spawn(f"llama-{'jinja' if jinja else 'nojinja'}", [str(binary), *llama_args(model, str(port), jinja,
                                                                                      threads)],
                work, url=f"http://127.0.0.1:{port}")
    svc.wait_ready("/health", 120)
    return svc


def gateway_toml(model: Path, threads: int, tool_calls: str | None) -> str:
    launch = ["{llama-server}", *llama_args(model, "{port}", True, threads)]
    models = f'\n[[models]]\nname = "{MODEL}"\ntool_calls = "{tool_calls}"\n' if tool_calls else ""
    return f"""
[[backends]]
name = "smollm2"
kind = "llama-server"
launch = {json.dumps(launch)}
models = ["{MODEL}"]
max_concurrency = 1
{models}"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repair", action="store_true", help='also passerelle with [[models]] tool_calls = "hermes"')
    p.add_argument("--only", default="direct-jinja,direct-nojinja,passerelle-off",
                   help="which of direct-jinja, direct-nojinja, passerelle-off, passerelle-on to run")
    p.add_argument("--client", action="append", default=[], help="only these corpus clients' turns")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="ask each turn this many times")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = agentcheck.default_corpus()
    assert corpus is not None, "run from a checkout: the corpus is tests/corpus"
    turns = [t for t in agentcheck.load_turns(corpus) if not args.client or t.name.split("/")[0] in args.client]
    binary, model = embedded.find_or_build_llama_server(), embedded.ensure_default_model()
    wanted = args.only.split(",") + (["passerelle-on"] if args.repair else [])
    rows = []
    for setting in wanted:
        svc: Service
        if setting.startswith("direct"):
            jinja = setting == "direct-jinja"
            svc, label, repair = start_llama(args.out, binary, model, jinja, args.threads), \
                f"llama-server {'--jinja' if jinja else '--no-jinja'}", "direct"
        else:
            repair = setting.removeprefix("passerelle-")
            cfg = args.out / f"gateway-{repair}.toml"
            cfg.write_text(gateway_toml(model, args.threads, "hermes" if repair == "on" else None))
            svc, label = serve(args.out, cfg, name=f"gateway-{repair}", src=ROOT), "passerelle, llama-server --jinja"
            svc.wait_ready("/ready", 180)
        def say(row: dict[str, Any], setting: str = setting) -> None:
            print(f"{setting} {row['turn']} stream={row['stream']} {'pass' if row['passed'] else row['failures']} "
                  f"{row['text'][:80]!r}", flush=True)

        try:
            got = agentcheck.run([agentcheck.Target(svc.url, repair)], MODEL, turns, (False, True),
                                 runtime=label, timeout=600, max_tokens=args.max_tokens, repeat=args.repeat,
                                 progress=say)
        finally:
            svc.stop()
        agentcheck_report.write(args.out / setting, got, setting)
        rows += got
    agentcheck_report.write(args.out, rows, "python bench/agentcheck_llama.py " + " ".join(sys.argv[1:]))
    print(agentcheck_report.matrix_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
