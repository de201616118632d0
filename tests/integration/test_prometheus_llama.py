"""A real Prometheus (Debian's ``prometheus``, installed by .ci/run) scrapes a gateway that
serves real traffic from the real llama-server, with deploy/prometheus/rules.yml loaded."""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_ID, free_port, upstream_config, wait_until

pytestmark = pytest.mark.llama

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "rules.yml"


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: install Debian's 'prometheus' package (.ci/run does)"
    started: list[subprocess.Popen] = []

    def start(target: str) -> str:
        port = free_port()
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(f"""
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: passerelle
    static_configs:
      - targets: ["{target}"]
""")
        log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        started.append(proc)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            return httpx.get(url + "/-/ready", timeout=1).status_code == 200

        wait_until(ready, 30, what="prometheus /-/ready")
        return url

    yield start
    for proc in started:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=5)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def value(prom: str, expr: str) -> float | None:
    result = query(prom, expr)
    return float(result[0]["value"][1]) if result else None


def test_prometheus_scrapes_ttft_histogram_and_slot_gauges_from_real_traffic(gateway, llama_server, prometheus):
    gw = gateway(upstream_config(llama_server.url))
    prom = prometheus(gw.url.removeprefix("http://"))
    stop = threading.Event()
    done: list[int] = []

    def traffic() -> None:  # two streams at a time until told to stop (at most 80 requests)
        def one(i: int) -> None:
            with httpx.Client(timeout=60) as c:
                body = {"model": MODEL_ID, "stream": True, "max_tokens": 6, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"Describe harbour number {i}."}]}
                with c.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_lines():
                        pass
                    done.append(r.status_code)

        i = 0
        while not stop.is_set() and i < 80:
            pair = [threading.Thread(target=one, args=(i + k,)) for k in range(2)]
            for t in pair:
                t.start()
            for t in pair:
                t.join()
            i += 2

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        ttft = f'passerelle_time_to_first_token_seconds_count{{job="passerelle",model="{MODEL_ID}",backend="b1"}}'
        wait_until(lambda: (value(prom, f"sum({ttft})") or 0) >= 2, 45, interval=0.5,
                   what="TTFT histogram samples in Prometheus")
        wait_until(lambda: value(prom, 'passerelle_backend_slots_total{backend="b1"}') == 4, 20, interval=0.5,
                   what="slots_total = 4 in Prometheus")
        # a slot seen busy: llama-server's own /slots, re-read by passerelle, scraped by Prometheus
        wait_until(lambda: (value(prom, 'max_over_time(passerelle_backend_slots_busy{backend="b1"}[1m])') or 0) >= 1,
                   30, interval=0.5, what="a busy slot in Prometheus")
        # the recording rule of rules.yml, evaluated by Prometheus on these samples
        # (NaN until two scrapes apart show new requests: rate() is 0 before)
        rule = f'model_priority:passerelle_time_to_first_token_seconds:p95_5m{{model="{MODEL_ID}",priority="standard"}}'
        p95 = wait_until(lambda: (v := value(prom, rule)) is not None and v == v and v,
                         30, interval=0.5, what="a value of the TTFT p95 recording rule")
        assert 0.001 < p95 < 60
    finally:
        stop.set()
        worker.join(120)
    assert done and all(s == 200 for s in done)
    assert value(prom, 'passerelle_backend_up{backend="b1"}') == 1
    assert value(prom, f'sum(passerelle_generation_tokens_total{{model="{MODEL_ID}"}})') > 0
    # once traffic stopped, Prometheus has exactly what the gateway counted
    wait_until(lambda: value(prom, f"sum({ttft})") == len(done), 10, interval=0.5,
               what="Prometheus's TTFT count to equal the requests served")
    up = query(prom, 'up{job="passerelle"}')
    assert up and up[0]["value"][1] == "1"
