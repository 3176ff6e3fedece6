"""State reads on the Spark runtime: from the durable copy in the driver vs a Spark job per read.

One SparkRuntime (local[2], 4 partitions) runs a few hundred deposits (several compactions' worth of deltas),
then reads single keys both ways, alternating, in the same run. For each way: the wall time per read and the
CPU time per read of the driver Python process and of the JVM (psutil, all threads), which are less disturbed
by other load on the machine than wall time. Both ways must return the same values. Writes JSON and a PNG.

    .venv/bin/python benchmarks/state/state_reads.py --reads 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from charon.config import SparkConfig
from charon.runtime.spark.runtime import SparkRuntime

OUT = Path(__file__).resolve().parents[1] / "results" / "state"


def jvm_of(me: psutil.Process) -> psutil.Process:
    return next(p for p in me.children(recursive=True) if p.name() == "java")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reads", type=int, default=200)
    ap.add_argument("--accounts", type=int, default=200)
    ap.add_argument("--deposits", type=int, default=400)
    ap.add_argument("--out", default=str(OUT / "state-reads"))
    args = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    data = tempfile.mkdtemp(prefix="charon-reads-")
    cfg = SparkConfig(master="local[2]", data_dir=data, partitions=4, compact_every=20)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg)
    rt.start()
    try:
        async def load() -> None:
            sem = asyncio.Semaphore(64)

            async def one(i: int) -> None:
                async with sem:
                    await rt.submit("account", f"a{i % args.accounts}", "deposit", [1], request_id=f"d{i}")

            await asyncio.gather(*(one(i) for i in range(args.deposits)))

        asyncio.run(load())
        rt.wait_idle()
        me, jvm = psutil.Process(), jvm_of(psutil.Process())
        ways = {"driver": True, "spark_job": False}
        res: dict[str, dict[str, list[float]]] = {w: {"wall_ms": [], "driver_cpu_ms": [], "jvm_cpu_ms": []}
                                                   for w in ways}
        values: dict[str, list] = {w: [] for w in ways}
        for i in range(args.reads):
            key = f"a{i % args.accounts}"
            for way, flag in ways.items():
                rt.config.driver_reads = flag
                c0, j0, t0 = me.cpu_times(), jvm.cpu_times(), time.perf_counter()
                values[way].append(rt.read_state("account", key))
                t1, c1, j1 = time.perf_counter(), me.cpu_times(), jvm.cpu_times()
                r = res[way]
                r["wall_ms"].append((t1 - t0) * 1e3)
                r["driver_cpu_ms"].append((c1.user + c1.system - c0.user - c0.system) * 1e3)
                r["jvm_cpu_ms"].append((j1.user + j1.system - j0.user - j0.system) * 1e3)
        assert values["driver"] == values["spark_job"], "the two read paths disagree"
        summary = {w: {k: {"median": statistics.median(v), "mean": statistics.fmean(v)} for k, v in r.items()}
                   for w, r in res.items()}
    finally:
        rt.close()
    result = {"config": {**vars(args), "master": cfg.master, "partitions": cfg.partitions,
                         "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
              "same_values": True, "summary": summary}
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    metrics = ["wall_ms", "driver_cpu_ms", "jvm_cpu_ms"]
    for n, w in enumerate(summary):
        ax.bar([m + n * 0.4 for m in range(len(metrics))], [summary[w][k]["mean"] for k in metrics], 0.4, label=w)
    ax.set_xticks([m + 0.2 for m in range(len(metrics))], metrics)
    ax.set_ylabel("ms per read (mean)")
    ax.set_yscale("log")
    ax.set_title("GET /state on Spark: durable copy in the driver vs a Spark job")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(args.out).with_suffix(".png"), dpi=110)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
