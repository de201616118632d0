"""What a gateway adds: the same streams straight to a runtime, through passerelle, and through LiteLLM.

One run starts ``passerelle fake-backend`` (TTFT 50 ms, ITL 10 ms, 32 tokens, no slot limit),
passerelle in front of it (default settings: metrics and access log on; the fake as an ``openai``
backend with ``max_concurrency`` 1024, so nothing queues) and the LiteLLM proxy (its defaults, the
fake as an ``openai/`` model; installed once into its own virtualenv under the work folder, never a
project dependency). At each concurrency it runs rounds that alternate the three targets, each
round in a rotated order, so that drift of a shared machine hits all of them alike.

Figures per concurrency and target: TTFT p50/p95/p99 and what the gateway adds to direct's;
aggregate tokens/s as a fraction of direct's; the gateway's CPU seconds per 1,000 requests
(utime + stime from /proc of the gateway's process tree, before and after each round) and its RSS.
Latencies and rates are medians over the rounds, and "added" is taken round by round against the
direct round that ran next to it, so that one disturbed round on a shared machine moves nothing.
Before each round the script waits until the three servers are idle (a proxy may still be
streaming answers its clients gave up on), and after ``--round-cap-s`` a round takes no more
measured requests (LiteLLM at hundreds of streams would otherwise need many minutes).

The client is a lean HTTP/1.1 client on uvloop and httptools (one keep-alive connection per
simulated user, the request written in one call): TTFT runs from that write to the first content
event. Users start staggered over one request's duration (otherwise identical requests march in
lock-step waves), the first request of each connection is a warm-up, and users keep sending until
the last measured request has ended, so the load stays at the concurrency for the whole window.
The generator's ceiling (the fake with no TTFT and 1 ms ITL, direct) is measured first, and each
round records the generator's own CPU, so a run shows whether the generator could keep up.

    .venv/bin/python bench/overhead.py                              # 1, 64, 256 streams; ~5-7 min
    .venv/bin/python bench/overhead.py --concurrency 1,64 --requests-per-level 200 --rounds 2
    .venv/bin/python bench/overhead.py --soak 10                   # 64 streams through passerelle
    .venv/bin/python bench/overhead.py --profile [--native]         # py-spy on passerelle at 64, 256
    .venv/bin/python bench/overhead.py --no-litellm --also-src ../other-checkout   # A/B two versions
    .venv/bin/python bench/overhead.py --no-litellm --also-toml $'[server]\naccess_log = false'
    .venv/bin/python bench/overhead.py --no-litellm --upstream [openai] --concurrency 64   # capacity
        # from the runtime: `passerelle serve --upstream URL` (no max_concurrency) in front of a fake
        # that runs 64 streams at once (reported by its /props; with "openai": learned)

Writes ``results.json`` (``soak.json``, ``profile.json``) and the printed table (``report.md``) to
``--out`` (default bench/out/overhead). Figures, not a pass/fail test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools

ROOT = Path(__file__).resolve().parent.parent
MODEL = "fake-model"
MASTER_KEY = "sk-bench-" + "5a" * 16  # LiteLLM refuses to start without one; passerelle ignores it
TICKS = os.sysconf("SC_CLK_TCK")
WORK = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "passerelle" / "bench"

# A content event: a non-empty "content" string (the role chunk's "content":"" does not count).
_CONTENT = re.compile(rb'"content"\s*:\s*"[^"]')


# --- processes -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (LiteLLM may run workers; passerelle runs one process)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children[ppid].append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime
    return total


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def own_cpu_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def cpu_pressure() -> float | None:
    """Share of the last 10 s in which some runnable task waited for a CPU (Linux PSI), percent."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        return float(Path("/proc/pressure/cpu").read_text().split()[1].split("=")[1])
    return None


def settle(pids: list[int], limit_s: float = 20.0) -> float:
    """Wait until these processes are nearly idle (below 10 % of a core over 0.3 s), so that one
    target's backlog (a proxy still streaming answers its clients gave up on) does not run into the
    next target's round. Returns the seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        c0 = cpu_s(pids)
        time.sleep(0.3)
        if cpu_s(pids) - c0 < 0.03:
            break
    return time.monotonic() - t0


class NotReady(RuntimeError):
    pass


@dataclass
class Service:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pids(self) -> list[int]:
        return tree(self.proc.pid)

    def wait_ready(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NotReady(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            try:
                req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {MASTER_KEY}"})
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise NotReady(f"{self.name} not ready after {timeout:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(name: str, argv: list[str], work: Path, env: dict[str, str] | None = None, url: str = "") -> Service:
    log = work / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=work,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return Service(name, url, proc, log)


def start_fake(work: Path, ttft_ms: float, itl_ms: float, tokens: int, tag: str = "fake", slots: int = 0) -> Service:
    port = free_port()
    svc = spawn(tag, [sys.executable, "-m", "passerelle", "fake-backend", "--port", str(port), "--ttft-ms",
                      str(ttft_ms), "--itl-ms", str(itl_ms), "--tokens", str(tokens), "--model", MODEL,
                      *(["--slots", str(slots)] if slots else [])],
                work, url=f"http://127.0.0.1:{port}")
    svc.wait_ready("/health", 30)
    return svc


def start_passerelle(work: Path, backend_url: str, extra_toml: str = "", *, name: str = "passerelle",
                     src: Path | None = None, env: dict[str, str] | None = None, upstream: str = "") -> Service:
    """passerelle from this checkout, or from the source tree ``src`` (an A/B against another copy).
    ``upstream``: instead of a configuration, ``passerelle serve --upstream [KIND=]URL`` with no
    max_concurrency ("detect": the kind it detects; else the KIND to force, e.g. "openai")."""
    port = free_port()
    if upstream:
        state = work / f"{name}-state"
        shutil.rmtree(state, ignore_errors=True)
        spec = backend_url if upstream == "detect" else f"{upstream}={backend_url}"
        cfg_env = {"PASSERELLE_STATE": str(state), **(env or {})}
        if src is not None:
            cfg_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src.resolve()), os.environ.get("PYTHONPATH")]))
        return spawn(name, [sys.executable, "-m", "passerelle", "serve", "--upstream", spec, "--port", str(port)],
                     work, env=cfg_env, url=f"http://127.0.0.1:{port}")
    cfg = work / f"{name}.toml"
    cfg.write_text(f"""{extra_toml}
[[backends]]
name = "fake"
kind = "openai"
url = "{backend_url}"
models = ["{MODEL}"]
max_concurrency = 1024
""")
    state = work / f"{name}-state"
    shutil.rmtree(state, ignore_errors=True)
    extra_env = {"PASSERELLE_STATE": str(state), **(env or {})}
    if src is not None:
        extra_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src.resolve()), os.environ.get("PYTHONPATH")]))
    return spawn(name, [sys.executable, "-m", "passerelle", "serve", "--config", str(cfg), "--port", str(port)],
                 work, env=extra_env, url=f"http://127.0.0.1:{port}")


def litellm_bin(venv: Path, spec: str) -> Path:
    """The LiteLLM proxy's entry point, installed into ``venv`` on first use (minutes, once)."""
    exe, stamp = venv / "bin" / "litellm", venv / ".passerelle-bench-installed"
    if exe.exists() and stamp.exists():
        return exe
    base = getattr(sys, "_base_executable", None) or sys.executable
    print(f"installing {spec} into {venv} (once; log in {venv}.install.log) ...", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{venv}.install.log", "wb") as log:
        subprocess.run([base, "-m", "venv", str(venv)], check=True, stdout=log, stderr=subprocess.STDOUT)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", spec], check=True, stdout=log,
                       stderr=subprocess.STDOUT)
    stamp.write_text(spec + "\n")
    return exe


def litellm_version(venv: Path) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.metadata as m;"
                          "print(m.version('litellm'))"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def start_litellm(work: Path, exe: Path, backend_url: str, extra: list[str]) -> Service:
    port = free_port()
    cfg = work / "litellm.yaml"
    cfg.write_text(f"""model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: {backend_url}/v1
      api_key: sk-fake
litellm_settings:
  telemetry: false
general_settings:
  master_key: {MASTER_KEY}
""")
    # The model cost map is bundled; without this LiteLLM first tries to fetch it from the network.
    return spawn("litellm", [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port), *extra], work,
                 env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"}, url=f"http://127.0.0.1:{port}")


# --- the load generator --------------------------------------------------------------------------
class Failed(Exception):
    pass


class StreamConn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection sending one streaming request at a time."""

    def __init__(self, sink: Totals) -> None:
        self.sink = sink
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.open = False
        self.status = 0
        self.keep_alive = True
        self.tail = b""
        self.first = 0.0
        self.tokens = 0
        self.done = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(Failed(f"bad HTTP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._finish(Failed("connection closed mid-request"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        buf = self.tail + body if self.tail else body
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self.tail = buf
            return
        events, self.tail = buf[: cut + 2], buf[cut + 2:]
        n = len(_CONTENT.findall(events))
        if n:
            if not self.first:
                self.first = time.perf_counter()
            self.tokens += n
            self.sink.tokens += n
        if b"data: [DONE]" in events:
            self.done = True

    def on_message_complete(self) -> None:
        self._finish(None)

    def _finish(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            if exc is None:
                self.waiter.set_result(None)
            else:
                self.waiter.set_exception(exc)

    async def request(self, raw: bytes, timeout: float) -> tuple[float, float, float, int]:
        """(sent, first content, end, content events); raises Failed or TimeoutError."""
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.first, self.tokens, self.done, self.tail, self.status = 0.0, 0, False, b"", 0
        t0 = time.perf_counter()
        self.transport.write(raw)
        async with asyncio.timeout(timeout):
            await self.waiter
        end = time.perf_counter()
        if self.status != 200:
            raise Failed(f"HTTP {self.status}")
        if not self.done:
            raise Failed("stream ended without [DONE]")
        return t0, self.first, end, self.tokens

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


@dataclass
class Totals:
    tokens: int = 0  # content events received on any request of the round, warm-ups included


def request_bytes(url: str, max_tokens: int) -> bytes:
    host = url.split("//", 1)[1]
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Tell me about rivers."}]},
                      separators=(",", ":")).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {MASTER_KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


@dataclass
class Round:
    ttft_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    tokens_per_s: float = 0.0
    requests: int = 0  # every request the round sent and finished (warm-ups and cool-downs included)
    wall_s: float = 0.0
    window_s: float = 0.0
    gen_cpu_s: float = 0.0


async def run_load(url: str, concurrency: int, measured: int, max_tokens: int, stagger_s: float,
                   timeout: float, deadline_s: float | None = None,
                   on_done: Callable[[float, float, float, int], None] | None = None,
                   cap_s: float | None = None) -> Round:
    """``concurrency`` users, each on its own connection: a warm-up request, then measured ones
    until ``measured`` are taken, then more (not measured) until the last measured one ended.

    ``cap_s``: after this long, take no more measured requests (a slow target gets fewer, but at
    least one per user). With ``deadline_s`` (soak) users run until then and nothing is measured
    but ``on_done``.
    """
    loop = asyncio.get_running_loop()
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    raw = request_bytes(url, max_tokens)
    totals = Totals()
    out = Round()
    state = {"taken": 0, "ended": 0, "t_a": 0.0, "tok_a": 0, "t_b": 0.0, "tok_b": 0, "closed": False}
    at_least = min(measured, concurrency)

    def maybe_all_ended() -> None:
        if state["ended"] == state["taken"] and (state["taken"] >= measured or state["closed"]) \
                and not all_ended.done():
            state["t_b"], state["tok_b"] = time.perf_counter(), totals.tokens
            all_ended.set_result(None)
    all_ended = loop.create_future()
    if measured <= 0:
        all_ended.set_result(None)
    t_start, gen0 = time.perf_counter(), own_cpu_s()
    stop_at = (t_start + deadline_s) if deadline_s is not None else None

    async def user(i: int) -> None:
        await asyncio.sleep(stagger_s * i / concurrency)
        conn: StreamConn | None = None
        warm = True
        try:
            while True:
                if stop_at is not None:
                    if time.perf_counter() >= stop_at:
                        return
                    counted = False
                elif all_ended.done():
                    return
                else:
                    if (cap_s is not None and not state["closed"] and state["taken"] >= at_least
                            and time.perf_counter() - t_start > cap_s):
                        state["closed"] = True
                        maybe_all_ended()
                        if all_ended.done():
                            return
                    counted = not warm and state["taken"] < measured and not state["closed"]
                if conn is None or not conn.open or not conn.keep_alive:
                    if conn is not None:
                        conn.close()
                    try:
                        _, conn = await loop.create_connection(lambda: StreamConn(totals), host, int(port))
                    except OSError as exc:
                        out.errors[f"connect: {exc.__class__.__name__}"] += 1
                        await asyncio.sleep(0.1)
                        continue
                if counted:
                    state["taken"] += 1
                    if state["taken"] == 1:
                        state["t_a"], state["tok_a"] = time.perf_counter(), totals.tokens
                try:
                    t0, first, end, n = await conn.request(raw, timeout)
                except (Failed, TimeoutError) as exc:
                    out.errors[str(exc) or "timeout"] += 1
                    conn.close()
                    conn = None
                else:
                    out.requests += 1
                    if on_done is not None:
                        on_done(t0, first, end, n)
                    if counted:
                        if n != max_tokens:
                            out.errors[f"{n} of {max_tokens} tokens"] += 1
                        out.ttft_ms.append((first - t0) * 1000)
                        out.e2e_ms.append((end - t0) * 1000)
                if counted:
                    state["ended"] += 1
                    maybe_all_ended()
                warm = False
        finally:
            if conn is not None:
                conn.close()

    await asyncio.gather(*(user(i) for i in range(concurrency)))
    out.wall_s = time.perf_counter() - t_start
    out.gen_cpu_s = own_cpu_s() - gen0
    if measured > 0 and state["t_b"] > state["t_a"]:
        out.window_s = state["t_b"] - state["t_a"]
        out.tokens_per_s = (state["tok_b"] - state["tok_a"]) / out.window_s
    return out


def run_async(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(coro)
    return uvloop.run(coro)


# --- statistics and reporting --------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float:
    """Percentile with linear interpolation between order statistics."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None or x != x:  # None or NaN
        return "–"
    return f"{x:,.{digits}f}"


@dataclass
class Cell:
    """All rounds of one target at one concurrency.

    Figures are medians over rounds (one disturbed round on a shared machine does not move them);
    what a gateway adds is taken round by round against direct's round of the same index, which
    ran next to it. The pooled percentiles are in the JSON too.
    """

    ttft_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    cpu_s: float = 0.0
    rss: int = 0
    gen_cpu_s: float = 0.0
    wall_s: float = 0.0
    rounds: list[dict[str, float]] = field(default_factory=list)

    def add(self, r: Round, cpu: float, rss: int) -> None:
        self.ttft_ms += r.ttft_ms
        self.e2e_ms += r.e2e_ms
        self.errors.update(r.errors)
        self.requests += r.requests
        self.cpu_s += cpu
        self.rss = max(self.rss, rss)
        self.gen_cpu_s += r.gen_cpu_s
        self.wall_s += r.wall_s
        self.rounds.append({"p50": pct(r.ttft_ms, 50), "p95": pct(r.ttft_ms, 95), "p99": pct(r.ttft_ms, 99),
                            "tps": r.tokens_per_s, "cpu_s": cpu, "requests": r.requests})

    def summary(self, direct: Cell | None, is_gateway: bool) -> dict[str, Any]:
        keys = ("p50", "p95", "p99")
        q = {k: round(median([r[k] for r in self.rounds]), 3) for k in keys}
        paired = direct is not None and is_gateway
        added = ({k: round(median([r[k] - d[k] for r, d in zip(self.rounds, direct.rounds, strict=False)]), 3)
                  for k in keys} if paired else None)
        vs = (median([r["tps"] / d["tps"] for r, d in zip(self.rounds, direct.rounds, strict=False) if d["tps"]])
              if direct is not None else None)
        return {
            "requests_measured": len(self.ttft_ms), "errors": dict(self.errors), "ttft_ms": q,
            "added_ttft_ms": added,
            "ttft_ms_pooled": {k: round(pct(self.ttft_ms, int(k[1:])), 3) for k in keys},
            "e2e_ms_p50": round(pct(self.e2e_ms, 50), 3),
            "tokens_per_s": round(median([r["tps"] for r in self.rounds]), 1),
            "tokens_per_s_vs_direct": None if vs is None else round(vs, 4),
            "cpu_s_per_1k_requests": round(1000 * self.cpu_s / self.requests, 3) if is_gateway and self.requests
            else None,
            "rss_mib": round(self.rss / 2**20, 1) if is_gateway else None,
            "requests_total": self.requests,
            "generator_cpu_pct": round(100 * self.gen_cpu_s / self.wall_s, 1) if self.wall_s else None,
            "rounds": [{k: round(v, 3) for k, v in r.items()} for r in self.rounds],
        }


def median(xs: list[float]) -> float:
    return pct(xs, 50)


def table(results: dict[str, Any], targets: list[str]) -> str:
    lines = ["| streams | target | TTFT p50 / p95 / p99 ms | added p50 / p95 / p99 ms | tokens/s | vs direct | "
             "gateway CPU s / 1k req | RSS MiB | errors |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for level in results["levels"]:
        for name in targets:
            s = level["targets"].get(name)
            if s is None:
                continue
            q, a = s["ttft_ms"], s["added_ttft_ms"]
            added = " / ".join(f"{a[k]:+.1f}" for k in ("p50", "p95", "p99")) if a else "–"
            vs = s["tokens_per_s_vs_direct"]
            lines.append(
                f"| {level['concurrency']} | {name} | {q['p50']:.1f} / {q['p95']:.1f} / {q['p99']:.1f} | {added} | "
                f"{s['tokens_per_s']:,.0f} | {fmt(None if vs is None else 100 * vs, 1)} % | "
                f"{fmt(s['cpu_s_per_1k_requests'], 2)} | {fmt(s['rss_mib'], 0)} | "
                f"{sum(s['errors'].values())} |")
    return "\n".join(lines)


def goals(results: dict[str, Any]) -> list[str]:
    by = {lv["concurrency"]: lv["targets"] for lv in results["levels"]}
    out = []
    if 64 in by and "passerelle" in by[64]:
        a = by[64]["passerelle"]["added_ttft_ms"]
        out.append(f"added TTFT at 64 streams: p50 {a['p50']:+.2f} ms (goal <= 1), p99 {a['p99']:+.2f} ms "
                   f"(goal <= 5): {'met' if a['p50'] <= 1 and a['p99'] <= 5 else 'NOT met'}")
        if "litellm" in by[64]:
            la = by[64]["litellm"]["added_ttft_ms"]
            ratio = a["p50"] / la["p50"] if la["p50"] > 0 else float("nan")
            out.append(f"passerelle / LiteLLM added TTFT p50 at 64 streams: {a['p50']:.2f} / {la['p50']:.2f} ms "
                       f"= {ratio:.3f} (goal <= 0.2): {'met' if ratio <= 0.2 else 'NOT met'}")
    if 256 in by and "passerelle" in by[256]:
        f = by[256]["passerelle"]["tokens_per_s_vs_direct"]
        if f is not None:
            out.append(f"tokens/s through passerelle at 256 streams: {100 * f:.1f} % of direct (goal >= 90 %): "
                       f"{'met' if f >= 0.9 else 'NOT met'}")
    return out


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}


# --- the modes -----------------------------------------------------------------------------------
def measure_ceiling(work: Path, tokens: int, concurrency: int, requests: int) -> dict[str, Any]:
    """Direct against a fake with no TTFT and 1 ms ITL: as many events as generator and fake manage."""
    fake = start_fake(work, 0, 1, tokens, tag="fake-ceiling")
    try:
        f0 = cpu_s(fake.pids)
        r = run_async(run_load(fake.url, concurrency, requests, tokens, stagger_s=0.05, timeout=60))
        fake_cpu = cpu_s(fake.pids) - f0
    finally:
        fake.stop()
    return {"concurrency": concurrency, "fake_ttft_ms": 0, "fake_itl_ms": 1, "tokens": tokens,
            "requests_per_s": round(r.requests / r.wall_s, 1), "tokens_per_s": round(r.tokens_per_s, 1),
            "generator_cpu_pct": round(100 * r.gen_cpu_s / r.wall_s, 1),
            "fake_cpu_pct": round(100 * fake_cpu / r.wall_s, 1), "errors": dict(r.errors)}


def per_level(spec: str, levels: list[int]) -> dict[int, int]:
    if spec == "auto":
        return {c: max(60, 16 * c) for c in levels}
    values = [int(x) for x in spec.split(",")]
    if len(values) == 1:
        values *= len(levels)
    if len(values) != len(levels):
        raise SystemExit("--requests-per-level: one number, or one per concurrency level")
    return dict(zip(levels, values, strict=True))


def compare(args: argparse.Namespace, work: Path, out: Path) -> dict[str, Any]:
    levels = [int(x) for x in args.concurrency.split(",")]
    counts = per_level(args.requests_per_level, levels)
    duration = (args.ttft_ms + (args.tokens - 1) * args.itl_ms) / 1000
    variant = bool(args.also_src or args.also_env or args.also_toml)
    targets = ["direct", "passerelle", *(["passerelle-b"] if variant else []),
               *([] if args.no_litellm else ["litellm"])]
    results: dict[str, Any] = {
        "benchmark": "overhead", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
        "loadavg_start": loadavg(), "cpu_pressure_start": cpu_pressure(),
        "fake": {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms, "tokens": args.tokens,
                 "slots": (args.fake_slots or max(levels)) if args.upstream else "unlimited"},
        "passerelle": (f"serve --upstream ({args.upstream})" if args.upstream
                       else "a configuration, max_concurrency 1024"),
        "rounds": args.rounds, "requests_per_level": counts, "levels": [], "loadavg": []}
    exe = None
    if not args.no_litellm:
        try:
            exe = litellm_bin(args.litellm_venv, args.litellm_spec)
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"WARNING: could not install LiteLLM ({exc}; see {args.litellm_venv}.install.log); "
                  "going on without it", flush=True)
            results["litellm_error"] = str(exc)
            targets.remove("litellm")
    if exe is not None:
        results["litellm_version"] = litellm_version(args.litellm_venv)
        results["litellm_args"] = args.litellm_args
    if args.ceiling:
        print("generator ceiling: direct to a fake with TTFT 0, ITL 1 ms ...", flush=True)
        results["generator_ceiling"] = c = measure_ceiling(work, args.tokens, max(levels), max(counts.values()))
        print(f"  {c['tokens_per_s']:,.0f} tokens/s, {c['requests_per_s']:,.0f} requests/s at {c['concurrency']} "
              f"streams; generator CPU {c['generator_cpu_pct']} %, fake CPU {c['fake_cpu_pct']} %", flush=True)
    services: list[Service] = []
    try:
        fake = start_fake(work, args.ttft_ms, args.itl_ms, args.tokens,
                          slots=(args.fake_slots or max(levels)) if args.upstream else 0)
        services.append(fake)
        gw = start_passerelle(work, fake.url, args.passerelle_toml, src=args.src, upstream=args.upstream)
        services.append(gw)
        gwb = (start_passerelle(work, fake.url, args.also_toml, name="passerelle-b", src=args.also_src or args.src,
                                env=dict(kv.split("=", 1) for kv in args.also_env)) if variant else None)
        if gwb is not None:
            services.append(gwb)
            results["variant_b"] = {"src": str(args.also_src or args.src or ROOT), "env": args.also_env,
                                    "toml": args.also_toml}
        ll = start_litellm(work, exe, fake.url, args.litellm_args.split()) if exe is not None else None
        if ll is not None:
            services.append(ll)
        gw.wait_ready("/ready", 60)
        if gwb is not None:
            gwb.wait_ready("/ready", 60)
        if ll is not None:
            try:
                ll.wait_ready("/health/liveliness", 300)
            except NotReady as exc:
                print(f"WARNING: {exc}; going on without LiteLLM", flush=True)
                results["litellm_error"] = str(exc)
                targets.remove("litellm")
                ll.stop()
                services.remove(ll)
                ll = None
        procs = {"passerelle": gw, **({"passerelle-b": gwb} if gwb else {}), **({"litellm": ll} if ll else {})}
        urls = {"direct": fake.url, **{name: svc.url for name, svc in procs.items()}}
        print(f"fake {fake.url}, passerelle {gw.url}" + (f", litellm {ll.url}" if ll else "") + "; warming up",
              flush=True)
        for name in targets:  # first requests pay for lazy imports and connection set-up: not counted
            run_async(run_load(urls[name], 8, 32, args.tokens, stagger_s=duration, timeout=args.timeout))
        for conc in levels:
            cells = {name: Cell() for name in targets}
            per_round = max(1, counts[conc] // args.rounds)
            results["loadavg"].append({"concurrency": conc, "before": loadavg(), "cpu_pressure_before": cpu_pressure()})
            for rnd in range(args.rounds):
                order = targets[rnd % len(targets):] + targets[: rnd % len(targets)]
                for name in order:
                    pids = procs[name].pids if name in procs else []
                    settle([p for svc in services for p in svc.pids])
                    c0 = cpu_s(pids)
                    r = run_async(run_load(urls[name], conc, per_round, args.tokens, stagger_s=duration,
                                           timeout=args.timeout, cap_s=args.round_cap_s or None))
                    cpu, rss = cpu_s(pids) - c0, rss_bytes(pids)
                    cells[name].add(r, cpu, rss)
                    print(f"  {conc:>4} streams  round {rnd + 1}/{args.rounds}  {name:<12} {len(r.ttft_ms):>5} req  "
                          f"TTFT p50 {pct(r.ttft_ms, 50):7.2f} ms  p99 {pct(r.ttft_ms, 99):7.2f} ms  "
                          f"{r.tokens_per_s:9,.0f} tok/s  gen CPU {100 * r.gen_cpu_s / r.wall_s:3.0f} %"
                          + (f"  gw CPU {cpu:5.2f} s" if pids else "")
                          + (f"  errors {dict(r.errors)}" if r.errors else ""), flush=True)
            direct = cells["direct"]
            results["levels"].append({
                "concurrency": conc, "ideal_tokens_per_s": round(conc * args.tokens / duration, 1),
                "targets": {n: cells[n].summary(direct, n != "direct") for n in targets}})
            results["loadavg"][-1].update(after=loadavg(), cpu_pressure_after=cpu_pressure())
    finally:
        for svc in reversed(services):
            svc.stop()
    results["loadavg_end"] = loadavg()
    results["cpu_pressure_end"] = cpu_pressure()
    text = report(results, targets)
    print("\n" + text)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(text + "\n")
    print(f"\nwrote {out / 'results.json'} and {out / 'report.md'}")
    return results


def report(results: dict[str, Any], targets: list[str]) -> str:
    m = results["machine"]
    la = results["loadavg"]
    loads = ", ".join(f"{x['concurrency']}: {x['before'][0]:.2f}→{x.get('after', ['?'])[0]}" for x in la)
    psi = [x.get(k) for x in la for k in ("cpu_pressure_before", "cpu_pressure_after") if x.get(k) is not None]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}; load average (1 min) at start "
             f"{results['loadavg_start'][0]:.2f}, per level {loads}"
             + (f"; CPU pressure (PSI some, avg10) {min(psi):.0f}–{max(psi):.0f} %" if psi else "")
             + f"; LiteLLM {results.get('litellm_version', '–')}.",
             f"fake-backend: TTFT {results['fake']['ttft_ms']:g} ms, ITL {results['fake']['itl_ms']:g} ms, "
             f"{results['fake']['tokens']} tokens; {results['rounds']} rounds per level alternating the targets; "
             f"measured requests per target: {results['requests_per_level']}.", ""]
    if "generator_ceiling" in results:
        c = results["generator_ceiling"]
        lines.append(f"Generator ceiling (direct, fake with TTFT 0 / ITL 1 ms, {c['concurrency']} streams): "
                     f"{c['tokens_per_s']:,.0f} tokens/s, {c['requests_per_s']:,.0f} requests/s, generator CPU "
                     f"{c['generator_cpu_pct']} %, fake CPU {c['fake_cpu_pct']} %.")
    for lv in results["levels"]:
        d = lv["targets"]["direct"]
        lines.append(f"Direct at {lv['concurrency']} streams: {d['tokens_per_s']:,.0f} tokens/s = "
                     f"{100 * d['tokens_per_s'] / lv['ideal_tokens_per_s']:.1f} % of the fake's schedule "
                     f"({lv['ideal_tokens_per_s']:,.0f}); generator CPU {d['generator_cpu_pct']} %.")
    lines += ["", table(results, targets), "", *goals(results)]
    return "\n".join(lines)


def dashboard_window(extra_toml: str) -> float:
    """passerelle's [metrics] window_s: from --passerelle-toml, else its default."""
    import tomllib

    from passerelle.config import MetricsConfig

    with contextlib.suppress(tomllib.TOMLDecodeError, TypeError, ValueError):
        return float(tomllib.loads(extra_toml).get("metrics", {}).get("window_s", MetricsConfig.window_s))
    return float(MetricsConfig.window_s)


def soak(args: argparse.Namespace, work: Path, out: Path) -> dict[str, Any]:
    duration = (args.ttft_ms + (args.tokens - 1) * args.itl_ms) / 1000
    total_s = args.soak * 60
    samples: list[dict[str, Any]] = []
    done = {"n": 0, "tokens": 0}
    window = dashboard_window(args.passerelle_toml)
    fake = start_fake(work, args.ttft_ms, args.itl_ms, args.tokens)
    gw = None
    try:
        gw = start_passerelle(work, fake.url, args.passerelle_toml, src=args.src)
        gw.wait_ready("/ready", 60)
        print(f"soak: {args.soak_concurrency} streams through passerelle for {args.soak:g} min; RSS every "
              f"{args.soak_interval:g} s after {args.soak_warmup:g} s of warm-up", flush=True)

        def on_done(t0: float, first: float, end: float, n: int) -> None:
            done["n"] += 1
            done["tokens"] += n

        async def sampler() -> None:
            t0 = time.perf_counter()
            await asyncio.sleep(args.soak_warmup)
            while time.perf_counter() - t0 < total_s:
                rss = rss_bytes(gw.pids)
                samples.append({"t_s": round(time.perf_counter() - t0, 1), "rss_mib": round(rss / 2**20, 2),
                                "requests": done["n"], "cpu_s": round(cpu_s(gw.pids), 2)})
                print(f"  t={samples[-1]['t_s']:6.0f} s  RSS {samples[-1]['rss_mib']:7.1f} MiB  "
                      f"requests {done['n']}", flush=True)
                await asyncio.sleep(args.soak_interval)

        async def both() -> Round:
            s = asyncio.create_task(sampler())
            r = await run_load(gw.url, args.soak_concurrency, 0, args.tokens, stagger_s=duration,
                               timeout=args.timeout, deadline_s=total_s, on_done=on_done)
            s.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await s
            return r

        r = run_async(both())
    finally:
        if gw is not None:
            gw.stop()
        fake.stop()
    res: dict[str, Any] = {"benchmark": "overhead-soak", "machine": machine(), "loadavg_end": loadavg(),
                           "minutes": args.soak, "concurrency": args.soak_concurrency, "warmup_s": args.soak_warmup,
                           "dashboard_window_s": window, "requests": r.requests, "errors": dict(r.errors),
                           "samples": samples}
    print()
    # The dashboard keeps every request of its window ([metrics] window_s) in memory, by design:
    # RSS grows until the window is full. Growth after that is what a leak would look like.
    for label, part in (("after warm-up", samples), ("after the dashboard window filled",
                                                      [s for s in samples if s["t_s"] >= window + 10])):
        rss = [s["rss_mib"] for s in part]
        if len(rss) < 2:
            print(f"RSS {label}: fewer than 2 samples (run longer than warm-up / window + 10 s)")
            continue
        spread = (max(rss) - min(rss)) / min(rss)
        res["after_window" if "window" in label else "after_warmup"] = {
            "samples": len(rss), "first_mib": rss[0], "last_mib": rss[-1], "min_mib": min(rss),
            "max_mib": max(rss), "spread_pct": round(100 * spread, 2),
            "growth_pct": round(100 * (rss[-1] - rss[0]) / rss[0], 2), "flat_within_5pct": spread <= 0.05}
        print(f"RSS {label} ({len(rss)} samples): first {rss[0]:.1f} MiB, last {rss[-1]:.1f}, min {min(rss):.1f}, "
              f"max {max(rss):.1f}: spread {100 * spread:.2f} % ({'flat' if spread <= 0.05 else 'NOT flat'} "
              f"within 5 %)")
    print(f"{r.requests} requests, {sum(r.errors.values())} errors" + (f" {dict(r.errors)}" if r.errors else ""))
    (out / "soak.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out / 'soak.json'}")
    return res


# --- profile -------------------------------------------------------------------------------------
# Where a py-spy sample's time goes. A sample is charged by the region of the request's life it is
# in (the outer frames: accounting, the upstream request, the relay loop), then by what runs inside
# it; C code is charged to the Python frame that called it (with --native its own frames show too).
GC = "garbage collector (cyclic GC passes, wherever they trigger)"
LOOP = "event loop in C (uvloop: epoll, socket reads, callback dispatch)"
SEND = "ASGI send to the client (uvicorn send -> transport.write -> write syscall)"
SCAN = "relay.py: SSE split + byte scan (SSEScanner.feed, _scan)"
RELAY = "relay.py: relay loop (StreamRelay.run: await/resume, per-chunk timeout reschedule)"
UP_READ = "upstream read (http1.py protocol, httptools parser, Response.readany)"
UP_REQ = "upstream request (Backend.post: upstream.py pool, connect, write, response headers)"
UVICORN = "uvicorn + httptools request side (HTTP parse, ASGI receive, task start, keep-alive)"
LOG = "access log (record_fields, logging, stderr write)"
METRICS = "metrics (prometheus_client, observe_many)"
DASH = "dashboard window + usage store (livestats, usage)"
LIFECYCLE = "gateway lifecycle (app, gateway.handle, parse, scheduler, routing, request record)"
ASYNCIO = "asyncio machinery (tasks, futures, timeouts) outside the above"
OTHER = "other"
# Frames that only run the loop: a sample whose innermost Python frame is one of these was in C.
OUTER = ("asyncio/runners.py", "uvloop/__init__.py", "uvicorn/server.py", "uvicorn/main.py", "uvicorn/_compat.py")
SYSCALLS = ("write", "writev", "send", "sendmsg", "read", "recv", "recvfrom", "epoll_wait", "epoll_pwait")


def categorise(frames: list[str]) -> str | None:
    """The category of one sample (its frames outermost first); None for an idle helper thread."""
    text = ";".join(frames)
    py = [f for f in frames if ".py" in f]
    if "concurrent/futures/thread.py" in text and "usage.py" not in text:
        return None  # the thread pool waiting for work (py-spy --native counts it as active)
    if "gc_collect" in text:
        return GC
    if not py or any(o in py[-1] for o in OUTER):
        return LOOP
    text = ";".join(py)

    def has(*fragments: str) -> bool:
        return any(f in text for f in fragments)

    if has("RequestResponseCycle.send"):
        return SEND
    if has("Gateway.account", "accesslog.py"):
        if has("accesslog.py", "/logging/"):
            return LOG
        if has("prometheus_client", "passerelle/metrics.py"):
            return METRICS
        if has("livestats.py", "usage.py"):
            return DASH
        return LIFECYCLE
    if has("Backend.post", "passerelle/upstream.py"):
        return UP_REQ
    if has("StreamRelay.run"):
        if has("SSEScanner.feed", "StreamRelay._scan"):
            return SCAN
        if has("passerelle/http1.py"):
            return UP_READ
        return RELAY
    # Outside those regions: by the innermost Python frame (uvicorn frames sit at the bottom of
    # every request task, so the whole stack would say "uvicorn").
    inner = py[-1]
    for category, fragments in ((UP_READ, ("passerelle/http1.py",)), (UVICORN, ("uvicorn/", "httptools")),
                                (METRICS, ("prometheus_client", "passerelle/metrics.py")), (LOG, ("/logging/",)),
                                (DASH, ("livestats.py", "usage.py", "sqlite3")), (LIFECYCLE, ("passerelle/",)),
                                (ASYNCIO, ("asyncio/",))):
        if any(f in inner for f in fragments):
            return category
    return OTHER


def parse_raw(path: Path) -> tuple[Counter[str], Counter[str], Counter[str], Counter[str], int]:
    """(samples by category, self samples by function, inclusive samples by function, samples in
    a system call (with --native), total) from py-spy's raw output."""
    cats: Counter[str] = Counter()
    self_fn: Counter[str] = Counter()
    incl_fn: Counter[str] = Counter()
    syscalls: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack_text, _, count_text = line.rpartition(" ")
        if not stack_text or not count_text.isdigit():
            continue
        n = int(count_text)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack_text.split(";")]
        cat = categorise(frames)
        if cat is None:
            continue
        total += n
        cats[cat] += n
        self_fn[short(frames[-1])] += n
        for f in set(frames):
            incl_fn[short(f)] += n
        leaf = frames[-1].split(" (", 1)[0]
        if leaf in SYSCALLS and "libc" in frames[-1]:
            syscalls[leaf] += n
    return cats, self_fn, incl_fn, syscalls, total


def short(frame: str) -> str:
    m = re.match(r"(.*) \((.*)\)$", frame)
    if not m:
        return frame
    fn, path = m.groups()
    for marker in ("site-packages/", "lib/python3.11/", "/work/main/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{fn}"


def profile(args: argparse.Namespace, work: Path, out: Path) -> dict[str, Any]:
    pyspy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if pyspy is None:
        raise SystemExit("py-spy not found: .venv/bin/pip install py-spy (it is in the dev extras)")
    levels = [int(x) for x in args.profile_levels.split(",")]
    duration = (args.ttft_ms + (args.tokens - 1) * args.itl_ms) / 1000
    res: dict[str, Any] = {"benchmark": "overhead-profile", "machine": machine(), "levels": []}
    fake = start_fake(work, args.ttft_ms, args.itl_ms, args.tokens)
    gw = None
    try:
        gw = start_passerelle(work, fake.url, args.passerelle_toml, src=args.src)
        gw.wait_ready("/ready", 60)
        run_async(run_load(gw.url, 8, 32, args.tokens, stagger_s=duration, timeout=args.timeout))
        for conc in levels:
            raw = out / f"profile-{conc}.txt"
            n = max(args.profile_requests, 8 * conc)
            cmd = [pyspy, "record", "--pid", str(gw.proc.pid), "--rate", str(args.profile_rate), "--format", "raw",
                   "--output", str(raw)]
            if args.native:
                cmd.append("--native")
            else:
                cmd.append("--nonblocking")
            spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.0)  # py-spy attaches
            c0, la0 = cpu_s(gw.pids), loadavg()[0]
            r = run_async(run_load(gw.url, conc, n, args.tokens, stagger_s=duration, timeout=args.timeout))
            cpu = cpu_s(gw.pids) - c0
            spy.send_signal(signal.SIGINT)
            _, err = spy.communicate(timeout=60)
            if not raw.exists():
                raise SystemExit(f"py-spy wrote nothing: {err.decode(errors='replace')[-500:]}")
            cats, self_fn, incl_fn, syscalls, total = parse_raw(raw)
            if not total:
                raise SystemExit(f"py-spy recorded no samples of the gateway; see {raw}")
            lvl = {"concurrency": conc, "requests": r.requests, "gateway_cpu_s": round(cpu, 2),
                   "gateway_cpu_pct_of_core": round(100 * cpu / r.wall_s, 1), "wall_s": round(r.wall_s, 2),
                   "loadavg": la0, "tokens_per_s": round(r.tokens_per_s), "samples": total,
                   "ttft_ms_p50": round(pct(r.ttft_ms, 50), 2), "ttft_ms_p99": round(pct(r.ttft_ms, 99), 2),
                   "categories_pct": {k: round(100 * v / total, 1) for k, v in cats.most_common()},
                   "self_top_pct": {k: round(100 * v / total, 1) for k, v in self_fn.most_common(25)},
                   "inclusive_top_pct": {k: round(100 * v / total, 1) for k, v in incl_fn.most_common(60)},
                   "syscalls_pct": {k: round(100 * v / total, 1) for k, v in syscalls.most_common()},
                   "native": args.native,
                   "raw": raw.name}
            res["levels"].append(lvl)
            print(f"\n{conc} streams: {r.requests} requests in {r.wall_s:.1f} s, gateway CPU {cpu:.1f} s "
                  f"({lvl['gateway_cpu_pct_of_core']} % of a core), {total} samples; TTFT p50 "
                  f"{lvl['ttft_ms_p50']} ms p99 {lvl['ttft_ms_p99']} ms")
            print("| where | % of gateway CPU samples |\n|---|---:|")
            for k, v in lvl["categories_pct"].items():
                print(f"| {k} | {v} |")
            if syscalls:
                print("in system calls: "
                      + ", ".join(f"{k} {100 * v / total:.1f} %" for k, v in syscalls.most_common()))
            print("top self (leaf) frames:")
            for k, v in list(lvl["self_top_pct"].items())[:15]:
                print(f"  {v:5.1f} %  {k}")
    finally:
        if gw is not None:
            gw.stop()
        fake.stop()
    (out / "profile.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out / 'profile.json'} and the raw py-spy stacks (profile-N.txt)")
    return res


# --- command line --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--concurrency", default="1,64,256", help="concurrent streams per level (default 1,64,256)")
    p.add_argument("--requests-per-level", default="auto", metavar="N[,N...]",
                   help="measured requests per target and level, over all rounds: one number for all levels, "
                        "one per level, or auto = max(60, 16 x streams) (default)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per level; each runs every target once (3)")
    p.add_argument("--round-cap-s", type=float, default=15.0,
                   help="stop taking measured requests after this long in a round (a slow target, LiteLLM at "
                        "hundreds of streams, then gets fewer; 0: no cap; default 15)")
    p.add_argument("--litellm-args", default="", help="extra arguments for the litellm proxy, e.g. '--num_workers 2'")
    p.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out (direct and passerelle only)")
    p.add_argument("--no-ceiling", dest="ceiling", action="store_false",
                   help="skip the generator-ceiling measurement")
    p.add_argument("--litellm-venv", type=Path, default=WORK / "litellm-venv",
                   help="virtualenv for the LiteLLM proxy, created on first use (default %(default)s)")
    p.add_argument("--litellm-spec", default="litellm[proxy]", help="what pip installs there (default %(default)s)")
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--tokens", type=int, default=32, help="output tokens per request (max_tokens)")
    p.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--soak", type=float, metavar="MINUTES",
                   help="instead: this long at --soak-concurrency streams through passerelle, RSS sampled")
    p.add_argument("--soak-concurrency", type=int, default=64)
    p.add_argument("--soak-warmup", type=float, default=60.0, help="seconds before the first RSS sample (60)")
    p.add_argument("--soak-interval", type=float, default=10.0, help="seconds between RSS samples (10)")
    p.add_argument("--profile", action="store_true",
                   help="instead: py-spy on passerelle (no LiteLLM) at --profile-levels, where its CPU goes")
    p.add_argument("--profile-levels", default="64,256")
    p.add_argument("--profile-requests", type=int, default=0, help="per level (default 8 x streams)")
    p.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second (250)")
    p.add_argument("--native", action="store_true", help="py-spy --native (C frames too; pauses the process)")
    p.add_argument("--passerelle-toml", default="", metavar="TOML",
                   help="extra configuration for passerelle, e.g. $'[server]\\naccess_log = false'")
    p.add_argument("--upstream", nargs="?", const="detect", default="", metavar="KIND",
                   help="passerelle as `serve --upstream URL` with no max_concurrency, in front of a fake that "
                        "runs as many streams at once as the highest level and queues the rest (its capacity "
                        "comes from the runtime: reported, or learned with KIND=openai)")
    p.add_argument("--fake-slots", type=int, default=0, metavar="N",
                   help="with --upstream: the fake runs N streams at once (default: the highest level)")
    p.add_argument("--src", type=Path, help="run passerelle from this source tree (default: the installed one)")
    p.add_argument("--also-src", type=Path, metavar="DIR",
                   help="A/B: also run passerelle from this source tree, as target passerelle-b")
    p.add_argument("--also-env", action="append", default=[], metavar="K=V",
                   help="A/B: passerelle-b's extra environment (repeatable)")
    p.add_argument("--also-toml", default="", metavar="TOML", help="A/B: passerelle-b's extra configuration")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "overhead", help="results folder")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    print(f"load average {' '.join(map(str, loadavg()))} on {os.cpu_count()} cores", flush=True)
    try:
        if args.soak:
            soak(args, work, args.out)
        elif args.profile:
            profile(args, work, args.out)
        else:
            compare(args, work, args.out)
    except NotReady as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
