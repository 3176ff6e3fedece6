"""Spark on more cores: the saturated engine's throughput with 1 vs 2 executors (standalone cluster, one core each;
or ``local[k]``), and the scaling model fitted from it; JSON + PNG.

Each row is a fresh Spark application with ``k`` one-core executors (on a standalone cluster of ``max(--cores)``
Workers started here, ``spark.cores.max = k``) and a fresh runtime whose input log holds a backlog of
``--epochs`` x ``size`` YCSB-T transfers before it starts, so every epoch is full (``max_batch = size``). The first
``--skip`` epochs are warm-up; over the rest: committed transactions per second, the epoch cycle (time between
epoch ends), where the time goes (the runtime's epoch statistics) and the CPU of every process (driver, JVMs,
Python workers). Rows alternate over ``k`` within each repetition (the machine's load drifts; compare within a
repetition).

The model (:func:`fit`, over every row): an epoch of ``n`` transactions on ``k`` cores takes
``F + n * (s + p / k)``: ``F`` the per-epoch fixed cost (Spark's micro-batch and jobs), ``s`` the per-transaction
cost that does not spread over cores (the driver's log read, sequencing, pickling, reply writing, and the rest's
coordinator), ``p`` the per-transaction cost per core (the partitions' steps). :func:`predict` gives an epoch's
time and the throughput at any ``k`` (e.g. 100 cores) and epoch size; the ceiling as epochs grow is ``1 / (s + p/k)``.

    .venv/bin/python benchmarks/spark/spark_scaling.py --cores 1,2 --sizes 4000,10000 --epochs 8 --repeat 2
    .venv/bin/python benchmarks/spark/spark_scaling.py --mode local --cores 1,2 --sizes 4000,10000
    .venv/bin/python benchmarks/spark/spark_scaling.py --fit benchmarks/results/spark/spark_scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # spark_ycsb's process-tree CPU helpers


def fit(rows: list[dict]) -> dict:
    """Least squares of ``cycle_ms = F + n * (s + p / k)`` over the rows (``size`` n, ``cores`` k, ``cycle_ms``):
    ``{"F_ms", "s_us", "p_us", "rows", "rms_ms"}`` (``s``, ``p`` per transaction, ``p`` per core)."""
    import numpy as np

    pts = [r for r in rows if r.get("cycle_ms")]
    if len(pts) < 3:
        raise ValueError("the fit needs at least three rows (two core counts, two sizes)")
    a = np.array([[1.0, r["size"], r["size"] / r["cores"]] for r in pts])
    y = np.array([r["cycle_ms"] for r in pts])
    keep = [0, 1, 2]
    while True:  # no cost is negative: a coefficient the noise drives below 0 is fixed at 0, the others refitted
        coef, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if all(c >= 0 for c in coef) or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = np.zeros(3)
    full[keep] = coef
    f, s, p = (float(x) for x in full)
    rms = float(np.sqrt(np.mean((a @ full - y) ** 2)))
    return {"F_ms": f, "s_us": s * 1000, "p_us": p * 1000, "rows": len(pts), "rms_ms": rms,
            "fixed_at_zero": [name for i, name in enumerate(("F_ms", "s_us", "p_us")) if i not in keep]}


def predict(model: dict, cores: int, size: int) -> dict:
    """An epoch's time (ms) and the throughput (tx/s) with ``cores`` executor cores and epochs of ``size``; and the
    ceiling as epochs grow (``1 / (s + p / cores)``)."""
    per_tx_us = model["s_us"] + model["p_us"] / cores
    epoch_ms = model["F_ms"] + size * per_tx_us / 1000
    return {"cores": cores, "size": size, "epoch_ms": epoch_ms, "tps": size / epoch_ms * 1000,
            "ceiling_tps": 1e6 / per_tx_us if per_tx_us > 0 else float("inf")}


def _requests(n: int, accounts: int, seed: int) -> list:
    import random

    from charon import serde
    from charon.apps import ycsb
    from charon.messages import Request

    rng = random.Random(seed)
    keys = [ycsb.key(i) for i in range(accounts)]
    return [Request(f"s{seed}-{i:x}", "account", keys[rng.randrange(accounts)], "transfer",
                    serde.encode([keys[rng.randrange(accounts)], rng.randint(1, 10)])) for i in range(n)]


def _executors(spark) -> int:
    return spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1


def run_row(master: str, spark_conf: dict, cores: int, size: int, epochs: int, skip: int, accounts: int,
            partitions: int, settings: dict, seed: int, local: bool) -> dict:
    from spark_ycsb import _tree_cpu, cpu_split

    from charon.apps import ycsb
    from charon.config import SparkConfig
    from charon.runtime.spark.runtime import SparkRuntime

    data = tempfile.mkdtemp(prefix="charon-scaling-")
    load0 = os.getloadavg()[0]
    cfg = SparkConfig(master=master, data_dir=data, partitions=partitions, max_batch=size, compact_every=50,
                      spark_conf=spark_conf, **settings)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg)
    try:
        rt.load("account", ycsb.initial_state(accounts))
        if not local:  # every executor registered before the clock starts
            deadline = time.monotonic() + 120
            while _executors(rt.spark) < cores and time.monotonic() < deadline:
                time.sleep(0.2)
        reqs = _requests(size * epochs, accounts, seed)
        rt.input_log.append_many(reqs)
        first = rt.last_epoch
        cpu0, ends = _tree_cpu(), []
        c0 = None
        rt.start()
        deadline = time.monotonic() + 60 + epochs * 60
        seen = first
        while time.monotonic() < deadline:
            e = rt.last_epoch
            if e != seen:
                now = time.monotonic()
                ends.extend([now] * (e - seen))
                seen = e
                if c0 is None and len(ends) >= skip:
                    c0 = _tree_cpu()
                if len(ends) >= epochs:
                    break
            time.sleep(0.005)
        cpu1 = _tree_cpu()
        stats = [s for s in rt.epoch_stats if s.get("size", 0) > 0][skip:epochs]
    finally:
        rt.close()
        shutil.rmtree(data, ignore_errors=True)
    timed = ends[skip:]
    cycles = [(b - a) * 1000 for a, b in zip(timed, timed[1:], strict=False)]
    done = sum(s.get("size", 0) for s in stats[1:]) if len(stats) > 1 else 0
    span = timed[-1] - timed[0] if len(timed) > 1 else float("nan")
    split = cpu_split(c0 or cpu0, cpu1, -1)

    def mean(k: str, scale: float = 1.0) -> float:
        return statistics.fmean([s.get(k, 0.0) * scale for s in stats]) if stats else float("nan")

    n_req = max(1, done)
    return {
        "cores": cores, "size": size, "epochs_timed": len(timed), "tps": done / span if span == span else None,
        "cycle_ms": statistics.median(cycles) if cycles else None,
        "epoch_ms": mean("duration_ms"), "jobs_per_epoch": mean("spark_jobs"),
        "split_rests": sum(s.get("spark_split_rests", 0) for s in stats), "tasks_per_epoch": mean("spark_tasks"),
        "driver_thread_cpu_ms": mean("driver_cpu_s", 1000), "task_cpu_ms": mean("spark_task_cpu_s", 1000),
        "hub_ms": mean("spark_hub_s", 1000), "conflicts": mean("conflicts"),
        "cpu_us_per_tx": {k: v / n_req * 1e6 for k, v in split.items()},
        "load_before": load0, "load_after": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("cluster", "local"), default="cluster")
    ap.add_argument("--cores", default="1,2", help="executor cores per row (one-core executors on the cluster)")
    ap.add_argument("--sizes", default="4000,10000", help="transactions per epoch (max_batch)")
    ap.add_argument("--epochs", type=int, default=8, help="epochs per row (the backlog)")
    ap.add_argument("--skip", type=int, default=2, help="warm-up epochs not timed")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--accounts", type=int, default=10_000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a SparkConfig setting for every row (e.g. split_rest=off)")
    ap.add_argument("--predict", default="1,2,4,16,100", help="core counts the model predicts")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "spark" / "spark_scaling"))
    ap.add_argument("--fit", metavar="JSON", help="only fit (and plot) the rows of this JSON")
    a = ap.parse_args(argv)
    if a.fit:
        doc = json.loads(Path(a.fit).read_text())
        doc["model"] = fit(doc["rows"])
        doc["predictions"] = [predict(doc["model"], int(k), max(r["size"] for r in doc["rows"]))
                              for k in a.predict.split(",")]
        print(json.dumps({"model": doc["model"], "predictions": doc["predictions"]}, indent=1))
        out = a.fit.removesuffix(".json")
        Path(out + ".json").write_text(json.dumps(doc, indent=1))
        plot(doc, out + ".png")
        return 0
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    settings: dict = {}
    for kv in a.set:
        k, v = kv.split("=", 1)
        settings[k] = v.lower() == "true" if v.lower() in ("true", "false") else int(v) if v.isdigit() else v
    cores = [int(x) for x in a.cores.split(",")]
    sizes = [int(x) for x in a.sizes.split(",")]
    cluster = None
    root = tempfile.mkdtemp(prefix="charon-scaling-cluster-")
    rows = []
    try:
        if a.mode == "cluster":
            from charon.runtime.spark.cluster import StandaloneCluster

            cluster = StandaloneCluster(os.path.join(root, "cluster"), workers=max(cores), cores=1, memory="1g")
            cluster.start()
        for rep in range(a.repeat):
            for size in sizes:
                for k in cores:
                    if cluster is not None:
                        master, conf = cluster.master_url, cluster.app_conf(executor_cores=1, max_cores=k)
                    else:
                        master, conf = f"local[{k}]", {}
                    row = run_row(master, conf, k, size, a.epochs, a.skip, a.accounts, a.partitions, settings,
                                  seed=rep * 1000 + size, local=cluster is None)
                    row.update({"repeat": rep, "mode": a.mode})
                    rows.append(row)
                    print(f"[scaling] {a.mode} cores {k} epoch {size}: {row['tps'] or 0:,.0f} tx/s, cycle "
                          f"{row['cycle_ms'] or 0:.0f} ms, epoch {row['epoch_ms']:.0f} ms, {row['jobs_per_epoch']:.1f} "
                          f"jobs, {row['tasks_per_epoch']:.1f} tasks, split rests {row['split_rests']}, "
                          f"load {row['load_before']:.1f} -> "
                          f"{row['load_after']:.1f}", flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    doc = {"commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "mode": a.mode,
           "settings": settings, "epochs": a.epochs, "skip": a.skip, "accounts": a.accounts,
           "partitions": a.partitions, "cpus": os.cpu_count(), "rows": rows}
    try:
        doc["model"] = fit(rows)
        doc["predictions"] = [predict(doc["model"], int(k), max(sizes)) for k in a.predict.split(",")]
        print("[scaling] model: " + json.dumps(doc["model"]))
        for p in doc["predictions"]:
            print(f"[scaling]   {p['cores']:>3} cores, epochs of {p['size']}: {p['tps']:,.0f} tx/s "
                  f"(ceiling {p['ceiling_tps']:,.0f})")
    except ValueError as exc:
        print(f"[scaling] no fit: {exc}")
    Path(a.out + ".json").write_text(json.dumps(doc, indent=1))
    plot(doc, a.out + ".png")
    print(f"[scaling] wrote {a.out}.json")
    return 0


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for size in sorted({r["size"] for r in rows}):
        sel = sorted((r for r in rows if r["size"] == size and r.get("tps")), key=lambda r: r["cores"])
        a1.plot([r["cores"] for r in sel], [r["tps"] for r in sel], "o", label=f"epochs of {size}")
    a1.set(xlabel="executor cores", ylabel="committed tx/s (saturated)", title=f"{doc['mode']} (measured)")
    a1.grid(alpha=0.3)
    a1.legend()
    if doc.get("model"):
        m = doc["model"]
        ks = [1, 2, 4, 8, 16, 32, 64, 100]
        size = max(r["size"] for r in rows)
        a2.plot(ks, [predict(m, k, size)["tps"] for k in ks], "-", label=f"epochs of {size}")
        a2.plot(ks, [predict(m, k, size)["ceiling_tps"] for k in ks], "--", label="ceiling (epochs → ∞)")
        a2.set_xscale("log")
        a2.set(xlabel="executor cores", ylabel="tx/s (model)",
               title=f"F={m['F_ms']:.0f} ms, s={m['s_us']:.1f} µs, p={m['p_us']:.1f} µs/core")
        a2.grid(alpha=0.3)
        a2.legend()
    fig.suptitle(f"YCSB-T on Spark, commit {doc.get('commit', '')[:10]} ({doc.get('date', '')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
