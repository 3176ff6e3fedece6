"""YCSB-T on the Spark runtime (local[2]): latency vs input rate, epoch-time breakdown; JSON + PNG.

The driver (Spark, the epoch coordinator) runs in this process; the open-loop load generator runs in a
separate process that appends to the input log and tails the output log (as a gateway would), so the two
do not share a GIL.

    .venv/bin/python benchmarks/spark_ycsb.py --rates 250,500,1000,2000,4000 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def _generator(data_dir: str, rate: float, duration: float, warmup: float, n: int, zipf: float, seed: int,
               out: str) -> None:
    from charon.apps import ycsb
    from charon.bench.harness import run_open_loop
    from charon.log.client import LogClient
    from charon.log.sqlite import InputLog, OutputLog

    sampler = ycsb.Zipf(n, zipf)

    def gen(rng):
        d = rng.randrange(n)
        return ("account", ycsb.key(d), "transfer", [ycsb.key(sampler.sample(rng)), rng.randint(1, 10)])

    async def main():
        target = LogClient(InputLog(os.path.join(data_dir, "input.sqlite")),
                           OutputLog(os.path.join(data_dir, "output.sqlite")))
        return await run_open_loop(target, gen, rate=rate, duration=duration, warmup=warmup,
                                   drain_timeout=30.0, seed=seed, label=f"spark zipf={zipf}")

    res = asyncio.run(main())
    Path(out).write_text(json.dumps(res))


def breakdown(epochs: list[dict]) -> dict:
    """Where an epoch's time goes, as means over the epochs (ms)."""
    def mean(k: str, scale: float = 1000.0) -> float:
        vals = [e.get(k, 0.0) * scale for e in epochs]
        return statistics.fmean(vals) if vals else float("nan")

    return {
        "epoch_ms": mean("duration_ms", 1.0),
        "rounds": mean("rounds", 1.0),
        "spark_jobs_per_epoch": mean("spark_jobs", 1.0),
        "spark_tasks_per_epoch": mean("spark_tasks", 1.0),
        "ms_per_job": (mean("spark_job_s") / mean("spark_jobs", 1.0)) if mean("spark_jobs", 1.0) else float("nan"),
        "finalize_deferred": mean("finalize_deferred", 1.0),
        "conflicts": mean("conflicts", 1.0),
        "spark_jobs_ms": mean("spark_job_s"),
        "task_function_exec_ms": mean("spark_step_s"),
        "task_state_restore_ms": mean("spark_restore_s"),
        "driver_serialization_ms": mean("spark_ser_s"),
        "coordinator_ms": statistics.fmean(
            [e.get("duration_ms", 0.0) - 1000 * e.get("exchange_s", 0.0) for e in epochs]
        ) if epochs else float("nan"),
        "bytes_per_epoch": mean("spark_bytes_out", 1.0) + mean("spark_bytes_in", 1.0),
        "size": mean("size", 1.0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="250,500,1000,2000,4000")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--accounts", type=int, default=10_000)
    ap.add_argument("--zipf", type=float, default=0.0)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--out", default=str(ROOT / "out"))
    ap.add_argument("--label", default="", help="suffix of the JSON file name (e.g. before/after)")
    ap.add_argument("--pipeline-finalize", type=int, choices=(0, 1), default=1,
                    help="an epoch's finalize rides in the next epoch's first round (SparkConfig.pipeline_finalize)")
    ap.add_argument("--single-task-fallback", type=int, choices=(0, 1), default=1)
    ap.add_argument("--task-min-bytes", type=int, default=None,
                    help="payload bytes per extra task of a round (default: SparkConfig's); 1 = one task per core")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from charon.apps import ycsb
    from charon.bench.harness import save
    from charon.config import SparkConfig
    from charon.runtime.spark.runtime import SparkRuntime

    data = tempfile.mkdtemp(prefix="charon-bench-spark-")
    cfg = SparkConfig(master=args.master, data_dir=data, partitions=args.partitions, max_batch=20_000,
                      compact_every=50, pipeline_finalize=bool(args.pipeline_finalize),
                      single_task_fallback=bool(args.single_task_fallback))
    if args.task_min_bytes is not None:
        cfg.task_min_bytes = args.task_min_bytes
    rt = SparkRuntime("charon.apps.ycsb:app", cfg)
    t0 = time.time()
    rt.load("account", ycsb.initial_state(args.accounts))
    rt.start()
    print(f"[bench] Spark runtime up in {time.time() - t0:.1f}s ({args.master}, {args.partitions} partitions)",
          flush=True)
    results = []
    ctx = mp.get_context("spawn")
    try:
        for rate in [float(r) for r in args.rates.split(",")]:
            out = os.path.join(data, f"run-{rate}.json")
            before = len(rt.epoch_stats)
            p = ctx.Process(target=_generator, args=(data, rate, args.duration, args.warmup, args.accounts,
                                                     args.zipf, int(rate), out))
            p.start()
            p.join()
            if p.exitcode != 0 or not os.path.exists(out):
                print(f"[bench] rate {rate}: load generator failed ({p.exitcode})", flush=True)
                continue
            res = json.loads(Path(out).read_text())
            epochs = [e for e in rt.epoch_stats[before:] if e.get("size", 0) > 0]
            res.update({"system": "charon-spark", "experiment": "ycsb", "zipf": args.zipf, "rate": rate,
                        "breakdown": breakdown(epochs), "master": args.master, "variant": args.label,
                        "settings": {"pipeline_finalize": cfg.pipeline_finalize,
                                     "single_task_fallback": cfg.single_task_fallback,
                                     "task_min_bytes": cfg.task_min_bytes, "partitions": args.partitions}})
            results.append(res)
            lat = res.get("latency_ms", {})
            b = res["breakdown"]
            print(f"[bench] rate {rate:>7.0f}/s: committed {res.get('committed_per_s', 0):8.1f}/s "
                  f"p50 {lat.get('p50', float('nan')):7.1f} ms p99 {lat.get('p99', float('nan')):7.1f} ms "
                  f"unfinished {res.get('unfinished', 0)}; epoch {res['breakdown']['epoch_ms']:.0f} ms "
                  f"({b['spark_jobs_per_epoch']:.1f} jobs, {b['spark_tasks_per_epoch']:.1f} tasks, "
                  f"jobs {b['spark_jobs_ms']:.0f} ms)",
                  flush=True)
    finally:
        rt.close()
        shutil.rmtree(data, ignore_errors=True)
    suffix = f"_{args.label}" if args.label else ""
    path = save(results, Path(args.out) / f"spark_ycsb_zipf{args.zipf}{suffix}.json")
    print(f"[bench] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
