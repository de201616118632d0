"""What the benchmark sends: synthetic prompts, output lengths, multi-turn chats, scenario files.

Prompts are cut from ordinary English prose so every runtime tokenizes them like real text; their
length in words is the requested token count divided by a tokens-per-word ratio that the runner
measures once per target (see ``runner.calibrate``). Each prompt starts with its own tag and at a
different place in the text, so runtimes cannot serve one request from another's prefix cache;
multi-turn chats do share their own growing prefix, as real conversations do.

Across runs, a random **nonce** (one per run and target, mixed into every tag and text offset)
keeps a second run from being answered out of the cache the first one filled; an explicit
``--seed`` leaves it out, so prompts repeat exactly (and the report's cache check says when a
runtime served them from its cache). ``prefix_share`` makes a deliberate shared prefix: that
fraction of every prompt's words is the same passage for all requests of a target, like a
common system prompt::

    Workload(prompt_tokens=128, nonce="3f9a0c1e")          # fresh text every run
    Workload(prompt_tokens=128, prefix_share=0.5)          # half of each prompt shared

A scenario file (TOML) mixes traffic classes, each with its own load, lengths, key and priority::

    duration = "60s"            # or: requests = 200 (per class)
    [defaults]
    max_tokens = 128
    [[class]]
    name = "interactive"
    priority = "interactive"    # sent as X-Priority
    api_key_env = "ALICE_KEY"   # or api_key = "..."
    concurrency = 4             # closed loop; or rate = 2.0 (requests/s), poisson = true
    prompt_tokens = 128
    turns = 3
"""

from __future__ import annotations

import random
import tomllib
import zlib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from passerelle.bench.trace import TraceEntry, TraceError, load_trace

# Original prose written for this benchmark (no external corpus is needed or fetched).
CORPUS = """
The town grew up where the river bends twice before it reaches the plain. Its first houses were
built of the grey stone that the water had rounded over many centuries, and the people who lived
in them made a living from the mills, the ferries and the market that met every Thursday in the
square beside the church. In spring the river rose and brought down branches, mud and sometimes
whole trees from the forests upstream, and the millers worked through the night to keep their
wheels clear. In summer the water fell so low that children could walk across the shallows to the
island, where herons stood in the reeds and watched them without fear.
A school was opened in the old granary when the railway arrived, and with it came a doctor, a
printer and a family of clockmakers who had left the city to find cheaper rent and better light.
The clockmakers set up their benches by the tall windows facing north, because a steady light
without shadows was worth more to them than warmth. Their clocks were sold in towns along the
line, and for a time the name of the town was known mostly because it was painted on the faces of
those clocks, in small letters beneath the number six.
Travellers who stopped for a night often wrote that the place was quiet, almost too quiet, but
those who stayed longer noticed how much happened in that quiet. The baker rose at three, the
ferryman at five, and the bells of the church told the hours to anyone who had forgotten their
own clock. Letters arrived twice a day. Every autumn the fair filled the square with tents,
music, horses and the smell of roasted chestnuts, and for three days nobody worked more than
they had to.
Over the years the mills closed one after another. Some became houses, one became a museum and
one was left to the ivy, which covered it so completely that visitors mistook it for a small
green hill. The railway station stayed open, although fewer trains stopped there, and the school
moved into a new building with large windows and a garden where the pupils grew beans, onions and
sunflowers taller than their teachers. The river kept bending twice before it reached the plain,
as it always had, carrying leaves in autumn, ice in winter and light in every season.
People who grew up in the town and moved away often came back when they were older. They said
that they missed the sound of the water under the bridge at night, the way the fog lay on the
fields in the morning and the patience of a place that had never been in a hurry. Some of them
opened small shops, repaired old boats or simply sat on the benches along the quay, telling the
younger ones how things had been, and listening, more often than they expected, to how things
were now.
"""
WORDS: tuple[str, ...] = tuple(CORPUS.split())
INSTRUCTION = "Continue this story in the same style."
# A typical ratio for English prose under current tokenizers; replaced by a measured one per target.
DEFAULT_TOKENS_PER_WORD = 1.3
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
             "messages": "/v1/messages"}
# Conversation indexes of different targets of a compare differ by this much (see measure); lengths
# are drawn from the index within a target, so every target gets the same sequence of lengths.
TARGET_STRIDE = 1_000_000_000
DEFAULT_MIN_REQUESTS = 20  # per level, unless --requests or --duration says otherwise (a p95 of fewer is warned of)


@dataclass(frozen=True)
class Workload:
    """One kind of request: lengths, endpoint and sampling options."""

    endpoint: str = "chat"  # the API: "chat", "completions", "responses" (OpenAI) or "messages" (Anthropic)
    prompt_tokens: int = 128
    prompt_spread: int = 0  # prompt lengths are uniform in [prompt_tokens ± prompt_spread]
    max_tokens: int = 64
    max_tokens_spread: int = 0
    turns: int = 1  # >1: chats that grow a shared prefix, one request per turn
    ignore_eos: bool = True
    include_usage: bool = True
    seed: int = 0
    nonce: str = ""  # mixed into the prompt text: fresh prompts per run ("" with an explicit --seed)
    prefix_share: float = 0.0  # fraction of each prompt's words shared by all requests (deliberate cache hits)
    tokens_per_word: float = DEFAULT_TOKENS_PER_WORD
    prompt_overhead: float = 12.0  # tokens around the text: tag, instruction, chat template
    extra_body: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def path(self) -> str:
        return ENDPOINTS[self.endpoint]

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def prompt_text(n_words: int, offset: int, tag: str) -> str:
    """``n_words`` words of the corpus from ``offset`` (wrapping), tagged so no two prompts match."""
    n_words = max(n_words, 1)
    words = [WORDS[(offset + k) % len(WORDS)] for k in range(n_words)]
    return f"Story {tag}: " + " ".join(words)


class Conversation:
    """The requests of one chat: turn k's messages extend turn k-1's, so the prefix grows."""

    def __init__(self, workload: Workload, index: int, model: str) -> None:
        self.workload = workload
        self.model = model
        self.index = index
        # lengths depend on the seed and the index within the target only (like for like between
        # targets); the text also on the nonce (fresh every run)
        self.rng = random.Random(f"{workload.seed}:{index % TARGET_STRIDE}")
        self.text_rng = random.Random(f"{workload.nonce}:{workload.seed}:{index}")
        self.turn = 0
        self.messages: list[dict[str, str]] = []
        self.last_max_tokens = 0

    def _tokens(self, mean: int, spread: int) -> int:
        return max(1, mean + (self.rng.randint(-spread, spread) if spread else 0))

    def next_body(self, prompt_tokens: int | None = None, max_tokens: int | None = None) -> tuple[dict[str, Any], int]:
        """The next request body and its ``max_tokens``; call at most ``workload.turns`` times.

        ``prompt_tokens`` and ``max_tokens`` override the workload's lengths (a replayed trace).
        """
        w = self.workload
        drawn_prompt = self._tokens(w.prompt_tokens, w.prompt_spread)
        drawn_max = self._tokens(w.max_tokens, w.max_tokens_spread)
        prompt_tokens = drawn_prompt if prompt_tokens is None else max(1, prompt_tokens)
        max_tokens = drawn_max if max_tokens is None else max(1, max_tokens)
        n_words = max(1, round(max(prompt_tokens - w.prompt_overhead, 1.0) / w.tokens_per_word))
        return self.body_for_words(n_words, max_tokens), max_tokens

    def body_for_words(self, n_words: int, max_tokens: int) -> dict[str, Any]:
        w = self.workload
        offset = self.text_rng.randrange(len(WORDS))
        # A fixed-length tag (so it costs the same tokens for every index) that differs at once
        # between requests: no prompt can be served from another's prefix cache.
        tag = f"{zlib.crc32(f'{w.nonce}:{w.seed}:{self.index}:{self.turn}'.encode()):08x}"
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "stream": True}
        text = self._user_text(n_words, offset, tag)
        if w.endpoint == "responses":
            body = {"model": self.model, "max_output_tokens": max_tokens, "stream": True}
        if w.endpoint != "completions":
            if self.messages:
                # The reply is not decoded (the client only scans bytes); a stand-in of the same
                # length keeps the history realistic, and everything before it is a shared prefix.
                self.messages.append({"role": "assistant", "content": prompt_text(
                    round(self.last_max_tokens / w.tokens_per_word), offset + 7, tag)})
            self.messages.append({"role": "user", "content": text})
            body["input" if w.endpoint == "responses" else "messages"] = list(self.messages)
        else:
            body["prompt"] = text
        if w.include_usage and w.endpoint in ("chat", "completions"):  # (the others always send usage)
            body["stream_options"] = {"include_usage": True}
        if w.ignore_eos:
            body["ignore_eos"] = True
        body.update(w.extra_body)
        self.turn += 1
        self.last_max_tokens = max_tokens
        return body

    def _user_text(self, n_words: int, offset: int, tag: str) -> str:
        """The prompt: [the shared passage, on a first turn with ``prefix_share``] + own text + instruction."""
        w = self.workload
        shared = round(n_words * w.prefix_share) if w.prefix_share > 0 and self.turn == 0 else 0
        shared = min(shared, n_words - 1)
        own = prompt_text(n_words - shared, offset, tag)
        if shared <= 0:
            return f"{own}\n\n{INSTRUCTION}"
        # the same words for every request of this target (and run): a common "system prompt"
        scope = f"{w.nonce}:{w.seed}:{self.index // TARGET_STRIDE}"
        stag = f"{zlib.crc32(f'{scope}:shared'.encode()):08x}"
        start = random.Random(f"{scope}:shared").randrange(len(WORDS))
        return f"{prompt_text(shared, start, stag)}\n\n{own}\n\n{INSTRUCTION}"

    @property
    def finished(self) -> bool:
        return self.turn >= self.workload.turns


@dataclass(frozen=True)
class TrafficClass:
    """One stream of load: a workload sent closed-loop (``concurrency``) or open-loop (``rate``).

    With both, ``rate`` sets arrivals and ``concurrency`` caps requests in flight (the wait for a
    free place is never counted in TTFT). With a ``trace``, its arrival times and lengths replace
    ``rate`` and the workload's lengths (``trace_speed`` 2 replays twice as fast).
    """

    name: str | None
    workload: Workload
    concurrency: int | None = None
    rate: float | None = None
    poisson: bool = False
    requests: int | None = None
    priority: str | None = None
    tenant: str | None = None
    api_key: str | None = None
    trace: tuple[TraceEntry, ...] | None = field(default=None, repr=False)
    trace_speed: float = 1.0

    def headers(self) -> dict[str, str]:
        out = {}
        if self.priority:
            out["X-Priority"] = self.priority
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        return out

    @property
    def label(self) -> str:
        return self.name or "all"


# --- scenario files ------------------------------------------------------------------------
class ScenarioError(ValueError):
    pass


@dataclass(frozen=True)
class Scenario:
    classes: tuple[TrafficClass, ...]
    duration: float | None
    requests: int | None


_WORKLOAD_KEYS = {"endpoint", "prompt_tokens", "prompt_spread", "max_tokens", "max_tokens_spread", "turns",
                  "ignore_eos", "include_usage", "extra_body"}
_CLASS_KEYS = _WORKLOAD_KEYS | {"name", "concurrency", "rate", "poisson", "requests", "priority", "tenant",
                                "api_key", "api_key_env", "trace", "trace_speed"}
_TOP_KEYS = {"duration", "requests", "seed", "defaults", "class"}


def parse_duration(text: str | float | int, *, default_unit: str = "s") -> float:
    """Seconds from ``"90s"``, ``"250ms"``, ``"2m"``, ``"1.5"`` (in ``default_unit``)."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        value, unit = float(text), default_unit
    else:
        s = str(text).strip().lower()
        for unit in ("ms", "s", "m", "h"):
            if s.endswith(unit) and s[: -len(unit)].strip().replace(".", "", 1).isdigit():
                value = float(s[: -len(unit)])
                break
        else:
            try:
                value, unit = float(s), default_unit
            except ValueError:
                raise ValueError(f"{text!r} is not a duration (examples: 2s, 250ms, 1.5m)") from None
    return value * {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}[unit]


def _check_type(where: str, key: str, value: Any, types: tuple[type, ...]) -> None:
    if isinstance(value, bool) and bool not in types:
        raise ScenarioError(f"{where}: '{key}' must be {' or '.join(t.__name__ for t in types)}")
    if not isinstance(value, types):
        raise ScenarioError(f"{where}: '{key}' must be {' or '.join(t.__name__ for t in types)}, "
                            f"not {type(value).__name__}")


_TYPES: dict[str, tuple[type, ...]] = {
    "endpoint": (str,), "prompt_tokens": (int,), "prompt_spread": (int,), "max_tokens": (int,),
    "max_tokens_spread": (int,), "turns": (int,), "ignore_eos": (bool,), "include_usage": (bool,),
    "extra_body": (dict,), "name": (str,), "concurrency": (int,), "rate": (int, float), "poisson": (bool,),
    "requests": (int,), "priority": (str,), "tenant": (str,), "api_key": (str,), "api_key_env": (str,),
    "trace": (str,), "trace_speed": (int, float),
}


def load_scenario(path: str | Path, base: Workload, env: dict[str, str] | None = None) -> Scenario:
    """Read a scenario TOML; errors name the file and the key (and the line for syntax errors)."""
    import os

    env = dict(os.environ) if env is None else env
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    for key in data:
        if key not in _TOP_KEYS:
            raise ScenarioError(f"{path}: unknown key '{key}' (known: {', '.join(sorted(_TOP_KEYS))})")
    defaults = data.get("defaults", {})
    for key in defaults:
        if key not in _WORKLOAD_KEYS:
            raise ScenarioError(f"{path}: [defaults]: unknown key '{key}'")
    raw_classes = data.get("class")
    if not isinstance(raw_classes, list) or not raw_classes:
        raise ScenarioError(f"{path}: needs at least one [[class]] table")
    try:
        duration = parse_duration(data["duration"]) if "duration" in data else None
    except ValueError as exc:
        raise ScenarioError(f"{path}: 'duration': {exc}") from None
    requests = data.get("requests")
    if requests is not None:
        _check_type(str(path), "requests", requests, (int,))
    if duration is None and requests is None and not all("trace" in c for c in raw_classes if isinstance(c, dict)):
        raise ScenarioError(f"{path}: set 'duration' or 'requests' at the top level")
    seed = data.get("seed", base.seed)
    classes, names = [], set()
    for i, raw in enumerate(raw_classes):
        name = raw.get("name", f"class{i + 1}")
        where = f"{path}: [[class]] #{i + 1} ({name})"
        merged = {**defaults, **raw}
        for key, value in merged.items():
            if key not in _CLASS_KEYS:
                raise ScenarioError(f"{where}: unknown key '{key}' (known: {', '.join(sorted(_CLASS_KEYS))})")
            _check_type(where, key, value, _TYPES[key])
        if name in names:
            raise ScenarioError(f"{where}: duplicate class name '{name}'")
        names.add(name)
        if merged.get("endpoint", base.endpoint) not in ENDPOINTS:
            raise ScenarioError(f"{where}: 'endpoint' must be one of {', '.join(ENDPOINTS)}")
        trace = None
        if "trace" in merged:
            if "rate" in merged:
                raise ScenarioError(f"{where}: 'trace' sets the arrivals; drop 'rate'")
            try:
                trace = load_trace(path.parent / merged["trace"])
            except TraceError as exc:
                raise ScenarioError(f"{where}: 'trace': {exc}") from None
        elif "concurrency" not in merged and "rate" not in merged:
            raise ScenarioError(f"{where}: set 'concurrency' (closed loop), 'rate' (requests/s) or 'trace' (a replay)")
        for key in ("concurrency", "rate", "prompt_tokens", "max_tokens", "turns", "trace_speed"):
            if key in merged and merged[key] <= 0:
                raise ScenarioError(f"{where}: '{key}' must be > 0")
        api_key = merged.get("api_key")
        if "api_key_env" in merged:
            api_key = env.get(merged["api_key_env"])
            if api_key is None:
                raise ScenarioError(f"{where}: 'api_key_env': environment variable "
                                    f"{merged['api_key_env']} is not set")
        workload = replace(base, seed=seed + i, **{k: v for k, v in merged.items() if k in _WORKLOAD_KEYS})
        classes.append(TrafficClass(
            name=name, workload=workload, concurrency=merged.get("concurrency"),
            rate=float(merged["rate"]) if "rate" in merged else None, poisson=merged.get("poisson", False),
            requests=merged.get("requests", requests) if trace is None else len(trace),
            priority=merged.get("priority"), tenant=merged.get("tenant"), api_key=api_key, trace=trace,
            trace_speed=float(merged.get("trace_speed", 1.0))))
    return Scenario(tuple(classes), duration, requests)
