"""The benchmark runner: one run of a chosen set into one results folder, then RESULTS.md and its plots from it.

    .venv/bin/python benchmarks/run.py                      # the quiet full run (prints an estimate first)
    .venv/bin/python benchmarks/run.py --quick              # a smoke: tiny durations, one low rate each
    .venv/bin/python benchmarks/run.py --only ycsb,engine   # some tables (`run.py list` names them)
    .venv/bin/python benchmarks/run.py --quick --results-dir /tmp/r   # elsewhere (RESULTS.md written there)
    .venv/bin/python benchmarks/run.py render               # benchmarks/RESULTS.md from benchmarks/results/
    .venv/bin/python benchmarks/run.py list                 # the registry, with time estimates

(``run.py OPTIONS`` is ``run.py run OPTIONS``.) A run writes each benchmark's JSON under
``RESULTS/AREA/NAME.json`` (``RESULTS`` = ``--results-dir``, default ``benchmarks/results``), the run's manifest
``RESULTS/run.json`` (commit, date, the command, and per benchmark its JSON, elapsed time and the 1/5/15-minute
load averages before and after), each benchmark's output in ``RESULTS/logs/``, and then renders RESULTS.md and
its plots from that folder alone (``--no-render``: not). Run it on a quiet machine (no test suites, helpers or
other benchmarks at the same time): every table is headed with the commit, date and 1-minute load average
(before -> after) of its own run, and the render says so when tables come from different commits.

The registry (:data:`REGISTRY`) maps a name to (how to run it, its JSON path, how to render it):

- ``engine``: the in-process engine alone (``engine_perf.py``'s engine child: batches of 1,000 YCSB-T
  transfers through ``run_epoch``, one core, CPU µs per transaction, best of 3 runs).
- ``ycsb``, ``zipf``, ``tpcc``, ``deathstar``, ``movie``: the suite (:mod:`charon.bench.suite`, i.e.
  ``benchmarks/workloads/suite.py``), one process per experiment and system (``inprocess``; ``postgres``, which
  runs both SERIALIZABLE with retries and READ COMMITTED with ``FOR UPDATE`` in key order on one cluster;
  ``spark``, ``local[2]``), each with rates suited to that system; the load average is recorded around
  every point.
- ``spark_max``: YCSB-T on Spark ``local[2]`` fed straight into the log by the lean generator
  (``spark_ycsb.py --generator lean``), rising rates until p99 exceeds 2 s.
- ``e2e``, ``spark_scaling``, ``gateway_cpu``, ``promise_latency``, ``schedule_jitter``, ``admission_cost``:
  plug-ins for other scripts. Not run by default (name them in
  ``--only``); rendered whenever their JSON exists, skipped otherwise. Their JSON is read as is: a dict
  with ``markdown`` (a ready section body) or ``rows`` (a list of dicts; nested dicts such as
  ``latency_ms`` become ``latency_ms.p50`` columns; ``columns`` picks and orders them), plus optionally
  ``commit``, ``date``, ``load_before``, ``load_after``, ``machine`` and ``command`` (``run`` adds those
  it lacks after running the script).

Each table's JSON (``benchmarks/results/AREA/NAME.json``): ``{"name", "title", "command", "commit", "dirty",
"date", "load_before", "load_after", "loadavg_before", "loadavg_after", "machine": {"cores", "ram_gb", "cpu",
"python"}, "elapsed_s", "quick", "data"}``. The static parts of RESULTS.md (the preface, the Styx paper's
figures) are in ``benchmarks/results/template.md``. One-off experiments that no longer describe the code are in
``benchmarks/HISTORY.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS_DIR = HERE / "results"
TEMPLATE = RESULTS_DIR / "template.md"
RESULTS_MD = HERE / "RESULTS.md"
TABLES_MARK = "<!-- tables -->"


# --------------------------------------------------------------------------------------------- run facts


def git(*args: str) -> str:
    p = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return p.stdout.strip() if p.returncode == 0 else ""


def machine() -> dict:
    import psutil

    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cores": cores, "ram_gb": round(psutil.virtual_memory().total / 2**30, 1), "cpu": cpu or platform.machine(),
            "python": platform.python_version(), "host": platform.node()}


def load() -> float:
    return round(os.getloadavg()[0], 2)


def loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def env() -> dict:
    """The environment a benchmark's process runs in (PySpark's workers use this interpreter)."""
    return {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}


def sh(cmd: list[str], log: Path) -> None:
    """Run one benchmark command from the repository root, its output into ``log``; fail loudly."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        p = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env(), check=False)
    if p.returncode != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{shlex.join(cmd)} failed ({p.returncode}); see {log}:\n{tail}")


def shown(cmd: list[str]) -> str:
    """A command as the report quotes it: relative to the repository root, ``python`` for the interpreter."""
    out = [".venv/bin/python" if c == sys.executable else c for c in cmd]
    return shlex.join([os.path.relpath(c, ROOT) if c.startswith(str(ROOT)) else c for c in out])


@dataclass
class Opts:
    quick: bool
    duration: float
    warmup: float
    systems: list[str]
    spark_rates: str
    out: Path  # the results directory
    logs: Path


# ------------------------------------------------------------------------------------------- the suite

#: per experiment and system: the suite's arguments (rates; the Zipf coefficients) for a full run
SUITE_PLAN: dict[str, dict[str, list[str]]] = {
    "ycsb": {"inprocess": ["--ycsb-rates", "1000,5000,10000,20000"],
             "postgres": ["--ycsb-rates", "500,1000,2000"],
             "spark": ["--ycsb-rates", "1000,2000"]},  # spark_max has the higher rates
    "zipf": {"inprocess": ["--zipf", "0.0,0.9,0.99,0.999", "--zipf-rate", "500"],
             "postgres": ["--zipf", "0.0,0.9,0.999", "--zipf-rate", "500"],
             "spark": ["--zipf", "0.99", "--zipf-rate", "250"]},
    "tpcc": {"inprocess": ["--tpcc-rates", "50,200,400"],
             "postgres": ["--tpcc-rates", "25,50,100"],
             "spark": ["--tpcc-rates", "100,300,600"]},
    "deathstar": {"inprocess": ["--deathstar-rates", "250,500,1000,2000"],
                  "postgres": ["--deathstar-rates", "500,1000,2000"],
                  "spark": ["--deathstar-rates", "100,200,400"]},
    "movie": {"inprocess": ["--movie-rates", "100,250,500"],
              "spark": ["--movie-rates", "50,100"]},  # the SQL baseline has the travel mix only
}
#: the quick mode's arguments: one low rate (one coefficient), whatever the system
SUITE_QUICK = {"ycsb": ["--ycsb-rates", "200"], "zipf": ["--zipf", "0.99", "--zipf-rate", "200"],
               "tpcc": ["--tpcc-rates", "20"], "deathstar": ["--deathstar-rates", "100"],
               "movie": ["--movie-rates", "50"]}
SUITE_SYSTEMS = {"inprocess": "inprocess", "postgres": "postgres,postgres-rc", "spark": "spark"}
#: seconds to start a system's process (PostgreSQL: its cluster too) and each target in it (loading the data;
#: Spark: a driver and its JVM), and to drain a point (Spark's replies lag by about an epoch or two)
PROCESS_S = {"inprocess": 2.0, "postgres": 5.0, "spark": 2.0}
TARGET_S = {"inprocess": 0.5, "postgres": 1.5, "spark": 30.0}
DRAIN_S = {"inprocess": 0.5, "postgres": 0.5, "spark": 2.0}
#: the highest p99 a rate may have and still count as sustained
SUSTAIN_P99_MS = {"inprocess": 100.0, "postgres": 100.0, "spark": 2000.0}


def _points(args: list[str], key: str) -> int:
    return len(args[args.index(key) + 1].split(",")) if key in args else 1


def warmup(system: str, o: Opts) -> float:
    """Discarded seconds per point: Spark's first epochs after a start take seconds (its Python workers start,
    the JVM compiles), so at least 3 s there outside the quick mode."""
    return o.warmup if o.quick or system != "spark" else max(o.warmup, 3.0)


def suite_args(exp: str, system: str, o: Opts) -> list[str]:
    return SUITE_QUICK[exp] if o.quick else SUITE_PLAN[exp][system]


def suite_estimate(exp: str, o: Opts) -> float:
    total = 0.0
    for system in o.systems:
        if system not in SUITE_PLAN[exp]:
            continue
        a = suite_args(exp, system, o)
        n = _points(a, {"ycsb": "--ycsb-rates", "zipf": "--zipf", "tpcc": "--tpcc-rates",
                        "deathstar": "--deathstar-rates", "movie": "--movie-rates"}[exp])
        targets = n if exp == "zipf" else 1  # the Zipf sweep starts a target per coefficient
        copies = 2 if system == "postgres" else 1  # both isolation modes
        total += PROCESS_S[system] + copies * (targets * TARGET_S[system]
                                               + n * (o.duration + warmup(system, o) + DRAIN_S[system]))
    return total


def suite_run(exp: str) -> Callable[[Opts], dict]:
    def run(o: Opts) -> dict:
        data: dict[str, Any] = {}
        for system in o.systems:
            if system not in SUITE_PLAN[exp]:
                continue
            tmp = Path(tempfile.mkdtemp(prefix=f"charon-results-{exp}-"))
            try:
                cmd = [sys.executable, str(HERE / "workloads" / "suite.py"), "--only", exp,
                       "--systems", SUITE_SYSTEMS[system],
                       "--duration", f"{o.duration:g}", "--warmup", f"{warmup(system, o):g}",
                       "--drain", "20" if system == "spark" else ("3" if o.quick else "10"),
                       *suite_args(exp, system, o)]
                lb, t0 = load(), time.time()
                print(f"[results] {exp} on {system}: {shown(cmd)}", flush=True)
                sh([*cmd, "--out", str(tmp)], o.logs / f"{exp}-{system}.log")
                points = []
                for f in sorted(tmp.glob(f"{exp}-*.json")):
                    pts = json.loads(f.read_text())
                    points += pts if isinstance(pts, list) else [pts]
                for p in points:
                    p.pop("timeline", None)  # per-second series: not shown, and most of the file
                data[system] = {"command": shown(cmd), "load_before": lb, "load_after": load(),
                                "elapsed_s": round(time.time() - t0, 1), "points": points}
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return data
    return run


def _f(v: Any, nd: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def sustained(p: dict, p99_ms: float) -> bool:
    """Served at its rate: everything finished in time (committed or aborted), p99 under ``p99_ms``."""
    done = p.get("committed_per_s", 0) + p.get("aborted_per_s", 0)
    p99 = p.get("latency_ms", {}).get("p99")
    return (p.get("unfinished", 1) == 0 and done >= 0.98 * p["input_rate"] and p99 is not None
            and not math.isnan(p99) and p99 < p99_ms)


def suite_table(points: list[dict], zipf: bool) -> str:
    head = (["zipf"] if zipf else []) + ["system", "input/s", "committed/s", "abort %", "p50 ms", "p90 ms",
                                          "p99 ms", "max ms", "unfinished", "epochs (n, mean size, p50 ms)",
                                          "fallback %", "pg retries", "load avg"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in points:
        lat, ep = r["latency_ms"], r.get("epochs")
        eps = f"{ep['count']}, {_f(ep['size_mean'])}, {_f(ep['duration_ms_p50'])}" if ep else "–"
        fb = _f(100 * ep["fallback_share"]) if ep and "fallback_share" in ep else "–"
        ab = r.get("abort_rate")
        lines.append("| " + " | ".join(([_f(r.get("zipf"), 3)] if zipf else []) + [
            r.get("system", "?"), _f(r["input_rate"], 0), _f(r["committed_per_s"]),
            _f(100 * ab if isinstance(ab, (int, float)) else None), _f(lat["p50"]), _f(lat["p90"]), _f(lat["p99"]),
            _f(lat["max"]), _f(r["unfinished"]), eps, fb, _f(r.get("retries")) if "retries" in r else "–",
            f"{_f(r.get('load_before'))} → {_f(r.get('load_after'))}" if "load_before" in r else "–"]) + " |")
    return "\n".join(lines)


def suite_render(exp: str) -> Callable[[dict, RenderCtx], str]:
    def render(doc: dict, c: RenderCtx) -> str:
        from charon.bench import report

        parts, points = [], []
        for run in doc["data"].values():
            pts = sorted(run["points"], key=lambda p: (p.get("system", ""), p.get("zipf", 0), p["input_rate"]))
            points += pts
            parts.append(f"- `{run['command']}` — load average {_f(run['load_before'])} → {_f(run['load_after'])}, "
                         f"{run['elapsed_s']:.0f} s")
            if not run["points"]:
                parts.append("  — **no points**: it failed (its log is under the results folder's logs/)")
        parts += ["", suite_table(points, zipf=exp == "zipf"), ""]
        if exp != "zipf":
            best = []
            for label in sorted({p.get("system", "?") for p in points}):
                kind = "spark" if "spark" in label else ("postgres" if "postgres" in label else "inprocess")
                ok = [p for p in points if p.get("system") == label and sustained(p, SUSTAIN_P99_MS[kind])]
                top = max(ok, key=lambda p: p["input_rate"]) if ok else None
                best.append(f"{label} {_f(top['input_rate'], 0)}/s" if top else f"{label} none of its rates")
            parts += ["Highest rate served with p99 under 100 ms (Spark: 2 s) among the rates tried: "
                      + "; ".join(best) + ".", ""]
        bad = [(p.get("system"), v) for p in points for v in p.get("checks", [])]
        if any("checks" in p for p in points):
            parts += ["Consistency checks after the runs: " + ("**all passed**." if not bad else
                                                                f"**{len(bad)} violations**."), ""]
            parts += [f"- {s}: {v}" for s, v in bad[:20]]
        png = c.png(exp, "workloads")
        fig = report.plot_zipf(points, png) if exp == "zipf" else report.plot_latency_throughput(points, exp, png)
        if fig is not None:
            parts += [f"![{exp}]({c.rel(fig)})", ""]
        return "\n".join(parts)
    return render


# ------------------------------------------------------------------------------------- engine alone


def engine_run(o: Opts) -> dict:
    sys.path.insert(0, str(HERE / "engine"))
    import engine_perf

    epochs, repeat = (5, 1) if o.quick else (23, 3)
    runs = [engine_perf.run_child("engine", src=None, epochs=epochs) for _ in range(repeat)]
    tuned = min(r["tuned_gc"]["us_per_tx_median"] for r in runs)
    default = min(r["default_gc"]["us_per_tx_median"] for r in runs)
    bare = min(r["bare_loop_us"] for r in runs)
    return {"epochs": epochs, "repeat": repeat, "runs": runs, "us_per_tx_tuned": tuned,
            "us_per_tx_default": default, "tx_per_s": 1e6 / tuned, "bare_loop_us": bare,
            "share_of_bare_loop": bare / tuned}


def engine_render(doc: dict, c: RenderCtx) -> str:
    d = doc["data"]
    return "\n".join([
        f"Batches of 1,000 YCSB-T transfers (10,000 accounts, 4 partitions) through `run_epoch`, one core, "
        f"{d['epochs'] - 3} measured epochs after 3 warm-up ones, the median of chunks of 5 epochs, best of "
        f"{d['repeat']} fresh processes; CPU time (`time.process_time`).", "",
        "| collector | CPU µs / transaction | transactions / s on one core |", "|---|---|---|",
        f"| tuned as a started runtime tunes it | {d['us_per_tx_tuned']:.1f} | {d['tx_per_s']:,.0f} |",
        f"| Python's default | {d['us_per_tx_default']:.1f} | {1e6 / d['us_per_tx_default']:,.0f} |",
        f"| bare arithmetic epoch loop (same batches, Aria's commit rule, no functions or messages) | "
        f"{d['bare_loop_us']:.2f} | {1e6 / d['bare_loop_us']:,.0f} |", "",
        f"The engine runs at {d['share_of_bare_loop']:.3f} of the bare loop's speed (a machine-speed reference, "
        "not a reachable ceiling).", ""])


# ------------------------------------------------------------------------------------- Spark highest rate


def spark_max_run(o: Opts) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="charon-results-spark-"))
    try:
        rates = "500" if o.quick else o.spark_rates
        from charon.config import SparkConfig

        cmd = [sys.executable, str(HERE / "spark" / "spark_ycsb.py"), "--rates", rates, "--duration", f"{o.duration:g}",
               "--warmup", f"{warmup('spark', o):g}", "--variants", "after",
               "--stop-p99-ms", "2000", "--generator", "lean", "--max-batch", str(SparkConfig.max_batch)]
        print(f"[results] spark_max: {shown(cmd)}", flush=True)
        sh([*cmd, "--out", str(tmp), "--label", "results"], o.logs / "spark_max.log")
        pts = json.loads((tmp / "spark_ycsb_zipf0.0_results.json").read_text())
        for p in pts:
            p.pop("timeline", None)
        return {"command": shown(cmd), "points": pts}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def spark_max_render(doc: dict, c: RenderCtx) -> str:
    pts = doc["data"]["points"]
    ok = [p for p in pts if sustained(p, 2000.0)]
    top = max(ok, key=lambda p: p["input_rate"]) if ok else None
    lines = ["The Spark runtime (`local[2]`, the product's epoch cap) in this process; the lean load generator in "
             "another appends to the input log in group commits and reads replies from the output log; rates rise "
             "until p99 exceeds 2 s. Spark CPU = the driver, its JVM and the Python workers, not the generator.", "",
             "| rate | committed/s | p50 / p99 ms | unfinished | epoch ms | jobs / epoch | tasks / epoch | "
             "Spark CPU µs/request | generator CPU µs/request | load avg after |", "|" + "---|" * 10]
    for p in pts:
        b, lat = p.get("breakdown", {}), p["latency_ms"]
        lines.append(f"| {_f(p['input_rate'], 0)} | {_f(p['committed_per_s'], 0)} | {_f(lat['p50'], 0)} / "
                     f"{_f(lat['p99'], 0)} | {_f(p['unfinished'])} | {_f(b.get('epoch_ms'), 0)} | "
                     f"{_f(b.get('spark_jobs_per_epoch'))} | {_f(b.get('spark_tasks_per_epoch'))} | "
                     f"{_f(p.get('spark_cpu_us_per_request'), 0)} | "
                     f"{_f(p.get('cpu_us_per_request', {}).get('generator'), 0)} | {_f(p.get('load_average'))} |")
    lines += ["", "Highest rate with p99 < 2 s: " + (f"**{top['input_rate']:,.0f} TPS** (p50 "
                                                    f"{top['latency_ms']['p50']:,.0f} / p99 "
                                                    f"{top['latency_ms']['p99']:,.0f} ms)." if top else
                                                    "none of the rates tried."), ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- plug-ins


def _flat(row: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif not isinstance(v, list):
            out[f"{prefix}{k}"] = v
    return out


def generic_render(doc: dict, c: RenderCtx) -> str:
    """A plug-in's JSON as a table: its ``markdown``, else its ``rows`` (or ``points``) with ``columns``."""
    d = doc.get("data", doc) if isinstance(doc, dict) else {"rows": doc}
    if isinstance(d, list):
        d = {"rows": d}
    if isinstance(d.get("markdown"), str):
        return d["markdown"].rstrip() + "\n"
    rows = [_flat(r) for r in (d.get("rows") or d.get("points") or []) if isinstance(r, dict)]
    if not rows:
        return "(no rows in its JSON)\n"
    cols = d.get("columns") or list(dict.fromkeys(k for r in rows for k in r))[:14]
    nd = {k: 2 if any(isinstance(r.get(k), float) and abs(r[k]) < 10 for r in rows) else 1 for k in cols}
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_f(r.get(k), nd[k]) for k in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def e2e_render(doc: dict, c: RenderCtx) -> str:
    """The end-to-end benchmark's own tables (benchmarks/e2e/report.py) and its plot."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("e2e_report", HERE / "e2e" / "report.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    d = doc.get("data", doc)
    out = mod.render_markdown(d)
    png = c.out / "e2e" / "e2e.png"
    if png.exists():
        out += f"\n![latency against rate, CPU per request]({c.rel(png)})\n"
    return out


def plugin_run(script: str, args: Callable[[Opts, Path], list[str]]) -> Callable[[Opts], dict]:
    """Run another script (it writes the JSON itself, at ``args(opts, json_path)``'s ``--out``); ``run`` then
    adds the run facts its JSON lacks."""
    def run(o: Opts) -> dict:
        path = HERE / script
        if not path.exists():
            raise FileNotFoundError(f"benchmarks/{script} does not exist in this checkout")
        entry = next(e for e in REGISTRY.values() if e.script == script)
        out = entry.path(o.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(path), *args(o, out)]
        print(f"[results] {shown(cmd)}", flush=True)
        sh(cmd, o.logs / f"{path.stem}.log")
        return {"command": shown(cmd)}
    return run


# ------------------------------------------------------------------------------------------- registry


@dataclass
class RenderCtx:
    md: Path  # the Markdown file being written
    out: Path  # the results directory (PNGs go there)

    def png(self, name: str, area: str) -> Path:
        (self.out / area).mkdir(parents=True, exist_ok=True)
        return self.out / area / f"{name}.png"

    def rel(self, p: Path) -> str:
        return Path(os.path.relpath(Path(p).resolve(), self.md.parent.resolve())).as_posix()


@dataclass
class Entry:
    name: str
    title: str
    run: Callable[[Opts], dict]
    render: Callable[[dict, RenderCtx], str]
    estimate: Callable[[Opts], float | None]
    area: str  # what it measures: its JSON (and plots) go under results/AREA/
    json: str | None = None  # a plug-in's JSON file name (in results/AREA/); else NAME.json
    default: bool = True  # part of a run without --only
    plugin: bool = False
    script: str | None = None  # a plug-in's script, relative to benchmarks/

    def path(self, out: Path) -> Path:
        return out / self.area / (self.json or f"{self.name}.json")


SUITE_TITLES = {
    "ycsb": "YCSB-T (transfers, uniform)",
    "zipf": "YCSB-T Zipf sweep (creditor skew)",
    "tpcc": "TPC-C NewOrder + Payment (W=1, scale `bench`)",
    "deathstar": "Deathstar travel mix (60% search, 39% recommend, 0.5% login, 0.5% reserve)",
    "movie": "Deathstar movie review (compose_review, 8 functions)",
}

REGISTRY: dict[str, Entry] = {
    "engine": Entry("engine", "The in-process engine alone (one core)", engine_run, engine_render,
                    lambda o: 4.0 if o.quick else 3 * 9.0, area="engine"),
    **{exp: Entry(exp, title, suite_run(exp), suite_render(exp), lambda o, e=exp: suite_estimate(e, o),
                  area="workloads")
       for exp, title in SUITE_TITLES.items()},
    "spark_max": Entry("spark_max", "Spark `local[2]` fed straight into the log: highest rate with p99 < 2 s",
                       spark_max_run, spark_max_render,
                       lambda o: 45.0 + (1 if o.quick else len(o.spark_rates.split(",")))
                       * (o.duration + warmup("spark", o) + 3.0), area="spark"),
    "e2e": Entry("e2e", "End to end through HTTP: Charon against a PostgreSQL service",
                 plugin_run("e2e/run.py", lambda o, out: ["--out", str(out)]), e2e_render,
                 lambda o: None, area="e2e", json="e2e.json", default=False, plugin=True, script="e2e/run.py"),
    "spark_scaling": Entry("spark_scaling", "Spark on every core: scaling with tasks and executors",
                           plugin_run("spark/spark_scaling.py",
                                      lambda o, out: ["--out", str(out.with_suffix(""))]), generic_render,
                           lambda o: None, area="spark", json="spark_scaling.json", default=False, plugin=True,
                           script="spark/spark_scaling.py"),
    "gateway_cpu": Entry("gateway_cpu", "Gateway CPU per request (durable node through HTTP, closed loop)",
                         plugin_run("gateway/gateway_cpu.py",
                                    lambda o, out: ["--concurrency", "1,16,64", "--duration", "10",
                                                    "--out", str(out)]), generic_render,
                         lambda o: None, area="gateway", json="gateway_cpu.json", default=False, plugin=True,
                         script="gateway/gateway_cpu.py"),
    **{name: Entry(name, title, plugin_run(f"services/{name}.py",
                                           lambda o, out: [*(["--quick"] if o.quick else []), "--out", str(out)]),
                   generic_render, lambda o: None, area="services", json=f"{name}.json", default=False, plugin=True,
                   script=f"services/{name}.py")
       for name, title in (
           ("promise_latency", "Durable promises: resolve sent -> continuation committed (ms, durable node)"),
           ("schedule_jitter", "Schedules: a firing's ctx.now() - its slot, every second (ms, durable node)"),
           ("admission_cost", "Admission control: server CPU per request and latency, off vs on (same run)"))},
}


# ------------------------------------------------------------------------------------------- commands


def selected(only: str | None) -> list[Entry]:
    if not only:
        return [e for e in REGISTRY.values() if e.default]
    names = [n for n in only.split(",") if n]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise SystemExit(f"unknown benchmarks {unknown}; known: {', '.join(REGISTRY)}")
    return [REGISTRY[n] for n in names]


def facts() -> dict:
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine()}


def cmd_run(a: argparse.Namespace) -> int:
    o = Opts(quick=a.quick, duration=a.duration if a.duration is not None else (1.0 if a.quick else 5.0),
             warmup=a.warmup if a.warmup is not None else (0.5 if a.quick else 1.0),
             systems=[s for s in a.systems.split(",") if s], spark_rates=a.spark_rates, out=Path(a.results_dir),
             logs=Path(a.results_dir) / "logs")
    bad = [s for s in o.systems if s not in SUITE_SYSTEMS]
    if bad:
        raise SystemExit(f"unknown systems {bad}; known: {', '.join(SUITE_SYSTEMS)}")
    entries = selected(a.only)
    est = [(e.name, e.estimate(o)) for e in entries]
    known = sum(s for _, s in est if s)
    print("[results] estimate: " + ", ".join(f"{n} ~{s / 60:.1f} min" if s else f"{n} ?" for n, s in est)
          + f"; total ~{known / 60:.1f} min" + (" (plus the plug-ins')" if any(s is None for _, s in est) else ""),
          flush=True)
    o.out.mkdir(parents=True, exist_ok=True)
    failed = []
    manifest: dict[str, Any] = {**facts(), "command": shown([sys.executable, str(HERE / "run.py"), *a.argv]),
                                "quick": o.quick, "loadavg_before": loadavg(), "benchmarks": []}
    for e in entries:
        lb, lbs, t0, when = load(), loadavg(), time.time(), facts()
        try:
            data = e.run(o)
        except Exception as exc:  # one failing benchmark must not lose the others' tables
            print(f"[results] {e.name} failed: {exc}", flush=True)
            failed.append(e.name)
            manifest["benchmarks"].append({"name": e.name, "ok": False, "error": str(exc)[-500:],
                                           "loadavg_before": lbs, "loadavg_after": loadavg()})
            continue
        run_facts = {**when, "load_before": lb, "load_after": load(), "loadavg_before": lbs,
                     "loadavg_after": loadavg(), "elapsed_s": round(time.time() - t0, 1), "quick": o.quick}
        path = e.path(o.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        if e.plugin:  # the script wrote its own JSON: add the run facts it lacks
            doc = json.loads(path.read_text())
            if isinstance(doc, dict):
                for k, v in {**run_facts, "command": data["command"]}.items():
                    doc.setdefault(k, v)
        else:
            doc = {"name": e.name, "title": e.title,
                   "command": f"benchmarks/run.py run{' --quick' if o.quick else ''} --only {e.name}",
                   **run_facts, "data": data}
        path.write_text(json.dumps(doc, indent=1, default=float, allow_nan=True))
        print(f"[results] {e.name}: wrote {os.path.relpath(path, ROOT)} ({run_facts['elapsed_s']:.0f} s, load "
              f"{lb} → {run_facts['load_after']})", flush=True)
        manifest["benchmarks"].append({"name": e.name, "ok": True, "json": path.relative_to(o.out).as_posix(),
                                       "elapsed_s": run_facts["elapsed_s"], "loadavg_before": lbs,
                                       "loadavg_after": run_facts["loadavg_after"]})
    manifest["loadavg_after"] = loadavg()
    (o.out / "run.json").write_text(json.dumps(manifest, indent=1))
    print(f"[results] done{'; failed: ' + ', '.join(failed) if failed else ''}; wrote "
          f"{os.path.relpath(o.out / 'run.json', ROOT)}", flush=True)
    if not a.no_render:  # RESULTS.md and its plots, from this run's folder
        cmd_render(argparse.Namespace(results_dir=str(o.out), md=a.md))
    return 1 if failed else 0


def header(doc: dict) -> str:
    """A table's run facts: commit, date, load average before -> after, machine."""
    commit = doc.get("commit") or doc.get("git_commit") or doc.get("after_commit") or "unknown"
    date = doc.get("date")
    if date is None and isinstance(doc.get("when"), (int, float)):
        date = dt.datetime.fromtimestamp(doc["when"], dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    m = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
    bits = [f"commit `{str(commit)[:10]}`" + (" (uncommitted changes)" if doc.get("dirty") else ""),
            str(date or "date unknown"),
            f"load average {_f(doc.get('load_before'))} → {_f(doc.get('load_after'))}"
            if "load_before" in doc else "load average not recorded"]
    if m:
        bits.append(f"{m.get('cores', '?')} cores, {m.get('ram_gb', '?')} GB RAM")
    if doc.get("quick"):
        bits.append("**quick run (tiny durations): not a measurement**")
    if doc.get("elapsed_s") is not None:
        bits.append(f"{doc['elapsed_s']:.0f} s")
    cmd = doc.get("command")
    return "_" + ", ".join(bits) + "._" + (f" Command: `{cmd}`." if isinstance(cmd, str) else "")


def default_md(results_dir: Path) -> Path:
    """benchmarks/RESULTS.md for benchmarks/results/; RESULTS.md inside any other results folder."""
    return RESULTS_MD if results_dir.resolve() == RESULTS_DIR.resolve() else results_dir / "RESULTS.md"


def cmd_render(a: argparse.Namespace) -> int:
    out = Path(a.results_dir)
    md = Path(a.md) if a.md else default_md(out)
    c = RenderCtx(md=md, out=out)
    sections, commits, skipped = [], {}, []
    for e in REGISTRY.values():
        path = e.path(out)
        if not path.exists():
            skipped.append(e.name)
            continue
        doc = json.loads(path.read_text())
        facts_doc = doc if isinstance(doc, dict) else {}
        commits.setdefault(str(facts_doc.get("commit") or facts_doc.get("git_commit") or "unknown")[:10], []).append(
            e.name)
        body = e.render(doc, c)
        src = os.path.relpath(path, md.parent)
        sections += [f"## {e.title}", "", header(facts_doc) + f" Raw: `{src}`.", "", body.rstrip(), ""]
    template = TEMPLATE.read_text()
    note = []
    if len(commits) > 1:
        note = ["> **Tables from different commits:** " + "; ".join(f"`{k}`: {', '.join(v)}"
                                                                  for k, v in commits.items()) + ".", ""]
    if not commits:
        note += ["**No table measured yet** at this commit: run the two commands above (the old hand-written "
                 "tables are in [HISTORY.md](HISTORY.md)).", ""]
    if skipped:
        note += [f"Not in this file (no JSON yet): {', '.join(skipped)}.", ""]
    text = template.replace(TABLES_MARK, "\n".join(note + sections).rstrip())
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    n = sum(len(v) for v in commits.values())
    print(f"[results] wrote {md} ({n} sections; skipped: {', '.join(skipped) or 'none'})")
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    o = Opts(quick=False, duration=5.0, warmup=1.0, systems=list(SUITE_SYSTEMS), spark_rates=a.spark_rates,
             out=Path(a.results_dir), logs=Path(a.results_dir))
    for e in REGISTRY.values():
        s = e.estimate(o)
        print(f"{e.name:14s} {'default' if e.default else 'plug-in':8s} "
              f"{f'~{s / 60:.1f} min' if s else '?':>9s}  {os.path.relpath(e.path(o.out), ROOT)}  {e.title}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run benchmarks into JSON")
    r.add_argument("--quick", action="store_true", help="tiny durations and one low rate: checks the scripts")
    r.add_argument("--only", help=f"comma-separated names among {', '.join(REGISTRY)}")
    r.add_argument("--systems", default="inprocess,postgres,spark", help="the suite's systems")
    r.add_argument("--duration", type=float, help="measured seconds per point (default 5; --quick 1)")
    r.add_argument("--warmup", type=float, help="discarded seconds per point (default 1; --quick 0.5)")
    r.add_argument("--spark-rates", default="2000,8000,12000,16000,20000,30000",
                   help="spark_max's rates (it stops after the first with p99 > 2 s)")
    r.add_argument("--no-render", action="store_true", help="only the JSON: do not rewrite RESULTS.md after")
    r.add_argument("--md", help="the RESULTS.md to write after the run (default: as `render`)")
    rd = sub.add_parser("render", help="write RESULTS.md from the JSON")
    rd.add_argument("--md", help="the file to write (default: benchmarks/RESULTS.md for benchmarks/results/, "
                    "else RESULTS.md in the results folder)")
    ls = sub.add_parser("list", help="the registry and the time estimates of a full run")
    ls.add_argument("--spark-rates", default="2000,8000,12000,16000,20000,30000")
    for p in (r, rd, ls):
        p.add_argument("--results-dir", default=str(RESULTS_DIR), help="where the JSON files are")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]  # `run.py --quick` = `run.py run --quick`
    a = ap.parse_args(argv)
    a.argv = argv
    return {"run": cmd_run, "render": cmd_render, "list": cmd_list}[a.cmd](a)


if __name__ == "__main__":
    os.chdir(ROOT)
    raise SystemExit(main())
