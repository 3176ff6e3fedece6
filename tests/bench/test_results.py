"""benchmarks/run.py: one command runs benchmarks into JSON, another renders RESULTS.md from that JSON."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run.py"


def results_module():
    spec = importlib.util.spec_from_file_location("bench_results", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_results"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def results(*args: str) -> str:
    p = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def test_quick_run_then_render_gives_the_tables_with_their_run_facts(tmp_path: Path) -> None:
    out = results("run", "--quick", "--only", "engine,ycsb", "--systems", "inprocess", "--results-dir", str(tmp_path))
    assert "estimate:" in out
    for area, name in (("engine", "engine"), ("workloads", "ycsb")):
        doc = json.loads((tmp_path / area / f"{name}.json").read_text())
        assert re.fullmatch(r"[0-9a-f]{40}", doc["commit"])
        assert doc["quick"] is True and doc["date"].endswith("UTC")
        assert isinstance(doc["load_before"], float) and isinstance(doc["load_after"], float)
        assert doc["machine"]["cores"] >= 1 and doc["machine"]["ram_gb"] > 0
        assert len(doc["loadavg_before"]) == 3 and len(doc["loadavg_after"]) == 3
    assert json.loads((tmp_path / "engine" / "engine.json").read_text())["data"]["us_per_tx_tuned"] > 0
    points = json.loads((tmp_path / "workloads" / "ycsb.json").read_text())["data"]["inprocess"]["points"]
    assert points and all("load_before" in p and "load_after" in p for p in points)

    md = tmp_path / "RESULTS.md"
    results("render", "--results-dir", str(tmp_path), "--md", str(md))
    text = md.read_text()
    assert "benchmarks/run.py run" in text and "quiet" in text  # the preface
    for title in ("## The in-process engine alone (one core)", "## YCSB-T (transfers, uniform)"):
        section = text.split(title, 1)[1].split("\n## ", 1)[0]
        head = section.strip().splitlines()[0]
        assert re.search(r"commit `[0-9a-f]{10}`", head), head
        assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", head), head
        assert re.search(r"load average [\d.]+ → [\d.]+", head), head
        assert "quick run" in head
        assert "\n| " in section  # the table itself
    assert "| charon-inprocess | 200 |" in text
    assert "| tuned as a started runtime tunes it |" in text
    assert "## Reference: the Styx paper (SIGMOD 2025), other hardware" in text  # the template's static part
    assert "Not in this file (no JSON yet):" in text and "tpcc" in text


def test_plug_ins_render_when_their_json_exists_and_are_skipped_otherwise(tmp_path: Path) -> None:
    mod = results_module()
    assert {"e2e", "spark_scaling", "gateway_cpu"} <= set(mod.REGISTRY)
    assert not any(mod.REGISTRY[n].default for n in ("e2e", "spark_scaling", "gateway_cpu"))
    doc = {"commit": "a" * 40, "date": "2026-11-27 12:00 UTC", "load_before": 0.4, "load_after": 0.6,
           "rows": [{"rate": 500, "latency_ms": {"p50": 2.0, "p99": 4.4}, "server": "charon"}]}
    entry = mod.RenderCtx(md=tmp_path / "R.md", out=tmp_path)
    body = mod.generic_render(doc, entry)
    assert "| rate | latency_ms.p50 | latency_ms.p99 | server |" in body and "| 500 | 2.00 | 4.40 | charon |" in body
    assert mod.generic_render({"markdown": "text"}, entry) == "text\n"
    head = mod.header(doc)
    assert "commit `aaaaaaaaaa`" in head and "load average 0.4 → 0.6" in head and "2026-11-27 12:00 UTC" in head

    # no JSON at all (the plug-ins' JSON, committed in the repository, looked for elsewhere): the file says so,
    # and keeps its static text
    mod.ROOT = tmp_path / "no-repository"
    md = tmp_path / "empty.md"
    assert mod.main(["render", "--results-dir", str(tmp_path / "none"), "--md", str(md)]) == 0
    text = md.read_text()
    assert "No table measured yet" in text and "Styx paper" in text


def test_the_registry_names_every_suite_table_and_a_full_run_fits_the_budget() -> None:
    mod = results_module()
    assert {"engine", "ycsb", "zipf", "tpcc", "deathstar", "movie", "spark_max"} <= set(mod.REGISTRY)
    o = mod.Opts(quick=False, duration=5.0, warmup=1.0, systems=["inprocess", "postgres", "spark"],
                 spark_rates="2000,8000,12000,16000,20000,30000", out=Path("."), logs=Path("."))
    total = sum(e.estimate(o) or 0 for e in mod.REGISTRY.values() if e.default)
    assert total <= 13 * 60, total  # the estimate printed before a full run (the aim: ~12 minutes on 2 cores)


def test_plots_of_points_where_nothing_finished(tmp_path: Path) -> None:
    """A point with no reply in time (a quick Spark run) has NaN latencies: its plots are drawn, not an error."""
    import math

    from charon.bench import report

    pts = [{"experiment": "ycsb", "system": "charon-spark", "input_rate": 200.0, "committed_per_s": 0.0,
            "abort_rate": math.nan, "latency_ms": {"p50": math.nan, "p99": math.nan},
            "warmup_s": 0.5, "timeline": [{"t": 0, "committed": 0, "p50_ms": None}]}]
    assert report.plot_latency_throughput(pts, "ycsb", tmp_path / "a.png") is not None
    assert report.plot_timeline(pts, "ycsb", tmp_path / "b.png") is not None
    assert report.plot_zipf([{**pts[0], "experiment": "zipf", "zipf": 0.9}], tmp_path / "c.png") is not None
    done = {**pts[0], "committed_per_s": 200.0, "latency_ms": {"p50": 1.5, "p99": 4.0},
            "timeline": [{"t": 0, "committed": 200, "p50_ms": 1.5}]}
    assert report.plot_latency_throughput([done], "ycsb", tmp_path / "d.png") is not None  # log scale there
    assert report.plot_timeline([done], "ycsb", tmp_path / "e.png") is not None
