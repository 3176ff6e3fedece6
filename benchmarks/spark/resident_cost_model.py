"""The resident Spark mode's per-epoch cost model, fitted from measured epochs, and its prediction for 8, 32 and 100
executors (issue 32); JSON + PNG.

Each row is a fresh ``SparkRuntime`` (one Spark session per mode) whose input log holds a backlog of ``--epochs`` x
``size`` YCSB-T transfers, run with a gang of ``tasks`` tasks (``resident_tasks``; ``partitions`` engine
partitions, at least the tasks) on ``local[4]`` (``--mode local``) or a standalone cluster of 3 one-core Workers
(``--mode cluster``; ``both``: each). Every epoch after the first ``--skip`` of a row is a point: its size ``n``, its
gang's tasks ``t``, the task frames its rounds sent (``f``: one per task with work per round, the runtime's
``spark_tasks``), its wall time and the driver thread's CPU time.

The model, least squares with no negative cost (a term the noise drives below 0 is fixed at 0 and the rest
refitted):

* the driver's serial share (its CPU per epoch): ``D = F_d + s * n + r * f``: ``s`` per request (the log read,
  sequencing, pickling the inboxes, replies, the record), ``r`` per task frame (one socket round trip of one
  task: pickling its frame, the send, unpickling its outputs);
* the epoch's wall time: ``T = F + s * n + r * f + p * n / t``: ``F`` the fixed cost (fsyncs, waits), ``p`` per
  request stepped in the tasks (spread over them).

With ``k`` executors (one task each, ``f = rounds * k`` with the measured rounds per epoch), an epoch of ``n``
takes ``T(k) = F + s n + r rounds k + p n / k``: throughput ``n / T(k)``. What stops the curve is the driver's
serial share ``(s n + r rounds k) / T``: adding executors shrinks only ``p n / k`` while the driver's round trips
grow with ``k`` (the best ``k`` is ``sqrt(p n / (r rounds))``), and as epochs grow the ceiling is ``1 / s``
whatever ``k``. On a 2-core machine the tasks share the cores (``p`` is measured oversubscribed): smoke runs only
here; the figures come from a quiet run.

    .venv/bin/python benchmarks/spark/resident_cost_model.py --mode both --tasks 1,2,3 --sizes 100,1000,4000
    .venv/bin/python benchmarks/spark/resident_cost_model.py --quick
    .venv/bin/python benchmarks/spark/resident_cost_model.py --fit benchmarks/results/spark/resident_cost_model.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
APP = "charon.apps.ycsb:app"
PREDICT = (1, 2, 4, 8, 32, 100)


def nonneg_lstsq(cols: list[list[float]], y: list[float], names: list[str]) -> dict[str, float]:
    """Least squares of ``y`` on ``cols`` with every coefficient >= 0 (the most negative is fixed at 0 and the rest
    refitted, until none is): ``{name: coefficient}`` plus ``rms``."""
    import numpy as np

    a = np.array(cols, dtype=float).T
    yy = np.array(y, dtype=float)
    keep = list(range(len(names)))
    while True:
        coef, *_ = np.linalg.lstsq(a[:, keep], yy, rcond=None)
        if all(c >= 0 for c in coef) or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(len(names))
    full[keep] = np.maximum(coef, 0)
    out = {n: float(c) for n, c in zip(names, full, strict=True)}
    out["rms"] = float(np.sqrt(np.mean((a @ full - yy) ** 2)))
    out["fixed_at_zero"] = [n for i, n in enumerate(names) if i not in keep]  # type: ignore[assignment]
    return out


def fit(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The serial (driver CPU) and wall models over the points (``n``, ``t``, ``f``, ``wall_ms``, ``driver_ms``).
    Times in ms, ``s``/``p`` in µs per request, ``r`` in µs per task frame."""
    pts = [p for p in points if p["n"] > 0 and p["t"] > 0]
    if len(pts) < 4 or len({p["t"] for p in pts}) < 2 or len({p["n"] for p in pts}) < 2:
        raise ValueError("the fit needs points at two task counts and two epoch sizes at least")
    one = [1.0] * len(pts)
    n = [float(p["n"]) for p in pts]
    f = [float(p["f"]) for p in pts]
    serial = nonneg_lstsq([one, n, f], [p["driver_ms"] for p in pts], ["F_d_ms", "s_ms", "r_ms"])
    wall = nonneg_lstsq([one, n, f, [p["n"] / p["t"] for p in pts]], [p["wall_ms"] for p in pts],
                        ["F_ms", "s_ms", "r_ms", "p_ms"])
    rounds = statistics.median(p["rounds"] for p in pts)
    return {
        "serial": {"F_d_ms": serial["F_d_ms"], "s_us": serial["s_ms"] * 1000, "r_us": serial["r_ms"] * 1000,
                   "rms_ms": serial["rms"], "fixed_at_zero": serial["fixed_at_zero"]},
        "wall": {"F_ms": wall["F_ms"], "s_us": wall["s_ms"] * 1000, "r_us": wall["r_ms"] * 1000,
                 "p_us": wall["p_ms"] * 1000, "rms_ms": wall["rms"], "fixed_at_zero": wall["fixed_at_zero"]},
        "rounds_per_epoch": rounds, "points": len(pts),
    }


def predict(model: dict[str, Any], executors: int, size: int) -> dict[str, Any]:
    """An epoch of ``size`` on ``executors`` one-task executors: its time, the throughput, the driver's serial
    share, and the best executor count for that size (where the driver's round trips outgrow the parallel step)."""
    w, rounds = model["wall"], model["rounds_per_epoch"]
    # the serial terms: the driver's own figures (its CPU), the wall fit's where the serial fit has none
    s_us = model["serial"]["s_us"] or w["s_us"]
    r_us = model["serial"]["r_us"] or w["r_us"]
    serial_ms = (s_us * size + r_us * rounds * executors) / 1000
    parallel_ms = w["p_us"] * size / executors / 1000
    epoch_ms = w["F_ms"] + serial_ms + parallel_ms
    best = (w["p_us"] * size / (r_us * rounds)) ** 0.5 if r_us > 0 and rounds > 0 else float("inf")
    return {"executors": executors, "size": size, "epoch_ms": epoch_ms, "tps": size / epoch_ms * 1000,
            "serial_share": serial_ms / epoch_ms, "parallel_ms": parallel_ms, "serial_ms": serial_ms,
            "best_executors": best, "ceiling_tps": 1e6 / s_us if s_us > 0 else float("inf")}


def _requests(n: int, accounts: int, seed: int) -> list:
    from charon import serde
    from charon.apps import ycsb
    from charon.messages import Request

    rng = random.Random(seed)
    keys = [ycsb.key(i) for i in range(accounts)]
    return [Request(f"m{seed}-{i:x}", "account", keys[rng.randrange(accounts)], "transfer",
                    serde.encode([keys[rng.randrange(accounts)], rng.randint(1, 10)])) for i in range(n)]


def run_row(spark: Any, master: str, conf: dict[str, str], tasks: int, size: int, epochs: int, skip: int,
            accounts: int, partitions: int, seed: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from charon.apps import ycsb
    from charon.config import SparkConfig
    from charon.runtime.spark.runtime import SparkRuntime

    data = tempfile.mkdtemp(prefix="charon-costmodel-")
    load0 = os.getloadavg()[0]
    cfg = SparkConfig(master=master, data_dir=data, partitions=max(partitions, tasks), max_batch=size,
                      restart_batch=size, compact_every=50, spark_conf=conf, exchange="resident",
                      resident_tasks=tasks)
    rt = SparkRuntime(APP, cfg, spark=spark)
    try:
        rt.load("account", ycsb.initial_state(accounts))
        rt.input_log.append_many(_requests(size * epochs, accounts, seed))
        target = rt.last_recorded_epoch() + epochs
        rt.start()
        deadline = time.monotonic() + 120 + epochs * 30
        while rt.last_recorded_epoch() < target and time.monotonic() < deadline:
            time.sleep(0.02)
        executors = sorted({t["executor"] for t in rt.health().get("gang", {}).get("seated", [])})
        stats = [s for s in rt.epoch_stats if s.get("size", 0) > 0][skip:]
    finally:
        rt.stop()  # not close(): the session serves the next rows
        shutil.rmtree(data, ignore_errors=True)
    points = [{"n": int(s["size"]), "t": tasks, "f": int(s.get("spark_tasks", 0)), "rounds": s.get("spark_rounds", 0),
               "wall_ms": float(s.get("duration_ms", 0.0)), "driver_ms": float(s.get("driver_cpu_s", 0.0)) * 1000,
               "round_ms": float(s.get("spark_round_s", 0.0)) * 1000,
               "task_cpu_ms": float(s.get("spark_task_cpu_s", 0.0)) * 1000} for s in stats]

    def med(k: str) -> float | None:
        return statistics.median(p[k] for p in points) if points else None

    row = {"tasks": tasks, "size": size, "partitions": max(partitions, tasks), "epochs_timed": len(points),
           "executors": executors, "wall_ms": med("wall_ms"), "driver_ms": med("driver_ms"),
           "frames": med("f"), "rounds": med("rounds"), "round_ms": med("round_ms"), "task_cpu_ms": med("task_cpu_ms"),
           "load_before": load0, "load_after": os.getloadavg()[0]}
    return row, points


def measure(mode: str, tasks: list[int], sizes: list[int], a: argparse.Namespace) -> tuple[list, list]:
    from charon.config import SparkConfig
    from charon.runtime.spark.session import make_session

    cluster = None
    root = tempfile.mkdtemp(prefix="charon-costmodel-cluster-")
    rows: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    spark = None
    try:
        if mode == "cluster":
            from charon.runtime.spark.cluster import StandaloneCluster

            cluster = StandaloneCluster(os.path.join(root, "cluster"), workers=max(tasks), cores=1, memory="1g")
            cluster.start()
            master, conf = cluster.master_url, cluster.app_conf(executor_cores=1, max_cores=max(tasks))
        else:
            master, conf = f"local[{max(tasks) + 1}]", {}
        spark = make_session(SparkConfig(master=master, partitions=a.partitions, spark_conf=conf))
        for rep in range(a.repeat):
            for size in sizes:
                for t in tasks:
                    row, pts = run_row(spark, master, conf, t, size, a.epochs, a.skip, a.accounts, a.partitions,
                                       seed=rep * 1000 + size + t)
                    row.update({"mode": mode, "repeat": rep})
                    for p in pts:
                        p["mode"] = mode
                    rows.append(row)
                    points.extend(pts)
                    print(f"[cost] {mode} tasks {t} epochs of {size}: wall {row['wall_ms'] or 0:.1f} ms, driver cpu "
                          f"{row['driver_ms'] or 0:.1f} ms, {row['frames']} frames in {row['rounds']} rounds "
                          f"(executors {row['executors']}), load {row['load_before']:.1f}", flush=True)
    finally:
        if spark is not None:
            spark.stop()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return rows, points


def report(doc: dict[str, Any], sizes: list[int]) -> None:
    """Fit the points (each mode and all together), predict, and say what stops the curve."""
    fits: dict[str, Any] = {}
    for name in [*sorted({p["mode"] for p in doc["points"]}), "all"]:
        pts = [p for p in doc["points"] if name == "all" or p["mode"] == name]
        try:
            fits[name] = fit(pts)
        except ValueError as exc:
            fits[name] = {"error": str(exc)}
    doc["models"] = fits
    model = fits.get("cluster") if "error" not in fits.get("cluster", {"error": 1}) else fits.get("all")
    if model is None or "error" in model:
        print(f"[cost] no fit: {model}")
        return
    doc["model"] = model
    doc["predictions"] = [predict(model, k, n) for n in sorted({*sizes, 10_000}) for k in PREDICT]
    s, w = model["serial"], model["wall"]
    print(f"[cost] serial (driver CPU per epoch): F_d {s['F_d_ms']:.2f} ms + s {s['s_us']:.1f} µs/request + "
          f"r {s['r_us']:.1f} µs/task frame (rms {s['rms_ms']:.1f} ms)")
    print(f"[cost] wall: F {w['F_ms']:.2f} ms + s {w['s_us']:.1f} µs/request + r {w['r_us']:.1f} µs/frame + "
          f"p {w['p_us']:.1f} µs/request/task (rms {w['rms_ms']:.1f} ms); {model['rounds_per_epoch']:g} rounds/epoch")
    for p in doc["predictions"]:
        if p["executors"] in (8, 32, 100):
            print(f"[cost]   {p['executors']:>3} executors, epochs of {p['size']:>6}: {p['epoch_ms']:8.1f} ms, "
                  f"{p['tps']:>9,.0f} tx/s, driver's serial share {p['serial_share']:.0%} (best at "
                  f"~{p['best_executors']:.0f} executors; ceiling 1/s = {p['ceiling_tps']:,.0f} tx/s)")
    doc["what_stops_the_curve"] = (
        "the driver's serial share: every request costs the driver s (log read, sequencing, pickling, replies, "
        "record) whatever the executors, and every task costs it r per round (one frame each way over its "
        "socket), so more executors shrink only the tasks' parallel step p*n/k while the driver's round trips grow "
        "with k: past sqrt(p*n/(r*rounds)) executors an epoch gets slower, and as epochs grow the ceiling is 1/s.")
    print("[cost] what stops the curve: " + doc["what_stops_the_curve"])


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in sorted({p["mode"] for p in doc["points"]}):
        for t in sorted({p["t"] for p in doc["points"] if p["mode"] == mode}):
            sel = [p for p in doc["points"] if p["mode"] == mode and p["t"] == t]
            a1.scatter([p["n"] for p in sel], [p["wall_ms"] for p in sel], s=8,
                       label=f"{mode}, {t} task{'s' if t > 1 else ''}", marker="o" if mode == "local" else "^")
    a1.set(xlabel="requests per epoch", ylabel="epoch wall time (ms)", title="measured epochs")
    a1.set_xscale("log")
    a1.set_yscale("log")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=7)
    m = doc.get("model")
    if m:
        ks = [1, 2, 4, 8, 16, 32, 64, 100, 200]
        for n in sorted({p["size"] for p in doc.get("predictions", [])}):
            a2.plot(ks, [predict(m, k, n)["tps"] for k in ks], "-", label=f"epochs of {n}")
        a2.set_xscale("log")
        a2.set_yscale("log")
        w, s = m["wall"], m["serial"]
        a2.set(xlabel="executors (one gang task each)", ylabel="tx/s (model)",
               title=f"F={w['F_ms']:.1f} ms, s={s['s_us'] or w['s_us']:.1f} µs, "
                     f"r={s['r_us'] or w['r_us']:.0f} µs/frame, p={w['p_us']:.1f} µs")
        a2.grid(alpha=0.3)
        a2.legend(fontsize=7)
    fig.suptitle(f"resident Spark per-epoch cost, commit {doc.get('commit', '')[:10]} ({doc.get('date', '')})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("local", "cluster", "both"), default="both")
    ap.add_argument("--tasks", default="1,2,3", help="gang tasks per row (resident_tasks)")
    ap.add_argument("--sizes", default="100,1000,4000", help="requests per epoch (max_batch)")
    ap.add_argument("--epochs", type=int, default=12, help="epochs per row (the backlog)")
    ap.add_argument("--skip", type=int, default=2, help="warm-up epochs not used")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--accounts", type=int, default=10_000)
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="a smoke: local, tasks 1,2, small epochs, to a temp dir")
    ap.add_argument("--out", default=None, help="output stem (default results/spark/resident_cost_model)")
    ap.add_argument("--fit", metavar="JSON", help="only fit (and plot) the points of this JSON")
    a = ap.parse_args(argv)
    if a.fit:
        doc = json.loads(Path(a.fit).read_text())
        report(doc, sorted({r["size"] for r in doc["rows"]}))
        out = a.fit.removesuffix(".json")
        Path(out + ".json").write_text(json.dumps(doc, indent=1))
        plot(doc, out + ".png")
        return 0
    if a.quick:
        a.mode, a.tasks, a.sizes, a.epochs, a.skip, a.accounts = "local", "1,2", "20,200", 5, 1, 1000
    out = a.out or (str(Path(tempfile.mkdtemp(prefix="charon-costmodel-quick-")) / "resident_cost_model") if a.quick
                    else str(HERE.parent / "results" / "spark" / "resident_cost_model"))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    tasks = [int(x) for x in a.tasks.split(",")]
    sizes = [int(x) for x in a.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    for mode in (("local", "cluster") if a.mode == "both" else (a.mode,)):
        r, p = measure(mode, tasks, sizes, a)
        rows += r
        points += p
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    doc: dict[str, Any] = {
        "command": "benchmarks/spark/resident_cost_model.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "quick": a.quick,
        "epochs": a.epochs, "skip": a.skip, "accounts": a.accounts, "partitions": a.partitions, "cpus": os.cpu_count(),
        "rows": rows, "points": points}
    report(doc, sizes)
    Path(out + ".json").parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(doc, indent=1))
    plot(doc, out + ".png")
    print(f"[cost] wrote {out}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
