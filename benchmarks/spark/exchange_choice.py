"""Which Spark exchange carries a round best: RDD (parallelize + mapPartitions) or DataFrame mapInArrow.

Each variant ships the same per-partition payloads (bytes of a given size) to tasks that return them,
as a round of the epoch protocol does; local[2], UDS on. Reports ms per round (median of N).

    .venv/bin/python benchmarks/spark/exchange_choice.py --partitions 4 --sizes 1000,100000,1000000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _echo(items):
    yield from items


def _echo_arrow(batches):
    yield from batches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--sizes", default="1000,100000,1000000")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "spark"
                                         / "exchange_choice.json"))
    args = ap.parse_args(argv)
    from charon.config import SparkConfig
    from charon.runtime.spark.session import make_session

    spark = make_session(SparkConfig(master="local[2]", partitions=args.partitions))
    sc = spark.sparkContext
    slots = min(args.partitions, sc.defaultParallelism)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        payloads = [(p, bytes(size)) for p in range(args.partitions)]
        rdd_ms, arrow_ms = [], []
        df = spark.createDataFrame(payloads, "pid int, payload binary").repartition(slots).cache()
        df.count()
        for i in range(args.repeat + 2):
            t = time.perf_counter()
            out = sc.parallelize(payloads, slots).mapPartitions(_echo).collect()
            if i >= 2:
                rdd_ms.append((time.perf_counter() - t) * 1000)
            assert len(out) == args.partitions
            t = time.perf_counter()
            got = spark.createDataFrame(payloads, "pid int, payload binary").repartition(slots) \
                .mapInArrow(_echo_arrow, "pid int, payload binary").toArrow()
            if i >= 2:
                arrow_ms.append((time.perf_counter() - t) * 1000)
            assert got.num_rows == args.partitions
        rows.append({"payload_bytes_per_partition": size, "rdd_ms_p50": statistics.median(rdd_ms),
                     "arrow_ms_p50": statistics.median(arrow_ms)})
        print(rows[-1], flush=True)
    spark.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
