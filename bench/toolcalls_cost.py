"""What tool-call repair costs per streamed chunk: µs per ``feed()`` of passerelle's tool-call
parser (passerelle/proxy/toolcalls) on plain text, on text full of ``<`` (HTML, code), and on a
call, fed in token-sized chunks as a stream delivers them; and the time a large call takes fed in
small pieces, at two sizes, to show the cost stays linear in the call's length.

    .venv/bin/python bench/toolcalls_cost.py [--chunks 200000]

One process, one core, no gateway: this is the parser's own cost, to add to the relay's per-chunk
cost measured by bench/overhead.py.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from passerelle.proxy.toolcalls import parser_for

TOOLS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}]
PLAIN = [" the", " quick", " brown", " fox", " jumps", " over", ",", " lazy", " dog", "."]
ANGLED = ["<div", ">", "a", " <", "b", ">", "1 <", " 2", "</div>", "\n"]


def per_feed(fmt: str, chunks: list[str], n: int) -> float:
    """µs per feed() over n chunks cycled from ``chunks``, one parser per 1,000 chunks (a stream)."""
    parser = parser_for(fmt, TOOLS)
    assert parser is not None
    k = len(chunks)
    start = time.perf_counter()
    for i in range(n):
        if i % 1000 == 0:
            parser.finish()
            parser = parser_for(fmt, TOOLS)
            assert parser is not None
        parser.feed(chunks[i % k])
    return (time.perf_counter() - start) / n * 1e6


def baseline(chunks: list[str], n: int) -> float:
    """µs per call of a function that does nothing but wrap the chunk (the floor)."""
    k = len(chunks)
    wrap: Callable[[str], list[str]] = lambda text: [text]  # noqa: E731
    start = time.perf_counter()
    for i in range(n):
        wrap(chunks[i % k])
    return (time.perf_counter() - start) / n * 1e6


def tokens(text: str, size: int = 4) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def call_stream(fmt: str, text: str, rounds: int) -> tuple[float, float, int]:
    """(µs per feed, µs per whole call, feeds per call) for ``text`` fed in 4-character chunks."""
    parts = tokens(text)
    start = time.perf_counter()
    for _ in range(rounds):
        parser = parser_for(fmt, TOOLS)
        assert parser is not None
        for part in parts:
            parser.feed(part)
        parser.finish()
    total = (time.perf_counter() - start) / rounds * 1e6
    return total / len(parts), total, len(parts)


def large_call(size: int) -> float:
    """Seconds to parse one call of ``size`` characters fed in 16-character pieces."""
    city = "x" * size
    text = "<tool_call>" + json.dumps({"name": "get_weather", "arguments": {"city": city}}) + "</tool_call>"
    parser = parser_for("hermes", TOOLS)
    assert parser is not None
    start = time.perf_counter()
    for i in range(0, len(text), 16):
        parser.feed(text[i:i + 16])
    pieces = parser.finish()
    assert pieces == [] or len(pieces) == 1
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=200_000)
    args = ap.parse_args()
    n = args.chunks
    print(f"floor (wrap a chunk in a list): {baseline(PLAIN, n):.3f} µs per chunk")
    for fmt in ("auto", "hermes", "qwen3-xml", "mistral", "llama3", "harmony"):
        print(f"{fmt:10} plain text: {per_feed(fmt, PLAIN, n):.3f} µs per feed; "
              f"text full of '<': {per_feed(fmt, ANGLED, n):.3f} µs per feed")
    calls = {
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "qwen3-xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                     "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        "harmony": '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                   '{"city": "Paris", "days": 3}<|call|>',
    }
    for fmt, text in calls.items():
        feed, whole, count = call_stream(fmt, text, max(1, n // 100))
        print(f"{fmt:10} one call in {count} chunks: {feed:.2f} µs per feed, {whole:.1f} µs per call")
    small, big = large_call(256 * 1024), large_call(1024 * 1024 - 200)
    print(f"a 256 KiB call in 16-character pieces: {small * 1e3:.1f} ms; 1 MiB: {big * 1e3:.1f} ms "
          f"(ratio {big / small:.1f}, 4 when linear)")


if __name__ == "__main__":
    main()
