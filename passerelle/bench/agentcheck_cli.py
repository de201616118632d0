"""The ``passerelle agentcheck`` command line: parse, run (agentcheck.py), write the report."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from passerelle.bench import agentcheck, agentcheck_report

STREAMS = {"both": (False, True), "yes": (True,), "no": (False,)}


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "agentcheck", help="replay the corpus's tool-using turns and report whether tool calls arrive as tool calls",
        description="Replay the recorded agents' tool-using turns (Claude Code Messages, Codex Responses, opencode "
                    "chat, ...) against a URL and a model, streamed and not, and write a pass matrix per runtime x "
                    "model x API x stream x repair: results.json and report.md.")
    p.add_argument("--url", action="append", default=[], metavar="URL",
                   help="the gateway or runtime (with or without /v1); repeat to check several")
    p.add_argument("--repair", action="append", default=[], choices=("on", "off", "?"),
                   help="whether tool-call repair is on behind each --url, in the same order (default ?)")
    p.add_argument("--model", help="the model to ask for (replaces the recorded one)")
    p.add_argument("--api", default=",".join(agentcheck.APIS),
                   help="the APIs to check, comma-separated (default chat,responses,messages)")
    p.add_argument("--stream", choices=tuple(STREAMS), default="both", help="streamed, not, or both (default)")
    p.add_argument("--runtime", default="?", help="the runtime's name in the matrix (e.g. llama-server, vllm)")
    p.add_argument("--corpus", type=Path, help="the corpus folder (default: the repository's tests/corpus)")
    p.add_argument("--client", action="append", default=[],
                   help="only these clients' turns (the corpus folder names; repeatable)")
    p.add_argument("--api-key", help="the key to send (default $PASSERELLE_API_KEY)")
    p.add_argument("--timeout", type=float, default=300, help="seconds for one answer (default 300)")
    p.add_argument("--max-tokens", type=int, help="bound each request's output limit (a small model's turn ends "
                                                  "sooner)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="ask each turn N times (a sampling model answers differently each time; default 1)")
    p.add_argument("--merge", type=Path, nargs="+", metavar="RESULTS",
                   help="run nothing: report earlier runs' results.json files as one matrix")
    p.add_argument("--out", type=Path, default=Path("agentcheck-results"),
                   help="where results.json and report.md go (default ./agentcheck-results)")
    p.add_argument("--strict", action="store_true", help="exit 1 when any turn fails")
    p.set_defaults(func=main)
    return p


def _fail(message: str) -> int:
    print(f"passerelle: agentcheck: {message}", file=sys.stderr)
    return 2


def _progress(row: dict[str, Any]) -> None:
    why = "" if row["passed"] else "  " + ", ".join(sorted({f[0] for f in row["failures"]}))
    print(f"{'pass' if row['passed'] else 'FAIL'}  {row['api']:<9} {'stream' if row['stream'] else 'json  '} "
          f"repair={row['repair']:<3} {row['turn']}{why}", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    command = "passerelle " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["agentcheck"] else "passerelle agentcheck"
    if args.merge:
        try:
            rows = agentcheck_report.read_rows(args.merge)
        except (OSError, ValueError, KeyError) as exc:
            return _fail(f"cannot read {exc}")
    else:
        if not args.url or not args.model:
            return _fail("--url and --model are required (or --merge)")
        if len(args.repair) > len(args.url):
            return _fail("more --repair than --url")
        if args.repeat < 1:
            return _fail("--repeat takes a count of 1 or more")
        apis = tuple(a.strip() for a in args.api.split(",") if a.strip())
        if not apis or set(apis) - set(agentcheck.APIS):
            return _fail(f"--api takes {', '.join(agentcheck.APIS)}")
        corpus = args.corpus or agentcheck.default_corpus()
        if corpus is None or not corpus.is_dir():
            return _fail(f"no corpus at {corpus}; give --corpus DIR" if corpus else
                         "no corpus next to the package (an installed copy); give --corpus DIR")
        turns = [t for t in agentcheck.load_turns(corpus, apis)
                 if not args.client or t.name.split("/")[0] in args.client]
        if not turns:
            return _fail(f"{corpus} holds no tool-using turn of {', '.join(apis)}")
        repairs = args.repair + ["?"] * (len(args.url) - len(args.repair))
        targets = [agentcheck.Target(u, r) for u, r in zip(args.url, repairs, strict=True)]
        rows = agentcheck.run(targets, args.model, turns, STREAMS[args.stream], runtime=args.runtime,
                              key=agentcheck.api_key(args.api_key), timeout=args.timeout,
                              max_tokens=args.max_tokens, repeat=args.repeat, progress=_progress)
    try:
        results, report = agentcheck_report.write(args.out, rows, command)
    except OSError as exc:
        return _fail(f"cannot write {args.out}: {exc.strerror or exc}")
    print(agentcheck_report.matrix_markdown(rows), end="")
    print(f"wrote {results} and {report}")
    return 1 if args.strict and not all(r["passed"] for r in rows) else 0
