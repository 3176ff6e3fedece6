"""Spark jobs and tasks per epoch, before and after issue 10's levers, without Spark's timing noise; JSON + PNG.

The Spark runtime's real exchange and task function run in this process (``run_job`` calls the task function
on the payloads, as Spark's tasks would), so what is counted is exactly what Spark would be asked to run:
jobs and tasks per epoch, and the engine's CPU per transaction (tasks plus coordinator, ``time.process_time``).
Each job costs ~40 ms (one task) to ~70 ms (two tasks) on the reference machine whatever it carries.

Workloads: YCSB-T transfers (10k accounts, uniform) and TPC-C NewOrder+Payment at W=1 (the ``small`` scale),
epochs of ``--sizes`` transactions; variants ``before`` (every lever off: whole epochs, a finalize round of its own,
rounds of one task per core, the fallback round by round) and ``after`` (the defaults).

    .venv/bin/python benchmarks/spark/spark_epoch_structure.py --sizes 100,500
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "results" / "spark"
BEFORE = {"pipeline_finalize": False, "single_task_fallback": False, "single_task_rest": False, "task_min_bytes": 1,
          "gc_threshold": 0}


def run(workload: str, variant: str, size: int, epochs: int = 3, overrides: dict | None = None) -> dict:
    from charon import InProcessRuntime, Request, serde
    from charon.apps import tpcc, ycsb
    from charon.config import SparkConfig
    from charon.core.epoch import EpochCoordinator
    from charon.core.routing import partition_of, split_store_key
    from charon.runtime.spark.exchange import SparkExchange
    from charon.state.durable import DurableState

    class Counting(SparkExchange):
        def run_job(self, payloads):
            self.jobs += 1
            self.tasks += self.tasks_for(payloads) if payloads[0][0] >= 0 else 1
            return list(self.fn(payloads))

    import gc

    import charon.runtime.node.inprocess as inprocess

    # the collector as a fresh process has it (tune_gc, which the after variant's tasks call, is per process)
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    inprocess._GC_TUNED = False
    parts = 4
    tmp = tempfile.mkdtemp(prefix="charon-structure-")
    try:
        cfg = SparkConfig(data_dir=tmp, partitions=parts, local_dir=os.path.join(tmp, "local"), master="local[2]",
                          **{**(BEFORE if variant == "before" else {}), **(overrides or {})})
        ref = InProcessRuntime(ycsb.app if workload == "ycsb" else tpcc.app, partitions=parts)
        if workload == "ycsb":
            ref.load("account", ycsb.initial_state(10_000))
            app_ref = "charon.apps.ycsb:app"
        else:
            tpcc.load(ref, tpcc.populate(1, tpcc.SMALL, seed=1))
            app_ref = "charon.apps.tpcc:app"
        by: dict[int, list] = {}
        for k, v in ref.snapshot().items():
            op, key, _ = split_store_key(k)
            by.setdefault(partition_of(op, key, parts), []).append((k, v))
        durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
        for pid in range(parts):
            durable.write_base(pid, -1, sorted(by.get(pid, [])))
        ex = Counting(None, app_ref, cfg)
        ex.slots = 2  # local[2]: a round gets at most two tasks
        coord = EpochCoordinator(ref.app, ex, sequencers=1, chunk=0 if variant == "before" else None)  # before: whole
        rng = random.Random(1)
        prior = None
        rows = []
        for e in range(epochs):
            reqs = []
            for i in range(size):
                if workload == "ycsb":
                    op, key, fn, args = ("account", ycsb.key(rng.randrange(10_000)), "transfer",
                                         [ycsb.key(rng.randrange(10_000)), rng.randint(1, 10)])
                elif i % 2:
                    op, key, fn, args = tpcc.new_order_request(rng, 1, tpcc.SMALL)
                else:
                    op, key, fn, args = tpcc.payment_request(rng, 1, tpcc.SMALL)
                reqs.append((0, Request(f"r{e}-{i}", op, key, fn, serde.encode(args))))
            ex.jobs = ex.tasks = 0
            t = time.process_time()
            res = coord.run_epoch(e, reqs, prior=prior, defer=cfg.pipeline_finalize)
            cpu = time.process_time() - t
            prior = res if res.finalize is not None else None  # its finalize rides in the next epoch
            s = res.stats
            rows.append({"jobs": ex.jobs, "tasks": ex.tasks, "cpu_ms": cpu * 1000,
                         "fallback_share": (len(res.fast) + len(res.slow)) / max(1, len(res.requests))})
        steady = rows[1:]  # the first epoch has no prior finalize to carry
        mean = {k: sum(r[k] for r in steady) / len(steady) for k in steady[0]}
        return {"workload": workload, "variant": variant, "size": size, "jobs_per_epoch": mean["jobs"],
                "tasks_per_epoch": mean["tasks"], "engine_cpu_us_per_tx": mean["cpu_ms"] * 1000 / size,
                "fallback_share": mean["fallback_share"], "epochs": rows, "last_stats": s}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,500")
    ap.add_argument("--workloads", default="ycsb,tpcc")
    ap.add_argument("--variants", default="before,after", help="comma-separated: before, after")
    ap.add_argument("--epochs", type=int, default=3, help="epochs per point (the first is not counted)")
    ap.add_argument("--label", default="", help="suffix of the output file names")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--fixed-ms", type=float, default=250.0,
                    help="per-epoch cost outside the engine (jobs, micro-batch) for the printed tx/s estimate")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=INT",
                    help="a SparkConfig override for both variants (e.g. task_min_bytes=100000000)")
    a = ap.parse_args(argv)
    overrides = {k: int(v) for k, v in (x.split("=", 1) for x in a.set)}
    results = []
    for w in a.workloads.split(","):
        for size in [int(x) for x in a.sizes.split(",")]:
            for variant in a.variants.split(","):
                r = run(w, variant, size, epochs=a.epochs, overrides=overrides)
                rate = size / (r["engine_cpu_us_per_tx"] * size / 1e6 + a.fixed_ms / 1e3)
                results.append(r)
                print(f"{w:5} {variant:6} epoch of {size:5}: {r['jobs_per_epoch']:6.1f} jobs "
                      f"{r['tasks_per_epoch']:6.1f} tasks, engine {r['engine_cpu_us_per_tx']:6.0f} µs CPU/tx, "
                      f"fallback {r['fallback_share']:.0%}, {rate:,.0f} tx/s with {a.fixed_ms:.0f} ms fixed per epoch",
                      flush=True)
    out = Path(a.out)
    name = "spark_epoch_structure" + (f"_{a.label}" if a.label else "")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=float))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.4))
    labels = [f"{r['workload']} {r['size']}\n{r['variant']}" for r in results]
    ax.bar(range(len(results)), [r["jobs_per_epoch"] for r in results],
           color=["tab:gray" if r["variant"] == "before" else "tab:blue" for r in results])
    ax.set_yscale("log")
    ax.set_xticks(range(len(results)), labels, fontsize=8)
    ax.set_ylabel("Spark jobs per epoch (log)")
    for i, r in enumerate(results):
        ax.text(i, r["jobs_per_epoch"], f"{r['jobs_per_epoch']:.0f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=100)
    print(f"wrote {out / name}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
