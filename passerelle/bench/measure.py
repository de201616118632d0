"""Measuring one target: prepare it, watch its memory, run the sweep (or search for its limit).

``bench`` and ``bench compare`` call :func:`measure_target` once per target, in turn::

    outcome = measure_target(plan, 0, spec, progress)
    outcome.runs        # results.json run records, with their memory and cache sections
    outcome.described   # the target's entry of results.json["targets"]

For each target: discover its model and calibrate prompt lengths (``runner.prepare``), find its
runtime's process (``--runtime-pid``, ``pid=`` in ``--target``, or the listener of its port when
it runs here) and start the monitor (the first sample is the runtime at rest), then run the levels
— the given sweep, or with ``find_max`` the doubling-then-bisecting search of ``search`` — while
the monitor brackets each level's measured load.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from passerelle import procfs
from passerelle.bench import cache, memory, processes, runner, stats
from passerelle.bench.monitor import Monitor, runtime_report
from passerelle.bench.runner import LEVEL_STRIDE, Level, LevelResult, RunOptions
from passerelle.bench.search import find_max
from passerelle.bench.target import Target, TargetSpec
from passerelle.bench.workload import DEFAULT_MIN_REQUESTS, TARGET_STRIDE, TrafficClass, Workload


@dataclass(frozen=True)
class Plan:
    """What every target of a run gets: the workload, the levels (or the search) and the SLOs."""

    workload: Workload
    levels: tuple[Level, ...]
    options: RunOptions
    slos: tuple[stats.Slo, ...] = ()
    model: str | None = None
    api_key: str | None = None
    calibrate: bool = True
    memory: bool = True
    runtime_pid: int | None = None  # plain bench: the runtime's process
    find_max: bool = False
    find_max_limit: float = 256
    requests: int | None = None  # per level (None: the default sizing)
    duration: float | None = None
    poisson: bool = False
    gpu: Any = field(default=None, hash=False, compare=False)  # a shared memory.GpuReader


@dataclass
class Outcome:
    described: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)
    results: list[LevelResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failed: bool = False


def make_level(workload: Workload, concurrency: int | None, rate: float | None, *, requests: int | None = None,
               duration: float | None = None, poisson: bool = False) -> Level:
    """One level of a sweep, sized by ``requests``/``duration`` or by default: max(16, 4 ×
    concurrency) requests closed-loop, 10 s worth of an open-loop rate."""
    if duration:
        n = None
    elif requests:
        n = requests
    elif rate is not None:
        n = max(DEFAULT_MIN_REQUESTS, round(10 * rate))
    else:
        n = max(DEFAULT_MIN_REQUESTS, 4 * (concurrency or 1))
    cls = TrafficClass(None, workload, concurrency=concurrency, rate=rate, poisson=poisson, requests=n)
    return Level((cls,), duration=duration, concurrency=concurrency, rate=rate)


def _retune(level: Level, tuned: Workload, nonce: str) -> Level:
    """Give every class the target's measured tokens-per-word (and the target's nonce)."""
    classes = tuple(replace(c, workload=replace(c.workload, tokens_per_word=tuned.tokens_per_word,
                                                prompt_overhead=tuned.prompt_overhead, nonce=nonce))
                    for c in level.classes)
    return replace(level, classes=classes)


def _locate(plan: Plan, spec: TargetSpec) -> tuple[int | None, str]:
    """The runtime's process and how it was found (or why not)."""
    if spec.pid is not None:
        return spec.pid, "given (pid=)"
    if plan.runtime_pid is not None:
        return plan.runtime_pid, "given (--runtime-pid)"
    parts = urlsplit(spec.url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    pid = memory.listening_pid(parts.hostname or "", port)
    if pid is not None:
        return pid, f"listening on port {port}"
    if not memory.is_local_host(parts.hostname or ""):
        return None, "the target runs on another machine (give pid= to measure a local one)"
    return None, f"no process found listening on port {port} (not ours to see? give pid=)"


def _memory_section(monitor: Monitor | None, pid: int | None, how: str, report: dict[str, Any],
                    gpu: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"found": how}
    if monitor is not None and pid is not None:
        tree = procfs.process_tree(pid)
        out["process"] = memory.describe_process(pid)
        out["children"] = [memory.describe_process(p) for p in tree[1:]][:20]
        out["at_rest"] = monitor.at_rest()
    if gpu is not None and gpu.source is not None:
        out["gpu"] = {"source": gpu.source, "devices": gpu.devices()}
    if report:
        out["runtime"] = report
    return out


@dataclass
class Prepared:
    """A target discovered, calibrated and watched, ready for its levels."""

    spec: TargetSpec
    target: Target
    tuned: Workload
    nonce: str
    options: RunOptions
    monitor: Monitor | None
    pid: int | None
    how: str
    report: dict[str, Any]
    notes: list[str]

    @property
    def mark(self) -> Callable[[str, int], None]:
        return self.monitor.mark if self.monitor is not None else (lambda event, index: None)


def prepare_target(plan: Plan, t_no: int, spec: TargetSpec, progress: Any, nonce: str = "") -> Prepared | Outcome:
    """Discover and calibrate, find the runtime's process and start watching it; an ``Outcome``
    (failed) when the target cannot be prepared."""
    target = Target(spec.name, spec.url, model=spec.model or plan.model)
    try:
        target = replace(target, api_key=spec.api_key(plan.api_key))
        target, tuned, note = runner.prepare(target, plan.workload, calibrate_prompts=plan.calibrate)
    except (ValueError, runner.BenchError, RuntimeError, OSError) as exc:
        progress.note(f"passerelle bench: {spec.name}: {exc}")
        return Outcome(target.describe(), notes=[f"{spec.name}: not measured — {exc}"], failed=True)
    pid, how = _locate(plan, spec) if plan.memory else (None, "not measured (--no-memory)")
    monitor = Monitor(pid, target.base_url, target.headers(), gpu=plan.gpu) if plan.memory else None
    prep = Prepared(spec, target, tuned, f"{nonce}-{t_no}" if nonce else "",
                    replace(plan.options, index_base=t_no * TARGET_STRIDE), monitor, pid, how,
                    runtime_report(target.base_url, target.headers()), [f"{spec.name}: {note}."])
    if monitor is not None:
        monitor.start()  # its first sample: the runtime at rest
    return prep


def finish_target(plan: Plan, prep: Prepared, results: list[LevelResult],
                  windows: list[dict[str, Any]]) -> Outcome:
    """The target's records (with the monitor's view of each level) and its description."""
    if prep.monitor is not None:
        prep.monitor.stop()
    described = {**prep.target.describe(),
                 "prompt_calibration": {"tokens_per_word": prep.tuned.tokens_per_word,
                                        "overhead_tokens": prep.tuned.prompt_overhead},
                 "memory": _memory_section(prep.monitor, prep.pid, prep.how, prep.report, plan.gpu)}
    outcome = Outcome(described, results=results, notes=prep.notes)
    for res, window in zip(results, windows, strict=True):
        for record in stats.level_records(prep.spec.name, res, list(plan.slos)):
            _attach(record, window, res.level)
            outcome.runs.append(record)
    if plan.find_max:
        from passerelle.bench.verdict import load_key

        outcome.runs.sort(key=lambda r: (r["class"] not in (None, "all"), load_key(r)))
    return outcome


def _failed(prep: Prepared, exc: BaseException, progress: Any) -> Outcome:
    if prep.monitor is not None:
        prep.monitor.stop()
    progress.note(f"passerelle bench: {prep.spec.name}: {exc}")
    return Outcome(prep.target.describe(), notes=[*prep.notes, f"{prep.spec.name}: not measured — {exc}"],
                   failed=True)


def measure_target(plan: Plan, t_no: int, spec: TargetSpec, progress: Any, nonce: str = "") -> Outcome:
    """Prepare, watch and measure one target, all its levels in a row (or its ``--find-max`` search)."""
    prep = prepare_target(plan, t_no, spec, progress, nonce)
    if isinstance(prep, Outcome):
        return prep
    try:
        if plan.find_max:
            results = _search(plan, prep, progress)
        else:
            levels = [_retune(level, prep.tuned, prep.nonce) for level in plan.levels]
            results = processes.run_levels(prep.target, levels, prep.options, progress, prep.mark)
    except (runner.BenchError, RuntimeError, OSError) as exc:
        return _failed(prep, exc, progress)
    if prep.monitor is not None:
        prep.monitor.stop()  # its last samples in, before reading its windows
    windows = [prep.monitor.window(i) if prep.monitor is not None else {} for i in range(len(results))]
    return finish_target(plan, prep, results, windows)


# Rounds of an interleaved compare: prompt indexes of round r start r × ROUND_STRIDE into a level's
# block (below the warm-up's offset, so they never meet); monitor marks are level × MAX_ROUNDS + r.
ROUND_STRIDE = 100_000
MAX_ROUNDS = 8


def split_level(level: Level, rounds: int) -> list[Level]:
    """A level cut into ``rounds`` parts: requests (or the duration) shared out, load unchanged."""
    if rounds <= 1:
        return [level]
    parts = []
    for r in range(rounds):
        classes = tuple(replace(c, requests=c.requests // rounds + (1 if r < c.requests % rounds else 0))
                        if c.requests is not None else c for c in level.classes)
        parts.append(replace(level, classes=classes,
                             duration=level.duration / rounds if level.duration is not None else None))
    return parts


def measure_interleaved(plan: Plan, specs: list[TargetSpec], progress: Any, nonce: str,
                        rounds: int) -> list[Outcome]:
    """Every level in ``rounds`` rounds, the targets taking turns (A B, then B A, ...), so a machine
    whose other load comes and goes weighs on each target alike; each target's rounds are pooled."""
    prepared: list[Prepared | Outcome] = [prepare_target(plan, t, spec, progress, nonce)
                                          for t, spec in enumerate(specs)]
    parts: dict[int, list[list[LevelResult]]] = {t: [[] for _ in plan.levels] for t, p in enumerate(prepared)
                                                 if isinstance(p, Prepared)}
    failed: dict[int, Outcome] = {}
    for i, level in enumerate(plan.levels):
        for r, part in enumerate(split_level(level, rounds)):
            order = [t for t in parts if t not in failed]
            for t in order if r % 2 == 0 else order[::-1]:
                prep = prepared[t]
                assert isinstance(prep, Prepared)
                opts = replace(prep.options, index_base=prep.options.index_base + i * LEVEL_STRIDE + r * ROUND_STRIDE,
                               part=f" (round {r + 1} of {rounds}; the report pools the rounds)")
                index = i * MAX_ROUNDS + r
                try:
                    mark = functools.partial(_mark_round, prep.mark, index)
                    (res,) = processes.run_levels(prep.target, [_retune(part, prep.tuned, prep.nonce)], opts, progress,
                                                  mark)
                except (runner.BenchError, RuntimeError, OSError) as exc:
                    failed[t] = _failed(prep, exc, progress)
                    continue
                parts[t][i].append(res)
    out: list[Outcome] = []
    for t, prep in enumerate(prepared):
        if not isinstance(prep, Prepared):
            out.append(prep)
        elif t in failed:
            out.append(failed[t])
        else:
            results = [LevelResult.pooled(level, parts[t][i]) for i, level in enumerate(plan.levels)]
            if prep.monitor is not None:
                prep.monitor.stop()
            windows = [_merge_windows([prep.monitor.window(i * MAX_ROUNDS + r) for r in range(rounds)])
                       if prep.monitor is not None else {} for i in range(len(plan.levels))]
            out.append(finish_target(plan, prep, results, windows))
    return out


def _merge_windows(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """The monitor's view of a level measured in rounds: the highest peaks, the cache counters summed."""
    out: dict[str, Any] = {}
    for w in windows:
        for key, value in w.items():
            if key == "runtime_prefix_cache":
                acc = out.setdefault(key, {"source": value["source"], "cached_tokens": 0, "prompt_tokens": 0})
                acc["cached_tokens"] += value["cached_tokens"]
                acc["prompt_tokens"] += value["prompt_tokens"]
                acc["hit_fraction"] = round(acc["cached_tokens"] / max(acc["prompt_tokens"], 1), 4)
            elif key == "samples":
                out[key] = out.get(key, 0) + value
            elif value is not None:
                out[key] = max(out.get(key, value), value)
    return out


def _attach(record: dict[str, Any], window: dict[str, Any], level: Level) -> None:
    """The monitor's view of the level: memory peaks, the runtime's own cache counters."""
    runtime_cache = window.get("runtime_prefix_cache")
    record["memory"] = {k: v for k, v in window.items() if k != "runtime_prefix_cache"} or None
    record["cache"]["turns"] = max(c.workload.turns for c in level.classes)
    if runtime_cache:
        record["cache"]["runtime"] = runtime_cache
    record["cache_warning"] = cache.warning(record["cache"])


def _search(plan: Plan, prep: Prepared, progress: Any) -> list[LevelResult]:
    """``--find-max``: levels measured one at a time, the next load chosen from the last verdict."""
    target, tuned, nonce, options, mark = prep.target, prep.tuned, prep.nonce, prep.options, prep.mark
    first = plan.levels[0]
    by_rate = first.rate is not None
    cap = first.concurrency if by_rate else None
    results: list[LevelResult] = []

    def measure(load: float) -> bool:
        step = len(results)
        conc = cap if by_rate else int(load)
        level = _retune(make_level(plan.workload, conc, load if by_rate else None, requests=plan.requests,
                                   duration=plan.duration, poisson=plan.poisson), tuned, nonce)
        opts = replace(options, index_base=options.index_base + step * LEVEL_STRIDE)
        res = processes.run_levels(target, [level], opts, progress, lambda event, _i: mark(event, step))[0]
        results.append(res)
        whole = stats.level_records(target.name, res, list(plan.slos))[-1]
        return bool(whole["meets_slo"])

    start = first.rate if by_rate else (first.concurrency or 1)
    find_max(measure, start=start or 1, limit=plan.find_max_limit, integer=not by_rate)
    return results


def collect(name: str, res: LevelResult, samples: dict[tuple[str, str], dict[str, list[float]]],
            rows: list[dict[str, Any]]) -> None:
    """Per-request figures of a level: latency samples for the plots, rows for requests.csv."""
    level = res.level
    by_class = len(level.classes) > 1 or level.classes[0].name is not None
    t0 = res.started
    for r in res.results:
        label = (r.cls or "all") if by_class else level.label
        s = samples.setdefault((name, label), {"ttft": [], "e2e": []})
        if r.ok:
            if r.ttft is not None:
                s["ttft"].append(r.ttft * 1000)
            if r.e2e is not None:
                s["e2e"].append(r.e2e * 1000)
        tpot = r.tpot
        rows.append({"target": name, "class": r.cls, "concurrency": level.concurrency, "rate": level.rate,
                     "ok": r.ok, "error": r.error, "t_send_s": round(r.t_send - t0, 6),
                     "ttft_ms": round(r.ttft * 1000, 3) if r.ttft is not None else None,
                     "tpot_ms": round(tpot * 1000, 3) if tpot is not None else None,
                     "e2e_ms": round(r.e2e * 1000, 3) if r.e2e is not None else None,
                     "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens,
                     "cached_tokens": r.cached_tokens, "chunks": r.chunks})


def _mark_round(mark: Callable[[str, int], None], index: int, event: str, _level: int) -> None:
    """A round runs one level: its marks go to the round's own index."""
    mark(event, index)
