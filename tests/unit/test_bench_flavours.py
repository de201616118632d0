"""``passerelle bench flavours`` end to end on stand-in flavours (fake runtimes started as a build
would be), and the energy meter on stand-in power files."""

from __future__ import annotations

import json
import sys

from passerelle.bench import flavours, flavours_report
from passerelle.bench.cli import build_levels
from passerelle.bench.energy import EnergyMeter
from passerelle.cli import build_parser


def _fake(name: str, *extra: str) -> flavours.Flavour:
    cmd = (sys.executable, "-m", "passerelle.testing.fake_runtime", "--port", "{port}", "--ttft-ms", "5",
           "--itl-ms", "1", "--slots", "2", *extra)
    return flavours.Flavour(name, cmd, info={"flavour": name, "kind": "cpu", "flags": f"-DSTAND_IN={name}",
                                             "llama_server_version": [f"version: 0 ({name})"]})


def test_two_flavours_at_two_depths_one_that_dies_and_the_report(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF not really")
    out = tmp_path / "out"
    args = build_parser().parse_args(["bench", "flavours", "--out", str(out), "--concurrency", "1,2", "--requests",
                                      "4", "--max-tokens", "4", "--context-depth", "64,16", "--no-calibrate",
                                      "--ready-timeout", "60", "--timeout", "30", "--no-progress"])
    args = flavours.replace_args(args, slots=2, ctx_per_slot=512)
    dead = flavours.Flavour("broken", ("/bin/sh", "-c", "echo cannot open device >&2; exit 3"),
                            info={"flavour": "broken", "kind": "vulkan"})
    flaky = _fake("beta", "--fail-rate", "0.5", "--seed", "1")
    doc = flavours.run(args, [_fake("alpha"), flaky, dead, _fake("gamma")], model, build_levels, "passerelle bench")

    assert [d["prompt_tokens"] for d in doc["depths"]] == [16, 64]
    assert doc["model_sha256"] == flavours.sha256(model) and len(doc["model_sha256"]) == 64
    for d in doc["depths"]:
        rows = {r["flavour"]: r for r in d["rows"]}
        assert rows["alpha"]["clients"] == 2 and rows["alpha"]["requests"] == 8 and rows["alpha"]["errors"] == 0
        assert rows["alpha"]["ttft_p95_ms"] > 0 and rows["alpha"]["output_tokens_per_s"] > 0
        assert rows["alpha"]["rss_at_rest_bytes"] > 0 and rows["alpha"]["rss_peak_bytes"] > 0
        # its failures are counted, or the depth where even its warm-up failed is named, never hidden
        assert rows["beta"]["errors"] > 0 or "warm-up" in rows["beta"]["not_measured"]
        assert rows["broken"]["output_tokens_per_s"] is None and rows["broken"]["not_measured"]
    broken = doc["flavours"]["broken"]
    assert broken["crashed"] == 3 and "exited with status 3" in broken["not_measured"]
    assert "cannot open device" in (out / "logs" / "broken.log").read_text()
    # the same stand-in answers alike: greedy answers match between those that answered
    assert doc["answers_match"] is True and doc["flavours"]["alpha"]["greedy_answer"]
    beta = doc["flavours"]["beta"]
    assert beta["greedy_answer"] is not None or "500" in beta["greedy_error"]
    env = doc["flavours"]["alpha"]["environment"]
    assert env["cmake_flags"] == "-DSTAND_IN=alpha" and env["runtime_version"] == "version: 0 (alpha)"
    assert env["kernel"] and env["model_sha256"] == doc["model_sha256"] and env["driver"] == "CPU (no GPU driver)"
    assert doc["verdict"].endswith(".") and "broken crashed (exit 3)" in doc["verdict"]
    assert "greedy answers match" in doc["verdict"]

    paths = flavours_report.write(doc, out)
    assert {p.name for p in paths} == {"backends.json", "backends.md", "backends.png"}
    assert (out / "backends.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "backends.md").read_text()
    assert doc["verdict"] in md and "| alpha | 16 | 2 |" in md and "| gamma | 64 | 2 |" in md
    assert "| beta | 64 | - |" in md  # not measured there
    assert "`-DSTAND_IN=beta`" in md
    assert json.loads((out / "backends.json").read_text())["verdict"] == doc["verdict"]
    for depth in (16, 64):  # the bench's own report per depth, both flavours in it
        runs = json.loads((out / f"depth-{depth}" / "results.json").read_text())["runs"]
        assert {"alpha", "gamma"} <= {r["target"] for r in runs}


def test_the_table_says_energy_is_not_available_without_a_source():
    doc = {"energy_sources": [], "depths": [], "flavours": {}}
    assert "energy J/token (not available)" in flavours_report.table(doc)


def test_answers_that_differ_are_said_to_differ():
    two = {"a": {"greedy_answer": "Paris.", "crashed": None, "not_measured": None},
           "b": {"greedy_answer": "Lyon.", "crashed": None, "not_measured": None}}
    assert flavours_report.answers_match(two) is False
    said = flavours_report.sentence({"depths": [], "flavours": two, "answers_match": False})
    assert "differ between flavours (a: 'Paris.', b: 'Lyon.')" in said
    assert flavours_report.answers_match({"a": {"greedy_answer": "Paris."}, "b": {}}) is None


def test_rapl_counters_are_read_across_a_wrap(tmp_path):
    zone = tmp_path / "powercap" / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "energy_uj").write_text("999000000\n")
    (zone / "max_energy_range_uj").write_text("1000000000\n")
    (tmp_path / "powercap" / "intel-rapl:0:0").mkdir()  # a sub-zone, counted within its package
    meter = EnergyMeter(powercap=tmp_path / "powercap", drm=tmp_path / "drm", nvidia=None)
    assert meter.sources == ["RAPL (1 package)"]
    meter.start()
    (zone / "energy_uj").write_text("4000000\n")  # wrapped: 1 J to the top, then 4 J
    assert meter.stop() == 5.0


def test_amdgpu_power_is_integrated_and_no_source_means_none(tmp_path, monkeypatch):
    hwmon = tmp_path / "drm" / "card0" / "device" / "hwmon" / "hwmon3"
    hwmon.mkdir(parents=True)
    (hwmon / "power1_average").write_text("40000000\n")  # 40 W in µW
    meter = EnergyMeter(powercap=tmp_path / "none", drm=tmp_path / "drm", nvidia=None, interval_s=3600)
    assert meter.sources == ["amdgpu power1_average"]
    clock = iter([100.0, 102.0])  # a sample at start, one at stop, 2 s apart
    monkeypatch.setattr("passerelle.bench.energy.time.monotonic", lambda: next(clock))
    meter.start()
    (hwmon / "power1_average").write_text("60000000\n")
    assert meter.stop() == 100.0  # 2 s at (40 W + 60 W) / 2
    assert EnergyMeter(powercap=tmp_path / "none", drm=tmp_path / "none", nvidia=None).stop() is None
    watts = EnergyMeter(powercap=tmp_path / "none", drm=tmp_path / "none", nvidia=lambda: 300.0)
    assert watts.sources == ["nvidia-smi power.draw"]
