"""Epochs in chunks (``charon.core.epoch.EPOCH_CHUNK``): instructions per transaction and Aria's conflict share by
epoch size, whole epochs (chunk 0) against chunks, for the in-process engine and the Spark task path; JSON + PNG.

Uniform YCSB-T transfers over 10k accounts, 4 partitions. Instructions are user-space ``perf stat -e
instructions:u`` of two child processes (2 warm-up epochs, then 0 or ``--epochs`` measured ones; the difference
per transaction), so the figures hardly move with the neighbours' load. ``spark`` runs the Spark runtime's real
exchange and task function in the child (``spark_epoch_structure.run``: pickled jobs, LMDB stores, the rest of
each epoch in one task, the previous epoch's finalize carried), as Spark's task would; its figure includes making
each epoch's requests (a few thousand instructions per transaction, the same for both variants).

    .venv/bin/python benchmarks/engine/epoch_chunks.py --sizes 1000,2000,4500,8000 --chunks 0,256
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = ROOT / "benchmarks" / "results" / "engine"


def child(path: str, size: int, chunk: int, epochs: int, total: int) -> dict:
    """Run in a child process: ``epochs`` measured epochs after 2 warm-up ones (requests for ``total`` made
    either way); returns the conflict share."""
    import gc
    import random
    import uuid

    import charon.core.epoch as ep

    ep.EPOCH_CHUNK = chunk
    if path == "spark":
        sys.path.insert(0, str(ROOT / "benchmarks" / "spark"))
        import spark_epoch_structure

        r = spark_epoch_structure.run("ycsb", "after", size, epochs=2 + epochs)
        return {"conflicts": r["fallback_share"]}
    from charon import InProcessRuntime, serde
    from charon.apps import ycsb
    from charon.messages import Request

    rng = random.Random(1)
    rt = InProcessRuntime(ycsb.app, partitions=4)
    rt.load("account", ycsb.initial_state(10_000))
    batches = [[Request(uuid.uuid4().hex, "account", ycsb.key(rng.randrange(10_000)), "transfer",
                        serde.encode([ycsb.key(rng.randrange(10_000)), rng.randint(1, 10)])) for _ in range(size)]
               for _ in range(2 + total)]
    for b in batches[:2]:
        rt.run_epoch(b)
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)  # as a started runtime tunes it
    conflicts = 0
    for b in batches[2:2 + epochs]:
        conflicts += rt.run_epoch(b).stats.get("conflicts", 0)
    return {"conflicts": conflicts / max(1, epochs * size)}


def instructions(path: str, size: int, chunk: int, epochs: int) -> dict:
    perf = shutil.which("perf")
    counts, info = [], {}
    for run in (0, epochs):
        cmd = [sys.executable, __file__, "--child", json.dumps([path, size, chunk, run, epochs])]
        if perf:
            cmd = [perf, "stat", "-x,", "-e", "instructions:u", *cmd]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False,
                           env={**os.environ, "PYTHONHASHSEED": "0"})
        if p.returncode != 0:
            raise RuntimeError(p.stderr[-2000:])
        if run:
            info = json.loads(p.stdout.strip().splitlines()[-1])
        lines = [ln for ln in p.stderr.splitlines() if "instructions" in ln]
        value = lines[-1].split(",")[0] if lines else ""
        counts.append(int(value) if value.isdigit() else None)
    per_tx = (counts[1] - counts[0]) / (epochs * size) if None not in counts else None
    return {"path": path, "size": size, "chunk": chunk, "instructions_per_tx": per_tx, **info}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,2000,4500,8000")
    ap.add_argument("--chunks", default="0,256")
    ap.add_argument("--paths", default="inprocess,spark")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        path, size, chunk, run, total = json.loads(a.child)
        print(json.dumps(child(path, size, chunk, run, total)))
        return 0
    rows = []
    for path in a.paths.split(","):
        for size in [int(x) for x in a.sizes.split(",")]:
            for chunk in [int(x) for x in a.chunks.split(",")]:
                r = instructions(path, size, chunk, a.epochs)
                rows.append(r)
                ipt = r["instructions_per_tx"]
                print(f"{path:9} epoch {size:5} chunk {chunk:4}: "
                      f"{'n/a' if ipt is None else f'{ipt / 1000:6.1f}K'} instructions/tx, "
                      f"conflicts {r['conflicts']:.1%}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "epoch_chunks.json").write_text(json.dumps(rows, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for path in a.paths.split(","):
        for chunk in [int(x) for x in a.chunks.split(",")]:
            pts = [r for r in rows if r["path"] == path and r["chunk"] == chunk]
            lbl = f"{path}, {'whole epoch' if chunk == 0 else f'chunks of {chunk}'}"
            ls = "-" if chunk else "--"
            ax1.plot([r["size"] for r in pts], [(r["instructions_per_tx"] or 0) / 1000 for r in pts], ls,
                     marker="o", label=lbl)
            ax2.plot([r["size"] for r in pts], [100 * r["conflicts"] for r in pts], ls, marker="o", label=lbl)
    ax1.set_xlabel("transactions per epoch")
    ax1.set_ylabel("thousand instructions / tx")
    ax1.set_ylim(bottom=0)
    ax2.set_xlabel("transactions per epoch")
    ax2.set_ylabel("conflicts (% of transactions)")
    ax1.legend(fontsize=7)
    fig.suptitle("YCSB-T uniform, 10k accounts: epochs whole vs in chunks", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "epoch_chunks.png", dpi=100)
    print(f"wrote {out / 'epoch_chunks.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
