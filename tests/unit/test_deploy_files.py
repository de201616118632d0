"""deploy/ and docs/metrics.md against the code: promtool checks and rule unit tests, and every
metric name used in the rules and the Grafana dashboard exists and is documented.

promtool comes with Debian's ``prometheus`` package (installed by .ci/run); without it these fail.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from passerelle.observe.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana" / "passerelle.json"
DOC = ROOT / "docs" / "metrics.md"


def promtool(*args: str) -> str:
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: install Debian's 'prometheus' package (.ci/run does)"
    proc = subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"promtool {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def family_names() -> set[str]:
    """Metric names as exposed, e.g. passerelle_requests_total (counters get _total)."""
    names = set()
    for family in Metrics().registry.collect():
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def series_names() -> set[str]:
    """Every sample name a query may use: families plus _bucket/_sum/_count of histograms."""
    names = set()
    for family in Metrics().registry.collect():
        if family.type == "histogram":
            names |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def rules() -> list[dict[str, str]]:
    """The rules of rules.yml as {"record" or "alert": name, "expr": text} (a reader for the
    file's own layout: ``expr:`` inline or as a ``>-`` block; no YAML library needed)."""
    out: list[dict[str, str]] = []
    lines = (PROM / "rules.yml").read_text().splitlines()
    for i, line in enumerate(lines):
        if m := re.match(r"\s*- (record|alert): (\S+)", line):
            out.append({m.group(1): m.group(2)})
        elif (m := re.match(r"(\s*)expr: (.*)", line)) and out:
            indent, value = len(m.group(1)), m.group(2).strip()
            if value in (">-", ">", "|", "|-"):
                block = []
                for nxt in lines[i + 1:]:
                    if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                        break
                    block.append(nxt.strip())
                value = " ".join(block)
            out[-1]["expr"] = value
    assert out and all("expr" in r for r in out)
    return out


def recorded_names() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


PROMQL_WORDS = {"sum", "by", "rate", "histogram_quantile", "le", "count", "max", "min", "or", "and", "on",
                "group_left", "label_values", "vector", "delta", "min_over_time"}


def names_in(expr: str) -> set[str]:
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r'"[^"]*"', "", expr)
    return {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr)
            if w not in PROMQL_WORDS and not w.startswith("$") and ("passerelle" in w or w == "up")}


def test_promtool_checks_the_rules_and_the_example_configuration():
    assert "SUCCESS" in promtool("check", "rules", str(PROM / "rules.yml"))
    assert "SUCCESS" in promtool("check", "config", str(PROM / "prometheus.yml"))


def test_promtool_rule_unit_tests_pass():
    assert "SUCCESS" in promtool("test", "rules", str(PROM / "rules_test.yml"))


def test_rules_use_only_metrics_that_exist():
    known = series_names() | recorded_names() | {"up"}
    used = set().union(*(names_in(r["expr"]) for r in rules()))
    assert used - known == set()
    assert {"passerelle_time_to_first_token_seconds_bucket", "passerelle_queue_wait_seconds_bucket",
            "passerelle_backend_up", "passerelle_requests_total", "passerelle_requests_waiting"} <= used
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert {"PasserelleTTFTAboveTarget", "PasserelleQueueGrowing", "PasserelleBackendDown",
            "PasserelleErrorRateHigh"} <= alerts


def test_grafana_dashboard_queries_known_metrics_and_every_panel_says_what_it_shows():
    dash = json.loads(GRAFANA.read_text())
    known = series_names() | recorded_names()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 15
    used: set[str] = set()
    for p in panels:
        assert p["title"] and p.get("description"), p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            used |= names_in(t["expr"])
    assert used - known == set()
    # the dashboard shows every metric passerelle exports, straight or through a recording rule
    shown = set(used)
    for r in rules():
        if r.get("record") in used:
            shown |= names_in(r["expr"])
    for family in family_names():
        base = family.removesuffix("_total")
        assert any(n.startswith(base) for n in shown), f"{family} is on no panel"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "model", "priority"}


def test_every_metric_is_documented_with_unit_and_vllm_counterpart():
    doc = DOC.read_text()
    for name in family_names():
        rows = [line for line in doc.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1, f"{name} has no row of its own in docs/metrics.md"
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        assert len(cells) >= 6 and all(cells), f"{name}: an empty cell in {rows[0]}"
        assert "vllm:" in cells[-1] or "none" in cells[-1], f"{name}: no vLLM counterpart"
    for label in ("backend", "model", "priority", "tenant", "cause"):
        assert f"| `{label}` |" in doc
    assert "dashboard.png" in doc and (ROOT / "docs" / "dashboard.png").is_file()


@pytest.mark.parametrize("tenant_label", [True, False])
def test_tenant_label_is_optional(tenant_label):
    m = Metrics(tenant_label=tenant_label)
    m.is_known_tenant = {"t1"}.__contains__  # a key's tenant (the app asks its key ring)
    for family in (m.ttft, m.itl, m.tpot, m.e2e, m.queue_wait, m.prompt_tokens, m.generation_tokens, m.requests):
        assert ("tenant" in family._labelnames) is tenant_label
    m.count_request("m", "standard", "ok", "t1")
    children = m.request_children("b", "m", "standard", "t1")
    children[0].observe(0.1)
    text = b"".join(__import__("prometheus_client").generate_latest(m.registry).splitlines(keepends=True))
    assert (b'tenant="t1"' in text) is tenant_label
