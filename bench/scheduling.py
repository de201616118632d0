"""Priority, preemption and fair share in front of a real llama-server, side by side in one run.

1. Interactive TTFT p50/p95 alone, then under a batch flood (3x the slots, long outputs), one
   interactive request about every second: straight to llama-server (its FIFO); through passerelle
   without preemption (batch may hold 3 of 4 slots, the default then); through passerelle with
   preemption at its defaults (batch may hold every slot; an interactive request that waited
   50 ms suspends a batch stream, which resumes later as a continuation).
2. Two backlogged batch tenants of equal weight, one with 4x the concurrency of the other:
   each one's share of generated tokens through passerelle (and straight, for reference), counted
   over the steady part of the phase (not the start, when whoever came first holds every slot).
3. Tokens/s under the flood (all of them, and the batch tenant's alone) against direct FIFO;
   with preemption, suspensions per minute and the prompt tokens llama-server computed again per
   resume (the rest of a continuation's prompt comes from the slot's cache).
4. Where the work went, from llama-server's own counters (``/metrics``) over the same window:
   decode steps a second and the slots busy in each (their product is the tokens generated a
   second), prompt tokens computed and taken from its cache. A gateway that leaves a slot idle
   lowers the second; more launches (cuts and their resumes) slow the steps, a step in which a
   slot computes a prompt being longer than a decode step.

Every prompt is fresh, so that no run profits from llama-server's prompt cache. A reference phase
sends only slots - 1 batch streams straight to llama-server: the interactive request always finds
a free slot, so its TTFT there is the runtime's own slowdown under the remaining batch work, which
no gateway in front of it can remove. ``--also-batch-share S`` adds a gateway without preemption
whose batch class may hold that share of the slots. ``--also-src DIR`` adds the preemption arm
again through passerelle from another source tree (a before/after in one run); ``--rounds N``
repeats the flood arms N times, in turn (a round reversed every other time), and pools them.
``--also-reserve`` adds a second llama-server with one slot more, flooded straight (its own FIFO)
and through passerelle with batch held to the usual number of slots: the spare slot is kept for
better classes, so nothing is cut, at the cost of one more sequence decoding beside the others.
``--interactive-context N`` gives each interactive request a chat history of about N tokens (a
chat UI's request carries its conversation), fresh each time. ``--count-from S`` counts tokens
from S seconds into each phase: direct FIFO serves an interactive request only after the flood's
queue ahead of it (15-18 s here), so a window that opens past that compares every arm paying the
interactive prompts at their arrival rate. ``--batch-tokens LO:HI`` draws each batch stream's
length (default: all 64): streams of one length that start together end together, and straight to
llama-server their successors compute their prompts in one step, a lock-step a real queue's
answers of varied length do not keep.

Where preemption's time goes, per interactive request (from the gateways' access logs): the
wait in passerelle's queue (arrival to the request sent upstream: the preemption decision and
the cut) and the time in the runtime (sent to first token), against the reference's TTFT; from
llama-server's log, the time from a cut stream's cancel to the next request it starts.

    .venv/bin/python bench/scheduling.py [--slots 4] [--phase-s 40] [--only alone,flood,fair]
                                         [--also-batch-share 1.0] [--also-src DIR] [--rounds 1] [--toml ...]
                                         [--also-reserve] [--interactive-context N] [--count-from S]
                                         [--batch-tokens LO:HI]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from harness import free_port, pct, source_env, wait_http

from passerelle.chunks import CHAT  # a content event: a token, not the empty delta some chunks carry
from passerelle.runtimes import embedded

MODEL = "gemma-3-270m"
WORDS = ["harbour", "lighthouse", "keeper", "ledger", "season", "storm", "beacon", "pier", "tide", "lantern",
         "rope", "anchor", "gull", "channel", "reef", "signal", "fog", "bell", "cargo", "ferry"]


class Load:
    def __init__(self, base: str, session: aiohttp.ClientSession) -> None:
        self.base = base
        self.session = session
        self.token_times: dict[str, list[float]] = {}  # arrival of each content event, per tenant
        self.ttfts: list[float] = []
        self.errors = 0
        self.t0 = 0.0
        # llama-server's counters at the start and the end of the counted window (``window``)
        self.counters: list[dict[str, float]] = []

    async def window(self, llama: str, skip_s: float, seconds: float) -> None:
        """Read ``llama``'s counters when the counted window opens and when it closes."""
        for at in (skip_s, seconds):
            await asyncio.sleep(max(0.0, self.t0 + at - time.perf_counter()))
            self.counters.append(await asyncio.to_thread(llama_counters, llama))

    def steady(self, skip_s: float, seconds: float) -> dict[str, int]:
        """Content events (tokens) streamed per tenant in the steady part of the phase: after
        ``skip_s`` (the start, when whoever came first holds every slot) and before the end (after
        which no request starts and the queued ones drain, a tail whose length depends on the
        queue, not on the rate)."""
        lo, hi = self.t0 + skip_s, self.t0 + seconds
        return {t: sum(1 for x in xs if lo <= x < hi) for t, xs in self.token_times.items()}

    def shares(self, skip_s: float, seconds: float) -> dict[str, float]:
        counts = self.steady(skip_s, seconds)
        total = sum(counts.values()) or 1
        return {t: n / total for t, n in counts.items()}

    def rate(self, skip_s: float, seconds: float, tenant: str | None = None) -> float:
        """Tokens/s in the steady part of the phase: all tenants', or one's."""
        counts = self.steady(skip_s, seconds)
        n = counts.get(tenant, 0) if tenant else sum(counts.values())
        return n / (seconds - skip_s)

    async def one(self, *, tenant: str, cls: str, max_tokens: int, record_ttft: bool = False,
                  context: int = 0) -> None:
        messages = [{"role": "user", "content": f"{tenant} {time.time_ns()}: tell a long story."}]
        if context:  # a chat's history before the question: about that many tokens, fresh each time
            rng = random.Random(time.time_ns())
            messages.insert(0, {"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(context))})
        body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "user": tenant,
                "stream_options": {"include_usage": True}, "messages": messages}
        t0 = time.perf_counter()
        first = None
        times = self.token_times.setdefault(tenant, [])
        try:
            async with self.session.post(self.base + "/v1/chat/completions", json=body,
                                         headers={"X-Priority": cls}) as resp:
                if resp.status != 200:
                    self.errors += 1
                    await resp.read()
                    return
                async for line in resp.content:
                    if CHAT.search(line):
                        now = time.perf_counter()
                        times.append(now)
                        if first is None:
                            first = now - t0
                            if record_ttft:
                                self.ttfts.append(first)
        except aiohttp.ClientError:
            self.errors += 1

    async def closed_loop(self, stop: float, *, tenant: str, cls: str, max_tokens: tuple[int, int]) -> None:
        """One stream after the other until ``stop``, each of ``max_tokens`` (lo, hi: drawn each time)."""
        rng = random.Random(time.time_ns())
        while time.perf_counter() < stop:
            await self.one(tenant=tenant, cls=cls, max_tokens=rng.randint(*max_tokens))

    async def interactive(self, stop: float, every_s: float = 1.0, context: int = 0) -> None:
        tasks = []
        # The first request half an interval in, not in the instant the flood's streams all start:
        # there every slot is taken by a stream still computing its prompt, which cannot be cut
        # before its first token (resume.py), a start-up artefact that made each phase's first
        # interactive TTFT its slowest; what is measured is the flood's steady state (as the
        # tokens are counted after its start).
        try:
            await asyncio.sleep(min(every_s / 2, max(0.0, stop - time.perf_counter())))
            while time.perf_counter() < stop:
                tasks.append(asyncio.create_task(self.one(tenant="chat-user", cls="interactive", max_tokens=16,
                                                          record_ttft=True, context=context)))
                await asyncio.sleep(every_s)
            await asyncio.gather(*tasks)
        finally:  # the phase ended (cancelled): what is still waiting leaves with it, not after it
            for t in tasks:
                t.cancel()


async def phase(base: str, seconds: float, *, flood: int = 0, fair: tuple[int, int] | None = None,
                interactive: bool = True, every_s: float = 1.0, context: int = 0, llama: str = "",
                skip_s: float = 0.0, batch_tokens: tuple[int, int] = (64, 64)) -> tuple[Load, float]:
    connector = aiohttp.TCPConnector(force_close=True, limit=0)  # llama-server drops reused connections
    async with aiohttp.ClientSession(connector=connector) as session:
        load = Load(base, session)
        t0 = load.t0 = time.perf_counter()
        stop = t0 + seconds
        jobs = [load.closed_loop(stop, tenant="bulk", cls="batch", max_tokens=batch_tokens) for _ in range(flood)]
        if fair:
            for tenant, n in (("tenant-a", fair[0]), ("tenant-b", fair[1])):
                jobs += [load.closed_loop(stop, tenant=tenant, cls="batch", max_tokens=batch_tokens) for _ in range(n)]
        if interactive:
            jobs.append(load.interactive(stop, every_s, context))
        if llama:
            jobs.append(load.window(llama, skip_s, seconds))
        # At the end the clients leave (what is still streaming or queued is cut): only the phase's
        # window is measured, and a drain of queued 64-token requests on a slow CPU takes minutes.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*jobs), timeout=seconds + 0.5)
        return load, time.perf_counter() - t0


def settle(llama: str, timeout: float = 30.0) -> None:
    """Until llama-server is idle (the last phase's cut requests have left their slots)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(llama + "/slots", timeout=5) as resp:
            if not any(s.get("is_processing") for s in json.loads(resp.read())):
                return
        time.sleep(0.2)


def llama_counters(url: str) -> dict[str, float]:
    """llama-server's cumulative counters (``--metrics``): decode steps, the busy slots they
    carried in all, prompt tokens computed and taken from the cache."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        values = {}
        for line in r.read().decode().splitlines():
            if line.startswith("llamacpp:"):
                name, _, value = line.partition(" ")
                values[name.removeprefix("llamacpp:")] = float(value)
    return {"steps": values["n_decode_total"], "busy": values["n_busy_slots_per_decode"] * values["n_decode_total"],
            "prompt": values["prompt_tokens_total"],
            "cached": values.get("prompt_tokens_cached_total", 0.0)}


def admin_stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/admin/stats", timeout=5) as resp:
        return json.loads(resp.read())


def interactive_log(log: Path, since: float, until: float) -> list[dict]:
    """The access-log records of the interactive requests a gateway finished in [since, until)
    (wall clock), that got a first token."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if (r.get("priority") == "interactive" and r.get("ttft_ms") is not None and r.get("queue_ms") is not None
                and since <= r.get("ts", 0) < until):
            out.append(r)
    return out


_LLAMA_LINE = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) . (.*)$")
_SLOT_ID = re.compile(r"id +(\d+) \|")


def llama_gaps(log: Path, since: float, until: float) -> tuple[list[float], list[float]]:
    """From llama-server's log (times since it started; ``since``/``until`` on the same clock):
    (1) for every cut stream's cancel, seconds until the runtime launched its next request (the
    one waiting for that slot); (2) for every slot released, seconds until that slot launched its
    next request (the slot idle: none waiting in the runtime). Cancels and releases in a phase's
    last second (its clients leaving) are left out."""
    events: list[tuple[float, str]] = []
    for line in log.read_text(errors="replace").splitlines():
        m = _LLAMA_LINE.match(line)
        if m:
            t = int(m[1]) * 60 + int(m[2]) + int(m[3]) / 1e3 + int(m[4]) / 1e6
            events.append((t, m[5]))
    cancels, idle = [], []
    for i, (t, text) in enumerate(events):
        if not since <= t < until - 1.0:
            continue
        if "cancel task" in text:
            nxt = next((u for u, x in events[i + 1:] if "launch_slot_" in x), None)
            if nxt is not None:
                cancels.append(nxt - t)
        elif "release:" in text and (m := _SLOT_ID.search(text)):
            tag = f"id {int(m[1]):2d} |"
            nxt = next((u for u, x in events[i + 1:] if "launch_slot_" in x and tag in x), None)
            if nxt is not None:
                idle.append(nxt - t)
    return cancels, idle


@dataclass
class Arm:
    """One arm's phases (one per round) and what they measured, pooled."""

    loads: list[Load] = field(default_factory=list)
    log: Path | None = None  # the gateway's access log; None: straight to llama-server
    gateway: str = ""
    windows: list[tuple[float, float, float]] = field(default_factory=list)  # wall start, end; llama clock start
    preempt: dict[str, float] = field(default_factory=dict)
    llama_log: Path | None = None  # its llama-server's log, when not the first one's
    llama_t0: float = 0.0  # (and when that one started)
    llama_url: str = ""  # its llama-server, when not the first one

    @property
    def ttfts(self) -> list[float]:
        return [x for ld in self.loads for x in ld.ttfts]

    @property
    def errors(self) -> int:
        return sum(ld.errors for ld in self.loads)

    def rate(self, skip_s: float, seconds: float, tenant: str | None = None) -> float:
        return sum(ld.rate(skip_s, seconds, tenant) for ld in self.loads) / len(self.loads)

    def shares(self, skip_s: float, seconds: float) -> dict[str, float]:
        counts: dict[str, int] = {}
        for ld in self.loads:
            for t, n in ld.steady(skip_s, seconds).items():
                counts[t] = counts.get(t, 0) + n
        total = sum(counts.values()) or 1
        return {t: n / total for t, n in counts.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=40.0)
    ap.add_argument("--only", default="", help="comma-separated phases to run: alone, flood, fair (default: all)")
    ap.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                    help="one more llama-server argument (repeatable), e.g. --llama-arg=-t --llama-arg=2")
    ap.add_argument("--interactive-every", type=float, default=1.0, metavar="S",
                    help="an interactive request every S seconds (default 1)")
    ap.add_argument("--interactive-context", type=int, default=0, metavar="N",
                    help="an interactive request carries about N tokens of chat history (fresh each time; "
                         "default 0: a one-line question)")
    ap.add_argument("--count-from", type=float, default=None, metavar="S",
                    help="count tokens from S seconds into each phase (default: a quarter of the phase, at most "
                         "10 s). Direct FIFO serves an interactive request only after the flood's queue ahead of "
                         "it (15-18 s with 4 slots and one thread): count from past that, so that every arm pays "
                         "the interactive requests' prompts at the rate they arrive, not FIFO only those that "
                         "came before the window")
    ap.add_argument("--batch-tokens", default="64", metavar="N|LO:HI",
                    help="a batch stream's length in tokens (default 64), or drawn between LO and HI for each "
                         "request: streams of one length that start together end together, and straight to "
                         "llama-server their successors then compute their prompts in one step")
    ap.add_argument("--keep", action="store_true", help="keep the access logs and the work folder (printed)")
    ap.add_argument("--toml", default="", help="extra gateway configuration, e.g. $'[scheduler]\\nhold_s = 0'")
    ap.add_argument("--also-batch-share", type=float, action="append", default=[],
                    help="also run the flood through a gateway whose batch class may hold this share of the "
                         "slots (the default is 0.75): the latency / throughput trade-off, same run")
    ap.add_argument("--also-src", type=Path, metavar="DIR",
                    help="also run the preemption arm through passerelle from this source tree (before/after)")
    ap.add_argument("--rounds", type=int, default=1, help="run the flood arms this many times, in turn, pooled")
    ap.add_argument("--also-reserve", action="store_true",
                    help="also run the flood on a second llama-server with one slot more, batch held to the "
                         "usual number of slots (the spare one kept for better classes), and that server's own "
                         "FIFO for comparison")
    args = ap.parse_args()
    try:
        lo, _, hi = args.batch_tokens.partition(":")
        args.batch_tokens = (int(lo), int(hi or lo))
    except ValueError:
        ap.error("--batch-tokens takes N or LO:HI")
    if not 1 <= args.batch_tokens[0] <= args.batch_tokens[1]:
        ap.error("--batch-tokens needs 1 <= LO <= HI")
    if args.count_from is not None and not 0 <= args.count_from < args.phase_s:
        ap.error("--count-from must be at least 0 and less than --phase-s")
    binary, model = embedded.find_or_build_llama_server(), embedded.ensure_gemma()
    lport = free_port()
    work = Path(tempfile.mkdtemp(prefix="passerelle-sched-"))
    llama_t0 = time.time()  # (llama-server's log counts from its start)
    llama = subprocess.Popen([str(binary), "-m", str(model), "--alias", MODEL, "--port", str(lport),
                              "-np", str(args.slots), "-c", str(args.slots * 2048), "--metrics", "--slots",
                              # --swa-full, as the embedded runtime: a continuation reuses its cache
                              "--no-webui", "--swa-full", *args.llama_arg],
                             stdout=open(work / "llama.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    gateways: list[subprocess.Popen] = []
    spare: subprocess.Popen | None = None
    sport, spare_t0 = free_port(), time.time()
    if args.also_reserve:  # one slot more; the same context per slot
        spare = subprocess.Popen([str(binary), "-m", str(model), "--alias", MODEL, "--port", str(sport),
                                  "-np", str(args.slots + 1), "-c", str((args.slots + 1) * 2048), "--metrics",
                                  "--slots", "--no-webui", "--swa-full", *args.llama_arg],
                                 stdout=open(work / "llama-spare.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115

    def start_gateway(tag: str, extra: str, src: Path | None = None, port_: int = lport) -> str:
        port = free_port()
        cfg = work / f"{tag}.toml"
        # no max_concurrency: llama-server reports its slots (/props total_slots)
        cfg.write_text(args.toml + "\n" + extra + '\n[auth]\nanonymous_max_priority = "interactive"\n'
                       '[server]\naccess_log = true\n'
                       f'[[backends]]\nname = "b"\nkind = "llama-server"\nurl = "http://127.0.0.1:{port_}"\n'
                       f'models = ["{MODEL}"]\n')
        gateways.append(subprocess.Popen(
            [sys.executable, "-m", "passerelle", "serve", "--config", str(cfg), "--port", str(port)],
            stdout=open(work / f"{tag}.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            cwd=src or Path(__file__).resolve().parent.parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PASSERELLE_STATE": str(work / tag),
                 **source_env(src or Path(__file__).resolve().parent.parent)}))
        return f"http://127.0.0.1:{port}"

    no_preempt = "[scheduler]\npreemption = false\n"
    direct = f"http://127.0.0.1:{lport}"
    arms: dict[str, Arm] = {}

    def arm(name: str, tag: str = "", extra: str = "", src: Path | None = None) -> Arm:
        a = arms[name] = Arm(log=work / f"{tag}.log" if tag else None)
        a.gateway = start_gateway(tag, extra, src) if tag else direct
        return a

    flood = 3 * args.slots
    reference = f"flood direct {args.slots - 1}"
    plan: list[tuple[str, dict]] = []  # the phases, in order; a flood arm once per round
    arm("alone direct")
    gateway = arm("alone gateway", "gateway").gateway  # the defaults: preemption on
    arm("flood direct")
    arm(reference)
    arms["flood share 0.75"] = Arm(log=work / "share.log", gateway=start_gateway("share", no_preempt))
    arms["flood preemption"] = Arm(log=work / "gateway.log", gateway=gateway)
    variants = [f"flood share {s:g}" for s in args.also_batch_share]
    for s_ in args.also_batch_share:
        arm(f"flood share {s_:g}", f"share-{s_:g}", no_preempt + f'[[classes]]\nname = "batch"\nrank = 2\n'
                                                            f'max_queue = 4096\nslot_share = {s_}\n')
    if args.also_src:
        arm("flood preemption B", "before", src=args.also_src)
        variants.append("flood preemption B")
    if spare is not None:
        share = args.slots / (args.slots + 1)
        arms["flood spare direct"] = Arm(gateway=f"http://127.0.0.1:{sport}", llama_log=work / "llama-spare.log",
                                         llama_t0=spare_t0, llama_url=f"http://127.0.0.1:{sport}")
        arms["flood spare slot"] = Arm(
            log=work / "spare.log", llama_log=work / "llama-spare.log", llama_t0=spare_t0,
            llama_url=f"http://127.0.0.1:{sport}",
            gateway=start_gateway("spare", f'[[classes]]\nname = "batch"\nrank = 2\nmax_queue = 4096\n'
                                           f'slot_share = {share:.6f}\npreemptible = true\n', port_=sport))
        variants += ["flood spare direct", "flood spare slot"]
    arms["fair direct"] = Arm(gateway=direct)
    arms["fair gateway"] = Arm(log=work / "gateway.log", gateway=gateway)
    floods = ["flood direct", reference, "flood share 0.75", "flood preemption", *variants]
    plan += [("alone direct", {}), ("alone gateway", {})]
    for r in range(args.rounds):
        plan += [(n, {"flood": args.slots - 1 if n == reference else flood}) for n in (floods if r % 2 == 0
                                                                                      else floods[::-1])]
    plan += [("fair direct", {"fair": (8, 2), "interactive": False}),
             ("fair gateway", {"fair": (8, 2), "interactive": False})]
    try:
        wait_http(direct + "/health")
        if spare is not None:
            wait_http(f"http://127.0.0.1:{sport}/health")
        for a in {a.gateway for a in arms.values()} - {direct, f"http://127.0.0.1:{sport}"}:
            wait_http(a + "/ready")
        asyncio.run(phase(direct, 5, interactive=True))  # warm-up
        only = set(args.only.split(",")) if args.only else {"alone", "flood", "fair"}
        for name, kw in plan:
            if name.split()[0] not in only:
                continue
            a = arms[name]
            print(f"running: {name} ({args.phase_s:g} s)", file=sys.stderr, flush=True)
            settle(direct)
            if spare is not None:
                settle(f"http://127.0.0.1:{sport}")
            before = admin_stats(a.gateway)["preemption"] if a.log is not None else None
            w0 = time.time()
            load, _ = asyncio.run(phase(a.gateway, args.phase_s, every_s=args.interactive_every,
                                        context=args.interactive_context, llama=a.llama_url or direct,
                                        skip_s=window_start(args.phase_s, args.count_from),
                                        batch_tokens=args.batch_tokens, **kw))
            a.loads.append(load)
            a.windows.append((w0, time.time(), w0 - (a.llama_t0 or llama_t0)))
            if before is not None:
                after = admin_stats(a.gateway)["preemption"]
                for k in after:
                    if isinstance(after[k], int | float) and not isinstance(after[k], bool):
                        a.preempt[k] = a.preempt.get(k, 0) + after[k] - before[k]
        holds = admin_stats(gateway).get("slot_holds")
    finally:
        for gw in gateways:
            gw.send_signal(signal.SIGTERM)
        for gw in gateways:
            gw.wait(60)
        for proc in (llama, spare):
            if proc is not None:
                proc.terminate()
                proc.wait(30)
    report(args, arms, floods, reference, holds, work)
    return 0


def window_start(phase_s: float, count_from: float | None = None) -> float:
    """Seconds into a phase from which its tokens (and llama-server's work) are counted: a
    quarter of the phase, at most 10 s, unless ``--count-from`` says."""
    return min(10.0, phase_s / 4) if count_from is None else count_from


def report(args: argparse.Namespace, arms: dict[str, Arm], floods: list[str], reference: str, holds: object,
           work: Path) -> None:
    def ran(name: str) -> bool:
        return name in arms and bool(arms[name].loads)

    def p95(name: str) -> float:
        xs = arms[name].ttfts
        return pct(xs, 95) * 1000 if xs else math.nan

    skip = window_start(args.phase_s, args.count_from)
    flood = 3 * args.slots
    rounds = f", {args.rounds} rounds pooled" if args.rounds > 1 else ""
    print(f"\nGemma 3 270M on llama-server, {args.slots} slots; batch flood = {flood} closed-loop streams of "
          f"{'-'.join(map(str, sorted(set(args.batch_tokens))))} tokens; interactive = a request every "
          f"{args.interactive_every:g} s, 16 tokens"
          f"{f' after ~{args.interactive_context} tokens of history' if args.interactive_context else ''};"
          f" {args.phase_s:g} s per "
          f"phase{rounds}; fresh prompts.\n")
    print("1. Interactive TTFT (ms)")
    print(f"   {'':20}{'n':>4}{'p50':>9}{'p95':>9}{'p95/alone':>11}{'p95/ref':>9}")
    for name in ("alone direct", "alone gateway", *floods):
        if ran(name):
            xs = arms[name].ttfts or [math.nan]  # (none in the phase: a runtime far too slow)
            alone = "alone direct" if "direct" in name or "alone" in name else "alone gateway"
            rel = f"{p95(name) / p95(alone):10.2f}x" if ran(alone) and "alone" not in name else " " * 11
            ref = f"{p95(name) / p95(reference):8.2f}x" if ran(reference) and name.startswith("flood") else ""
            print(f"   {name:20}{len(xs):>4}{pct(xs, 50) * 1000:9.0f}{pct(xs, 95) * 1000:9.0f}{rel}{ref}")
    if ran(reference):
        print(f"   {reference}: only {args.slots - 1} batch streams straight to llama-server, so one slot is "
              f"always free for the\n   interactive request: the runtime's own slowdown, the least a gateway can "
              f"give (goal with preemption: p95 <= 1.2x this)")
        gated = [n for n in floods if ran(n) and arms[n].log is not None and arms[n].log.exists()]
        if gated:
            print("\n   Where the time goes (ms; p50 / p95): in passerelle's queue (arrival to sent upstream), in the "
                  "runtime\n   (sent to first token, against the reference's TTFT), and in llama-server from a cut "
                  "stream's cancel\n   to the next request it started")
            ref_x = [x * 1000 for x in arms[reference].ttfts]
            print(f"   {reference:20} {'':>13}  runtime {pct(ref_x, 50):5.0f} / {pct(ref_x, 95):5.0f}")
            for n in gated:
                a = arms[n]
                assert a.log is not None
                recs = [r for w0, w1, _ in a.windows for r in interactive_log(a.log, w0, w1 + 1.0)]
                q = [r["queue_ms"] for r in recs]
                rt = [r["ttft_ms"] - r["queue_ms"] for r in recs]
                gaps = [llama_gaps(a.llama_log or work / "llama.log", l0, l0 + args.phase_s) for _, _, l0 in a.windows]
                c2l = [x * 1000 for c, _ in gaps for x in c]
                cut = f"  cancel->launch {pct(c2l, 50):4.0f} / {pct(c2l, 95):4.0f} ({len(c2l)})" if c2l else ""
                print(f"   {n:20} queue {pct(q, 50):4.0f} / {pct(q, 95):4.0f}  runtime {pct(rt, 50):5.0f} / "
                      f"{pct(rt, 95):5.0f}{cut}")
        print("\n   A slot idle between two requests (ms, llama-server's log: released to its next launch; "
              "p50 / mean)")
        for n in floods:
            if ran(n):
                idle = [x * 1000 for _, _, l0 in arms[n].windows
                        for x in llama_gaps(arms[n].llama_log or work / "llama.log", l0, l0 + args.phase_s)[1]]
                if idle:
                    print(f"   {n:20} {pct(idle, 50):6.1f} / {sum(idle) / len(idle):6.1f}  ({len(idle)} releases)")
    if ran("fair direct"):
        print("\n2. Share of generated tokens, tenant-a (8 streams) vs tenant-b (2 streams), equal weight")
        print(f"   (tokens streamed between {skip:g} s and {args.phase_s:g} s into the phase)")
        for name in ("fair direct", "fair gateway"):
            shares = arms[name].shares(skip, args.phase_s)
            print(f"   {name:16} a {shares.get('tenant-a', 0):6.1%}   b {shares.get('tenant-b', 0):6.1%}"
                  f"   (goal through passerelle: 50% +/- 10%)")
        print(f"   freed slots held for a returning tenant: {holds}")
    if ran("flood direct"):
        print(f"\n3. Tokens/s under the flood (streamed between {skip:g} s and {args.phase_s:g} s), vs direct FIFO")
        print(f"   {'':20}{'all':>8}{'ratio':>8}{'batch':>8}{'ratio':>8}{'interactive':>13}")
        base_all = arms["flood direct"].rate(skip, args.phase_s)
        base_batch = arms["flood direct"].rate(skip, args.phase_s, "bulk")
        for n in floods:
            if ran(n) and n != reference:
                a_, b_ = arms[n].rate(skip, args.phase_s), arms[n].rate(skip, args.phase_s, "bulk")
                i_ = arms[n].rate(skip, args.phase_s, "chat-user")
                print(f"   {n:20}{a_:8.1f}{a_ / base_all:8.3f}{b_:8.1f}{b_ / base_batch:8.3f}{i_:13.2f}")
        print("   (goal with preemption: work served, all tokens, >= 0.97 of direct FIFO)")
        default = window_start(args.phase_s)
        if skip != default:  # the same tokens counted over the default window, for contrast
            base = arms["flood direct"].rate(default, args.phase_s)
            print(f"   counted from {default:g} s instead: " + ", ".join(
                f"{n} {arms[n].rate(default, args.phase_s) / base:.3f}" for n in floods
                if ran(n) and n not in (reference, "flood direct")))
        if ran("flood spare slot") and ran("flood spare direct"):
            own = arms["flood spare direct"].rate(skip, args.phase_s)
            mine = arms["flood spare slot"].rate(skip, args.phase_s)
            print(f"   flood spare slot against its own server's FIFO ({args.slots + 1} slots): {mine / own:.3f}"
                  f" (and against {args.slots} slots' FIFO above)")
        for n in ("flood preemption", "flood preemption B"):
            if ran(n):
                p = arms[n].preempt
                resumes = max(p.get("resumed_streams", 0), 1)
                minutes = args.phase_s * len(arms[n].loads) / 60
                print(f"   {n}: {p.get('suspended', 0):g} suspensions ({p.get('suspended', 0) / minutes:.1f}"
                      f" a minute), {p.get('resumed', 0):g} resumes; prompt tokens computed again per resumed "
                      f"stream {p.get('resume_prompt_tokens_processed', 0) / resumes:.1f} (from cache: "
                      f"{p.get('resume_prompt_tokens_cached', 0) / resumes:.1f})")
    flooded = [n for n in floods if ran(n) and all(len(ld.counters) == 2 for ld in arms[n].loads)]
    if flooded:
        # (llama-server counts a request's generated tokens only when it ends unless cancelled: a cut
        # stream's are not, so they are not compared here; the relayed tokens are in 3.)
        print("\n4. In llama-server over the same window (its /metrics): decode steps a second, slots busy per "
              "step,\n   prompt tokens computed a second, and taken from its cache")
        print(f"   {'':20}{'steps/s':>9}{'busy':>7}{'prompt/s':>10}{'cached/s':>10}")
        for n in flooded:
            d = {k: sum(ld.counters[1][k] - ld.counters[0][k] for ld in arms[n].loads) for k in ("steps", "busy",
                                                                                                 "prompt", "cached")}
            secs = (args.phase_s - skip) * len(arms[n].loads)
            print(f"   {n:20}{d['steps'] / secs:9.2f}{d['busy'] / max(d['steps'], 1):7.2f}{d['prompt'] / secs:10.1f}"
                  f"{d['cached'] / secs:10.1f}")
    errors = {n: a.errors for n, a in arms.items() if a.errors}
    print(f"\nerrors: {errors or 'none'}")
    if args.keep:
        print(f"logs (access logs, llama-server's): {work}")


if __name__ == "__main__":
    raise SystemExit(main())
