"""Single bank transfers one at a time through the Spark runtime (request appended to the input log -> reply read
from the output log), per Spark mode: ``resident`` (the direct sequencer over the resident gang, the default) and
``jobs`` (a Structured Streaming micro-batch per epoch, a Spark job per round). Prints p50/p90 of the request
latency and of the epochs' own duration (issue 32 step 2's smoke; the quiet benchmarks are separate).

    python benchmarks/spark/resident_singles.py --modes resident,jobs --count 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time

from charon import serde
from charon.apps import ycsb
from charon.config import SparkConfig
from charon.runtime.spark.runtime import SparkRuntime
from charon.runtime.spark.session import make_session


def _p(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def run(spark: object, mode: str, count: int, accounts: int, warm: int) -> dict[str, float]:
    cfg = SparkConfig(master="local[2]", data_dir=tempfile.mkdtemp(prefix=f"singles-{mode}-"), partitions=4,
                      exchange=mode)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg, spark=spark)
    rt.load_rows(("account", ycsb.key(i), "", serde.encode(100)) for i in range(accounts))
    rt.start()
    rng = random.Random(5)
    try:
        async def singles() -> list[float]:
            out = []
            for i in range(warm + count):
                t0 = time.perf_counter()
                await rt.submit("account", ycsb.key(rng.randrange(accounts)), "transfer",
                                [ycsb.key(rng.randrange(accounts)), 1], request_id=f"s{i}", timeout=600)
                out.append((time.perf_counter() - t0) * 1000)
            return out[warm:]

        lat = asyncio.run(singles())
        epochs = [s["duration_ms"] for s in rt.epoch_stats[-count:] if "duration_ms" in s]
    finally:
        rt.stop()
    return {"mode": mode, "count": count, "p50_ms": statistics.median(lat), "p90_ms": _p(lat, 0.9),
            "epoch_p50_ms": statistics.median(epochs) if epochs else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="resident,jobs")
    ap.add_argument("--count", type=int, default=60)
    ap.add_argument("--warm", type=int, default=5, help="requests sent first and not counted (launch, restores)")
    ap.add_argument("--accounts", type=int, default=1000)
    args = ap.parse_args()
    spark = make_session(SparkConfig(master="local[2]"))
    try:
        for mode in args.modes.split(","):
            r = run(spark, mode, args.count, args.accounts, args.warm)
            print(json.dumps(r))
            print(f"{mode}: {args.count} single transfers one at a time: p50 {r['p50_ms']:.1f} ms, "
                  f"p90 {r['p90_ms']:.1f} ms (the epoch itself p50 {r['epoch_p50_ms']:.1f} ms)", flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
