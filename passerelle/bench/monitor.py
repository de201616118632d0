"""Watching a target while it is measured: its memory, GPU memory and what the runtime reports.

A background thread samples, every half second, the resident memory of the runtime's process tree
(``bench.memory``); every second (and at each mark) also GPU memory and the runtime's own
``/metrics``: vLLM's KV cache use and prefix-cache counters, llama-server's prompt-cache counters,
or a passerelle gateway's ``passerelle_backend_kv_cache_usage_ratio``. The runner marks the start
and end of each level's measured load (after its warm-up), and each mark takes a full sample
there and then, in the caller's thread (a busy machine may leave the sampling thread waiting for
a CPU longer than a fast level lasts), so a level's window is bracketed exactly::

    mon = Monitor(pid, "http://127.0.0.1:8080", {})
    mon.start()                 # the first sample is the runtime at rest
    mon.mark("start", 0); ...; mon.mark("end", 0)
    mon.stop()
    mon.at_rest(), mon.window(0)

Sampling costs a few file reads (and an ``nvidia-smi`` run each second where there is one).
"""

from __future__ import annotations

import contextlib
import queue
import re
import threading
import time
import urllib.request
from typing import Any

from passerelle import procfs
from passerelle.bench import memory

# name → how to combine samples with several label sets
_GAUGES = {
    "vllm:kv_cache_usage_perc": "max",
    "vllm:gpu_cache_usage_perc": "max",  # before vLLM 0.10
    "llamacpp:kv_cache_usage_ratio": "max",
    "passerelle_backend_kv_cache_usage_ratio": "max",
}
_COUNTERS = {
    "vllm:prefix_cache_queries_total": "sum",
    "vllm:prefix_cache_hits_total": "sum",
    "llamacpp:prompt_tokens_total": "sum",
    "llamacpp:prompt_tokens_cached_total": "sum",
}
_WANTED = {**_GAUGES, **_COUNTERS}
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, float]:
    """The few runtime metrics the bench uses, from Prometheus text (label sets combined)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if not m or m.group(1) not in _WANTED:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        name = m.group(1)
        if name in out:
            out[name] = max(out[name], value) if _WANTED[name] == "max" else out[name] + value
        else:
            out[name] = value
    return out


def vllm_cache_config(text: str) -> dict[str, Any]:
    """vLLM's ``cache_config_info`` labels: KV blocks, block size, and so the KV capacity in tokens."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(_LABEL.findall(line))
            out: dict[str, Any] = {}
            for key in ("num_gpu_blocks", "num_cpu_blocks", "block_size", "gpu_memory_utilization",
                        "cache_dtype", "enable_prefix_caching"):
                if labels.get(key) not in (None, "", "None"):
                    out[key] = labels[key]
            with contextlib.suppress(KeyError, ValueError):
                out["kv_capacity_tokens"] = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            with contextlib.suppress(KeyError, ValueError):  # vLLM 0.11 and later say it outright
                out["kv_capacity_tokens"] = int(float(labels["kv_cache_size_tokens"]))
            with contextlib.suppress(KeyError, ValueError):
                out["kv_cache_bytes"] = int(float(labels["kv_cache_memory_bytes"]))
            return out
    return {}


def _get(url: str, headers: dict[str, str], timeout: float = 2.0) -> str | None:
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body: bytes = resp.read(4 << 20)
            return body.decode("utf-8", "replace")
    except (OSError, ValueError):
        return None


def runtime_report(base_url: str, headers: dict[str, str]) -> dict[str, Any]:
    """What the runtime says about its capacity: llama-server's slots and their context, vLLM's
    KV cache configuration. Endpoints a gateway does not expose are simply absent."""
    import json

    out: dict[str, Any] = {}
    slots = _get(base_url + "/slots", headers)
    if slots:
        try:
            data = json.loads(slots)
            if isinstance(data, list) and data and all(isinstance(s, dict) for s in data):
                out["slots"] = len(data)
                ctx = {s.get("n_ctx") for s in data if isinstance(s.get("n_ctx"), int)}
                if ctx:
                    out["n_ctx_per_slot"] = max(ctx)
        except ValueError:
            pass
    text = _get(base_url + "/metrics", headers)
    if text:
        config = vllm_cache_config(text)
        if config:
            out["vllm_cache"] = config
    return out


class Monitor:
    """Samples a target in a thread; see the module docstring."""

    def __init__(self, pid: int | None, base_url: str | None, headers: dict[str, str], *,
                 period: float = 0.5, slow_period: float = 1.0, gpu: memory.GpuReader | None = None) -> None:
        self.pid = pid
        self.base_url = base_url
        self.headers = headers
        self.period = period
        self.slow_period = slow_period
        self.gpu = gpu
        self.samples: list[dict[str, Any]] = []
        self.marks: dict[tuple[str, int], float] = {}
        self._stop: queue.Queue[None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._metrics_ok = base_url is not None
        self._last_slow = 0.0
        self.pids: list[int] = []

    # --- sampling ----------------------------------------------------------------------------
    def _sample(self, full: bool) -> dict[str, Any]:
        s: dict[str, Any] = {"t": time.perf_counter()}
        if self.pid is not None:
            self.pids = procfs.process_tree(self.pid)
            rss, pss = memory.tree_memory(self.pids)
            s.update(rss=rss, pss=pss, processes=len(self.pids))
        if full or s["t"] - self._last_slow >= self.slow_period:
            self._last_slow = s["t"]
            if self.gpu is not None and self.gpu.source is not None:
                s["gpu"] = self.gpu.sample(self.pids)
            if self._metrics_ok and self.base_url is not None:
                text = _get(self.base_url + "/metrics", self.headers)
                if text is None:
                    self._metrics_ok = False  # no /metrics here (or not for us): stop asking
                else:
                    s["metrics"] = parse_metrics(text)
        return s

    def _add(self, s: dict[str, Any]) -> None:
        with self._lock:
            self.samples.append(s)

    def _run(self) -> None:
        while True:
            try:
                self._stop.get(timeout=self.period)
                return
            except queue.Empty:
                self._add(self._sample(False))

    def start(self) -> None:
        self._add({**self._sample(True), "mark": ("rest", -1)})
        self._thread = threading.Thread(target=self._run, name="passerelle-bench-monitor", daemon=True)
        self._thread.start()

    def mark(self, event: str, index: int) -> None:
        """A full sample now, labelled (``"start"``/``"end"``, level index)."""
        self.marks[(event, index)] = time.perf_counter()
        self._add({**self._sample(True), "mark": (event, index)})

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.put(None)
            self._thread.join(timeout=30)
            self._thread = None
            self._add({**self._sample(True), "mark": ("stop", -1)})

    # --- summaries -----------------------------------------------------------------------------
    def at_rest(self) -> dict[str, Any]:
        rest = next((s for s in self.samples if s.get("mark") == ("rest", -1)), None)
        return _point(rest) if rest else {}

    def window(self, index: int) -> dict[str, Any]:
        """Peaks over a level's measured load, and the runtime's prefix-cache counters' change."""
        with self._lock:
            samples = sorted(self.samples, key=lambda s: s["t"])
        first = next((s for s in samples if s.get("mark") == ("start", index)), None)
        last = next((s for s in samples if s.get("mark") == ("end", index)), None)
        if first is None or last is None:
            return {}
        inside = [s for s in samples if first["t"] <= s["t"] <= last["t"]]
        out: dict[str, Any] = {"samples": len(inside)}
        for key in ("rss", "pss"):
            values = [s[key] for s in inside if s.get(key) is not None]
            out[f"{key}_peak_bytes"] = max(values) if values else None
        gpus = [s["gpu"] for s in inside if s.get("gpu")]
        for key in ("device_used_bytes", "process_bytes", "gtt_used_bytes"):
            values = [g[key] for g in gpus if g.get(key) is not None]
            if values:
                out[f"gpu_{key.removesuffix('_bytes')}_peak_bytes"] = max(values)
        metrics = [s["metrics"] for s in inside if "metrics" in s]
        kv = [v for m in metrics for k, v in m.items() if k in _GAUGES]
        if kv:
            peak = max(kv)
            out["kv_cache_usage_peak"] = round(peak / 100 if peak > 1.0 else peak, 4)
        cache = _counter_delta(first.get("metrics"), last.get("metrics"))
        if cache:
            out["runtime_prefix_cache"] = cache
        return {k: v for k, v in out.items() if v is not None}


def _point(s: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if s.get("rss") is not None:
        out["rss_bytes"] = s["rss"]
    if s.get("pss") is not None:
        out["pss_bytes"] = s["pss"]
    if s.get("processes"):
        out["processes"] = s["processes"]
    for key, value in (s.get("gpu") or {}).items():
        if value is not None:
            out[f"gpu_{key}"] = value
    return out


def _counter_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """Prompt tokens the runtime served from its cache between two samples, by its own counters."""
    if not before or not after:
        return {}
    if "vllm:prefix_cache_queries_total" in after and "vllm:prefix_cache_queries_total" in before:
        queries = after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
        hits = after.get("vllm:prefix_cache_hits_total", 0) - before.get("vllm:prefix_cache_hits_total", 0)
        if queries > 0:
            return {"source": "vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total",
                    "cached_tokens": int(hits), "prompt_tokens": int(queries), "hit_fraction": round(hits / queries, 4)}
    if "llamacpp:prompt_tokens_cached_total" in after and "llamacpp:prompt_tokens_cached_total" in before:
        cached = after["llamacpp:prompt_tokens_cached_total"] - before["llamacpp:prompt_tokens_cached_total"]
        evaluated = after.get("llamacpp:prompt_tokens_total", 0) - before.get("llamacpp:prompt_tokens_total", 0)
        if cached + evaluated > 0:
            return {"source": "llamacpp:prompt_tokens_cached_total / (… + llamacpp:prompt_tokens_total)",
                    "cached_tokens": int(cached), "prompt_tokens": int(cached + evaluated),
                    "hit_fraction": round(cached / (cached + evaluated), 4)}
    return {}
