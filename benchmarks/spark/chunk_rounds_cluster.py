"""Epochs in chunks on the Spark path without the one-task rest (a cluster: ``SparkExchange.one_task_rest`` is off
unless the master is local, and so is the one-task fallback): Spark jobs (rounds) per epoch and bytes of payload
shipped, whole epochs (chunk 0) against chunks (``EPOCH_CHUNK``); JSON + PNG.

Uniform YCSB-T transfers over 10k accounts (1,000 each), 4 partitions, one epoch. The Spark exchange's real task
function runs in this process (``run_job`` replaced: payloads and results pickled as on Spark), so the counts
are exact and independent of load: each round is one Spark job (~40 ms of PySpark each, whatever it carries),
and every round ships each busy partition's whole scratch (the epoch's overlay so far) both ways.

    .venv/bin/python benchmarks/spark/chunk_rounds_cluster.py --sizes 500,2000,4000,8000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(size: int, chunk: int | None, parts: int = 4, accounts: int = 10_000) -> dict:
    from charon import Request, serde
    from charon.apps import ycsb
    from charon.config import SparkConfig
    from charon.core.epoch import EpochCoordinator
    from charon.core.routing import partition_of, store_key
    from charon.runtime.spark.exchange import SparkExchange
    from charon.state.durable import DurableState

    class HereJobs(SparkExchange):
        def run_job(self, payloads):  # noqa: ANN001, ANN202
            return list(self.fn(payloads))

    rng = random.Random(1)
    reqs = [Request(uuid.uuid4().hex, "account", ycsb.key(rng.randrange(accounts)), "transfer",
                    serde.encode([ycsb.key(rng.randrange(accounts)), 1])) for _ in range(size)]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = SparkConfig(data_dir=tmp, partitions=parts, local_dir=os.path.join(tmp, "local"),
                          single_task_rest=False, single_task_fallback=False)
        durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
        by_pid: dict[int, list] = {}
        for k, v in ycsb.initial_state(accounts, balance=1000).items():
            by_pid.setdefault(partition_of("account", k, parts), []).append((store_key("account", k), serde.encode(v)))
        for pid in range(parts):
            durable.write_base(pid, -1, sorted(by_pid.get(pid, [])))
        ex = HereJobs(None, "charon.apps.ycsb:app", cfg)
        coord = EpochCoordinator(ycsb.app, ex, chunk=chunk)
        coord.next_due = float("inf")
        res = coord.run_epoch(0, [(0, r) for r in reqs])
        return {"size": size, "chunk": 0 if chunk == 0 else "EPOCH_CHUNK", "jobs": int(ex.stats["jobs"]),
                "bytes_out": int(ex.stats["bytes_out"]), "bytes_in": int(ex.stats["bytes_in"]),
                "conflicts": int(res.stats.get("conflicts", 0))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="500,2000,4000,8000")
    ap.add_argument("--out", default=str(HERE.parent / "results" / "spark" / "chunk_rounds_cluster"))
    args = ap.parse_args()
    rows = [measure(int(s), c) for s in args.sizes.split(",") for c in (0, None)]
    for r in rows:
        print(r)
    Path(args.out + ".json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for chunk in (0, "EPOCH_CHUNK"):
        sel = [r for r in rows if r["chunk"] == chunk]
        label = "whole epoch" if chunk == 0 else "chunks of EPOCH_CHUNK"
        axes[0].plot([r["size"] for r in sel], [r["jobs"] for r in sel], marker="o", label=label)
        axes[1].plot([r["size"] for r in sel], [(r["bytes_out"] + r["bytes_in"]) / 1e6 for r in sel], marker="o",
                     label=label)
    axes[0].set(xlabel="transactions per epoch", ylabel="Spark jobs (rounds) per epoch",
                title="round by round (no one-task rest)")
    axes[1].set(xlabel="transactions per epoch", ylabel="payload shipped per epoch (MB, both ways)")
    for a in axes:
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=100)


if __name__ == "__main__":
    main()
