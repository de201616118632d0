"""The scripted part of docs/agentcheck.md's matrix: ``passerelle agentcheck`` against passerelle in
front of the scripted tool runtime, for every tool-call format, with tool-call repair off and on.

For each format (``native``: the runtime answers with the APIs' own tool calls, as a runtime whose
parser did the work; then hermes, qwen3-xml, mistral, llama3, harmony: the call written as that
format's markup in the text, as a runtime without a parser answers), it starts
``python -m passerelle.testing.tool_runtime --any-tool [--tool-format F]`` and, in front of it,
one gateway with repair off (no ``tool_calls`` key: today's default) and, with ``--repair``, one
with ``[[models]] tool_calls = "F"`` (``auto`` for native, and with ``--repair-auto`` for all),
then replays every corpus tool turn, streamed and not, on the three APIs.

    PYTHONPATH=. python bench/agentcheck_matrix.py --out /tmp/agentcheck [--repair] [--repair-auto] \
        [--formats hermes,mistral] [--corpus DIR] [--client open-webui]

Run it as ``PYTHONPATH=. python bench/agentcheck_matrix.py`` from a checkout: the runtime and the
gateways run this checkout's code. Writes ``results.json`` and ``report.md`` (the matrix) in
``--out``, and each run's own in a folder of its own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import ROOT, Service, free_port, serve, source_env, spawn

from passerelle.bench import agentcheck, agentcheck_report
from passerelle.testing.tool_call_text import FORMATS

MODEL = "scripted"


def gateway_toml(runtime_url: str, tool_calls: str | None) -> str:
    models = f'\n[[models]]\nname = "{MODEL}"\ntool_calls = "{tool_calls}"\n' if tool_calls else ""
    return f"""
[[backends]]
name = "scripted"
kind = "openai"
url = "{runtime_url}"
models = ["{MODEL}"]
endpoints = ["chat", "responses", "messages", "count_tokens"]
max_concurrency = 8
{models}"""


def start_runtime(work: Path, fmt: str) -> Service:
    port = free_port()
    argv = [sys.executable, "-m", "passerelle.testing.tool_runtime", "--port", str(port), "--workdir", str(work),
            "--record", str(work / f"runtime-{fmt}.jsonl"), "--model", MODEL, "--any-tool"]
    svc = spawn(f"runtime-{fmt}", [*argv, *([] if fmt == "native" else ["--tool-format", fmt])], work,
                env=source_env(ROOT), url=f"http://127.0.0.1:{port}")
    svc.wait_ready("/health", 30)
    return svc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--repair", action="store_true", help="also a gateway with [[models]] tool_calls set")
    p.add_argument("--repair-auto", action="store_true", help='tool_calls = "auto" rather than the format')
    p.add_argument("--formats", default=",".join(["native", *FORMATS]))
    p.add_argument("--corpus", type=Path, help="the corpus (default: this checkout's tests/corpus)")
    p.add_argument("--client", action="append", default=[], help="only these corpus clients' turns")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = args.corpus or agentcheck.default_corpus()
    assert corpus is not None, "run from a checkout (the corpus is tests/corpus), or give --corpus"
    turns = [t for t in agentcheck.load_turns(corpus) if not args.client or t.name.split("/")[0] in args.client]
    rows = []
    for fmt in args.formats.split(","):
        runtime = start_runtime(args.out, fmt)
        settings: list[tuple[str, str | None]] = [("off", None)]
        if args.repair:
            settings.append(("on", "auto" if fmt == "native" or args.repair_auto else fmt))
        try:
            for repair, tool_calls in settings:
                cfg = args.out / f"gateway-{fmt}-{repair}.toml"
                cfg.write_text(gateway_toml(runtime.url, tool_calls))
                gw = serve(args.out, cfg, name=f"gateway-{fmt}-{repair}", src=ROOT)
                try:
                    gw.wait_ready("/ready", 60)
                    got = agentcheck.run([agentcheck.Target(gw.url, repair)], MODEL, turns, (False, True),
                                         runtime=f"scripted {fmt}", timeout=60)
                finally:
                    gw.stop()
                agentcheck_report.write(args.out / f"{fmt}-{repair}", got, f"{fmt} repair {repair}")
                rows += got
                passed = sum(r["passed"] for r in got)
                print(f"{fmt:<10} repair {repair:<3} {passed}/{len(got)} passed", flush=True)
        finally:
            runtime.stop()
    agentcheck_report.write(args.out, rows, "python bench/agentcheck_matrix.py " + " ".join(sys.argv[1:]))
    print(agentcheck_report.matrix_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
