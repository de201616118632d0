"""``passerelle agentcheck``: do agents get their tool calls as tool calls?

It replays the recorded corpus's tool-using turns (tests/corpus/<client>/NNN-<api>.json, see
docs/corpus.md: every chat, Responses or Messages request that offers tools and carries no tool
result yet, so the agent expects a call) against a URL and a model, streamed and not, and judges
each answer as the agent would read it (agentcheck_judge.py). New corpus entries are picked up as
they are recorded. The pass matrix (per runtime x model x API x stream x repair) goes to
``results.json`` and ``report.md`` (agentcheck_report.py).

A target is a URL, optionally labelled with whether tool-call repair is on behind it
(``--repair on|off``, one per ``--url``), so that two gateways, one of each, fill both columns.
The recorded request is sent as it was, its ``model`` replaced (and its output limit bounded by
``--max-tokens``); its recorded headers go along (the user agent, ``anthropic-version``...), never a
recorded key. The answers are read whole, within ``--timeout`` seconds and :data:`MAX_BODY` bytes.
"""

from __future__ import annotations

import copy
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from passerelle.bench.agentcheck_judge import judge, offered_tools, read_reply

APIS = ("chat", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
MAX_BODY = 16 * 1024 * 1024  # an answer longer than this is cut, and fails as unreadable
TEXT_KEPT = 300  # characters of each answer's text kept in results.json (what the model wrote)
# Recorded headers that are the connection's or a credential, never replayed.
_DROPPED = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding", "authorization",
            "x-api-key", "api-key", "cookie", "x-openwebui-user-jwt"}


@dataclass(frozen=True)
class Turn:
    """One recorded request that expects a tool call."""

    client: str
    name: str  # <client>/<file stem>
    api: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass(frozen=True)
class Target:
    url: str
    repair: str = "?"  # on, off, or ? when not told


def default_corpus() -> Path | None:
    """The repository's tests/corpus next to the package, when this is a checkout (an installed
    copy's site-packages may hold some other distribution's ``tests``: the checkout's
    pyproject.toml must be there too)."""
    root = Path(__file__).resolve().parents[2]
    corpus = root / "tests" / "corpus"
    return corpus if corpus.is_dir() and (root / "pyproject.toml").is_file() else None


def _carries_tool_result(api: str, body: dict[str, Any]) -> bool:
    if api == "chat":
        return any(isinstance(m, dict) and m.get("role") in ("tool", "function") for m in body.get("messages") or ())
    if api == "responses":
        items = i if isinstance(i := body.get("input"), list) else []
        return any(isinstance(i, dict) and str(i.get("type", "")).endswith("_output") for i in items)
    blocks = [b for m in body.get("messages") or () if isinstance(m, dict) and isinstance(m.get("content"), list)
              for b in m["content"]]
    return any(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks)


def is_tool_turn(api: str, body: dict[str, Any]) -> bool:
    """A request whose answer should be a tool call: it offers tools, allows a call, and carries
    no tool result yet (after a result, an agent expects its final text)."""
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    return api in APIS and bool(offered_tools(api, body)) and kind != "none" \
        and not _carries_tool_result(api, body)


def load_turns(corpus: Path, apis: tuple[str, ...] = APIS) -> list[Turn]:
    """The corpus's tool-using turns of ``apis``, in file order."""
    out = []
    for path in sorted(corpus.glob("*/*.json")):
        try:
            record = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or not isinstance(record.get("body"), dict):
            continue
        api = str(record.get("api"))
        if api in apis and is_tool_turn(api, record["body"]):
            headers = {str(k).lower(): str(v) for k, v in (record.get("headers") or {}).items()}
            out.append(Turn(str(record.get("client", path.parent.name)), f"{path.parent.name}/{path.stem}", api,
                            record["body"], headers))
    return out


def prepare(turn: Turn, model: str, stream: bool, max_tokens: int | None = None) -> dict[str, Any]:
    """The recorded request, for ``model``, streamed or not, its output limit bounded."""
    body = copy.deepcopy(turn.body)
    body["model"] = model
    body["stream"] = stream
    if not stream:
        body.pop("stream_options", None)
    if max_tokens is not None:
        fields = ("max_output_tokens",) if turn.api == "responses" else ("max_tokens", "max_completion_tokens")
        sent = [f for f in fields if isinstance(body.get(f), int)]
        for f in sent or fields[:1]:
            body[f] = min(body.get(f) or max_tokens, max_tokens)
        thinking = body.get("thinking")
        if turn.api == "messages" and isinstance(thinking, dict) and isinstance(thinking.get("budget_tokens"), int) \
                and thinking["budget_tokens"] >= body["max_tokens"]:
            # Messages wants budget_tokens < max_tokens (and at least 1,024): a bounded turn thinks no more
            body.pop("thinking")
    return body


def ask(url: str, turn: Turn, body: dict[str, Any], key: str | None, timeout: float) -> tuple[int, bytes]:
    """Send ``body`` the way ``turn``'s client did; the status and the whole answer."""
    headers = {k: v for k, v in turn.headers.items() if k not in _DROPPED}
    headers["content-type"] = "application/json"
    if key:
        headers["authorization"] = f"Bearer {key}"
        if turn.api == "messages":
            headers["x-api-key"] = key
    req = urllib.request.Request(url.rstrip("/").removesuffix("/v1") + PATHS[turn.api],
                                 data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(MAX_BODY)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(MAX_BODY)
    except (OSError, ValueError) as exc:  # refused, reset, timed out, a broken chunked stream
        return 0, f"no answer: {exc}".encode()


def run(targets: list[Target], model: str, turns: list[Turn], streams: tuple[bool, ...], *, runtime: str = "?",
        key: str | None = None, timeout: float = 300, max_tokens: int | None = None, repeat: int = 1,
        progress: Any = None) -> list[dict[str, Any]]:
    """Every turn against every target, streamed and not, ``repeat`` times (a sampled model answers
    differently each time): one row per answer."""
    rows = []
    for target in targets:
        for turn in turns:
            for stream, sample in ((s, n) for s in streams for n in range(repeat)):
                body = prepare(turn, model, stream, max_tokens)
                started = time.monotonic()
                status, raw = ask(target.url, turn, body, key, timeout)
                reply = read_reply(turn.api, stream, status, raw)
                verdict = judge(turn.api, body, stream, reply)
                rows.append({"runtime": runtime, "model": model, "api": turn.api, "stream": stream,
                             "repair": target.repair, "url": target.url, "client": turn.client, "turn": turn.name,
                             "passed": verdict.passed, "failures": [list(f) for f in verdict.failures],
                             "sample": sample, "calls": [c.name for c in reply.calls],
                             "text": reply.text[:TEXT_KEPT],
                             "seconds": round(time.monotonic() - started, 3)})
                if progress is not None:
                    progress(rows[-1])
    return rows


def api_key(given: str | None) -> str | None:
    return given or os.environ.get("PASSERELLE_API_KEY") or None
