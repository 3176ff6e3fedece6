"""CPU of the contended fallback: TPC-C NewOrder+Payment (W=1) epochs on the in-process engine.

Runs epochs of a fixed size over the same request stream and reports, per epoch size, the engine CPU per
transaction (``time.process_time``, so other load on the machine disturbs it little), the committed share,
rounds per epoch (dry run + fallback), re-queued and deferred transactions. ``--profile`` prints a cProfile
of the largest size. Output: JSON (+ PNG with ``--plot``).

    .venv/bin/python benchmarks/engine/tpcc_fallback.py --sizes 100,500 --epochs 6 \
        --out benchmarks/results/engine/tpcc_fallback.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import time
from pathlib import Path

from charon import InProcessRuntime, serde
from charon.apps import tpcc
from charon.messages import Request


def _req(rid: str, r: tuple) -> Request:
    op, key, fn, args = r
    return Request(rid, op, key, fn, serde.encode(args))


def run(size: int, epochs: int, seed: int, partitions: int, profile: bool = False) -> dict:
    """Run ``epochs`` epochs of ``size`` TPC-C requests; returns the CPU and fallback figures."""
    rt = InProcessRuntime(tpcc.app, partitions=partitions, gc_tuning=False)
    tpcc.load(rt, tpcc.populate(1, tpcc.BENCH, seed=1))
    rng = random.Random(seed)
    batches = [[_req(f"r{e}-{i}", tpcc.next_request(rng, 1, tpcc.BENCH)) for i in range(size)]
               for e in range(epochs + 1)]
    rt.run_epoch(batches[0])  # warm-up
    prof = cProfile.Profile() if profile else None
    keys = ("rounds", "dry_rounds", "conflicts", "fast", "requeued", "deferred", "committed", "slow_rounds",
            "fast_rounds", "fallback_rounds", "outside")
    tot = dict.fromkeys(keys, 0.0)
    n = 0
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if prof:
        prof.enable()
    for b in batches[1:]:
        res = rt.run_epoch(b)
        n += res.stats["size"]
        for k in keys:
            tot[k] += res.stats.get(k, 0)
    if prof:
        prof.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    while rt.coordinator.deferred:  # finish what the last epoch deferred
        rt.run_epoch([])
    assert tpcc.check(rt.read_state, rt.read_items) == []
    out = {"size": size, "epochs": epochs, "transactions": n, "cpu_us_per_tx": cpu / n * 1e6,
           "wall_us_per_tx": wall / n * 1e6, "tx_per_cpu_s": n / cpu,
           **{f"{k}_per_epoch": v / epochs for k, v in tot.items()}}
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(35)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return out


def plot(rows: list[dict], path: str) -> None:
    """CPU per transaction and rounds per epoch, by variant and epoch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in rows))
    sizes = sorted({r["size"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(labels)
    for i, lab in enumerate(labels):
        by = {r["size"]: r for r in rows if r["label"] == lab}
        xs = [j + i * width for j in range(len(sizes))]
        axes[0].bar(xs, [by[s]["cpu_us_per_tx"] / 1000 if s in by else 0 for s in sizes], width, label=lab)
        axes[1].bar(xs, [by[s]["rounds_per_epoch"] if s in by else 0 for s in sizes], width, label=lab)
    for ax, title in zip(axes, ("engine CPU per transaction (ms)", "rounds per epoch"), strict=True):
        ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(sizes))])
        ax.set_xticklabels([f"{s}-tx epochs" for s in sizes])
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle("TPC-C NewOrder+Payment W=1, in-process engine (process_time)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100,500")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--label", default="")
    p.add_argument("--out", default="")
    p.add_argument("--plot", default="", help="only draw this PNG from --out's JSON")
    a = p.parse_args()
    if a.plot:
        plot(json.loads(Path(a.out).read_text()), a.plot)
        return
    sizes = [int(s) for s in a.sizes.split(",")]
    rows = []
    for s in sizes:
        r = run(s, a.epochs, a.seed, a.partitions, profile=a.profile and s == sizes[-1])
        r["label"] = a.label
        rows.append(r)
        print(json.dumps(r))
    if a.out:
        path = Path(a.out)
        old = json.loads(path.read_text()) if path.exists() else []
        old = [o for o in old if o.get("label") != a.label]
        path.write_text(json.dumps(old + rows, indent=1))


if __name__ == "__main__":
    main()
