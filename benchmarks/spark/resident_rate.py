"""The resident Spark runtime alone (no HTTP), open loop at a fixed rate: request latency from each request's due
time, the epochs' size and duration, and the driver-side duration of each kind of round (issue 32's diagnosis:
where an epoch's time goes). Bank transfers between ``--accounts`` accounts on ``local[2]``, ``--partitions``
engine partitions; JSON on stdout (the last line).

Round kinds: ``dry`` (a dry-run round), ``priordry`` (an epoch's first round carrying the previous epoch's deferred
finalize), ``fin`` (a round that finalizes its own epoch), ``fast`` (a fallback round).

    .venv/bin/python benchmarks/spark/resident_rate.py --rate 500 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

from charon import serde
from charon.apps import ycsb
from charon.config import SparkConfig
from charon.runtime.spark import resident
from charon.runtime.spark.runtime import SparkRuntime


def timed_rounds() -> dict[str, list[float]]:
    """Wrap :meth:`ResidentExchange.round` to time each round by its kind (this process only)."""
    acc: dict[str, list[float]] = defaultdict(list)
    real = resident.ResidentExchange.round

    def round_(self: resident.ResidentExchange, control: Any, inboxes: list[list]) -> Any:
        t0 = time.perf_counter()
        try:
            return real(self, control, inboxes)
        finally:
            kind = ("prior" if control.prior is not None else "") + ("fast" if control.fast else "") + (
                "fin" if control.finalize else "") + ("dry" if control.phase == control.DRY else "")
            acc[kind or "plain"].append((time.perf_counter() - t0) * 1000)

    resident.ResidentExchange.round = round_  # type: ignore[method-assign]
    return acc


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=500.0)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--accounts", type=int, default=10_000)
    ap.add_argument("--partitions", type=int, default=SparkConfig(master="local[2]").default_partitions(),
                    help="engine partitions (default: what charon run gives a new deployment on local[2])")
    ap.add_argument("--compact-every", type=int, default=SparkConfig.compact_every)
    ap.add_argument("--warm", type=int, default=50, help="single transfers first (the gang's launch, restores)")
    a = ap.parse_args()
    rounds = timed_rounds()
    cfg = SparkConfig(master="local[2]", data_dir=tempfile.mkdtemp(prefix="resident-rate-"),
                      partitions=a.partitions, exchange="resident",
                      compact_every=a.compact_every)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg)
    rt.load_rows(("account", ycsb.key(i), "", serde.encode(10_000)) for i in range(a.accounts))
    rt.start()
    rng = random.Random(5)
    first = [-1]  # the last epoch of the warm-up

    def args() -> tuple[str, list[Any]]:
        return ycsb.key(rng.randrange(a.accounts)), [ycsb.key(rng.randrange(a.accounts)), 1]

    async def run() -> list[float]:
        for i in range(a.warm):
            key, xs = args()
            await rt.submit("account", key, "transfer", xs, request_id=f"w{i}", timeout=600)
        for v in rounds.values():
            v.clear()
        first[0] = int(rt.epoch_stats[-1]["epoch"]) if rt.epoch_stats else -1
        lat: list[float] = []

        async def one(i: int, due: float) -> None:
            key, xs = args()
            await rt.submit("account", key, "transfer", xs, request_id=f"r{i}", timeout=600)
            lat.append((time.perf_counter() - due) * 1000)

        t0, n, tasks = time.perf_counter(), int(a.rate * a.duration), []
        for i in range(n):
            due = t0 + i / a.rate
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.ensure_future(one(i, due)))
        await asyncio.gather(*tasks)
        return lat

    try:
        lat = asyncio.run(run())
        epochs = [s for s in rt.epoch_stats if s["epoch"] > first[0] and "duration_ms" in s]
    finally:
        rt.stop()
    out = {"rate": a.rate, "duration_s": a.duration, "partitions": a.partitions, "requests": len(lat),
           "latency_ms": {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99)},
           "epoch_ms_p50": statistics.median(s["duration_ms"] for s in epochs),
           "epoch_size_p50": statistics.median(s.get("size", 0) for s in epochs),
           "rounds_ms_p50": {k: round(statistics.median(v), 2) for k, v in rounds.items() if v},
           "rounds_count": {k: len(v) for k, v in rounds.items() if v},
           "loadavg": os.getloadavg()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
