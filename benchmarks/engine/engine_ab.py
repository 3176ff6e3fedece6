"""The engine alone (YCSB-T transfers, one core, no HTTP), before against after, alternating.

    .venv/bin/python benchmarks/engine/engine_ab.py --before-src /tmp/engine-base --repeat 5

``--before-src``: a checkout of the code before (``git worktree add --detach /tmp/engine-base 06716c6``); the after
side is this checkout. Each run is ``engine_perf.py``'s engine child in a fresh interpreter (batches of
1,000 transfers over 10k accounts, 4 partitions, default and tuned collector, plus the bare epoch loop in the same
process); the sides alternate, in ABBA order (the second child of a pair measured up to ~6% slower with the default
collector, whichever code it ran), so the neighbours' load hits both alike. Reported: per side the best of the runs'
medians (CPU µs per transaction), the after/before CPU-time ratio per run pair (the figure to trust on a loaded
machine) and its median, and the engine's share of the bare loop's rate. Writes JSON (git commits, date, load
average before and after each run) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from engine_perf import _count_instructions, _use_src, git_head, instruction_tool, run_child  # noqa: E402


def child_fixed(src: str | None, epochs: int, run: int) -> None:
    """The engine-alone workload with everything fixed (request ids from a seeded generator, not uuid4): three
    warm-up epochs, then ``run`` more, so that two processes differ only by the epochs run (see
    :func:`instructions`)."""
    _use_src(src)
    import gc
    import random

    from charon import InProcessRuntime, serde
    from charon.apps import ycsb
    from charon.messages import Request

    n = 10_000
    rng = random.Random(0)
    raw = [[(rng.randrange(n), rng.randrange(n), rng.randint(1, 10)) for _ in range(1000)] for _ in range(epochs)]
    rt = InProcessRuntime(ycsb.app, partitions=4)
    rt.load("account", ycsb.initial_state(n))
    batches = [[Request(f"{rng.getrandbits(128):032x}", "account", ycsb.key(a), "transfer",
                        serde.encode([ycsb.key(b), x])) for a, b, x in batch] for batch in raw]
    for b in batches[:3]:
        rt.run_epoch(b)
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    for b in batches[3:3 + run]:
        rt.run_epoch(b)


def instructions(src: str, epochs: int) -> float | None:
    """User-space instructions per transfer of ``epochs - 3`` epochs (perf stat, else Valgrind's cachegrind):
    the difference of two :func:`child_fixed` processes (``PYTHONHASHSEED=0``), per transaction."""
    # (one OpenBLAS thread: an imported numpy's idle BLAS threads spin, thousands of instructions per transfer of noise)
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")
    counts = []
    for run in (0, epochs - 3):
        n = _count_instructions([sys.executable, str(Path(__file__).resolve()), "--child",
                                 json.dumps({"src": src, "epochs": epochs, "run": run})], env)
        if n is None:
            return None
        counts.append(n)
    return (counts[1] - counts[0]) / ((epochs - 3) * 1000)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before-src", help="checkout of the code before the change (required)")
    ap.add_argument("--after-src", default=None, help="checkout of the code after (default: this checkout)")
    ap.add_argument("--repeat", type=int, default=5, help="run pairs (before, after alternating)")
    ap.add_argument("--epochs", type=int, default=23, help="epochs of 1,000 transfers per run (3 warm up)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine" / "engine_ab.json"))
    ap.add_argument("--instructions", type=int, default=0, metavar="EPOCHS",
                    help="also count user instructions per transfer over EPOCHS epochs (3 warm up) per side: perf "
                         "stat, else Valgrind (about 30x slower); load-independent")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child_fixed(**json.loads(a.child))
        return 0
    if not a.before_src:
        ap.error("--before-src is required")
    after_src = a.after_src or str(ROOT)
    sides = {"before": a.before_src, "after": after_src}
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": os.uname().nodename,
                 "cpus": os.cpu_count(), "commits": {s: git_head(p) for s, p in sides.items()},
                 "dirty_after": bool(subprocess.run(["git", "status", "--porcelain", "charon"], cwd=after_src,
                                                    capture_output=True, text=True).stdout.strip()),
                 "epochs": a.epochs, "runs": []}
    for i in range(a.repeat):
        pair = {}
        order = list(sides.items())
        for side, src in (order if i % 2 == 0 else order[::-1]):  # ABBA: the second child of a pair runs slower
            load0 = os.getloadavg()[0]
            r = run_child("engine", src=src, epochs=a.epochs)
            r["load_before"], r["load_after"] = load0, os.getloadavg()[0]
            pair[side] = r
            print(f"[{i}] {side:6}: default GC {r['default_gc']['us_per_tx_median']:6.2f}, tuned GC "
                  f"{r['tuned_gc']['us_per_tx_median']:6.2f} us/tx; bare loop {r['bare_loop_us']:.2f} us/tx; "
                  f"load {load0:.1f}->{r['load_after']:.1f}", flush=True)
        res["runs"].append(pair)
    summary: dict = {}
    for mode in ("default_gc", "tuned_gc"):
        ratios = [p["after"][mode]["us_per_tx_median"] / p["before"][mode]["us_per_tx_median"] for p in res["runs"]]
        s = {"ratio_per_pair": ratios, "ratio_median": statistics.median(ratios)}
        for side in sides:
            best = min(p[side][mode]["us_per_tx_median"] for p in res["runs"])
            bare = min(p[side]["bare_loop_us"] for p in res["runs"])
            s[side] = {"us_per_tx_best": best, "tx_per_s": 1e6 / best, "share_of_bare_loop": bare / best}
        summary[mode] = s
        print(f"{mode}: after/before CPU per tx, median of pairs {s['ratio_median']:.3f} "
              f"({', '.join(f'{r:.3f}' for r in ratios)}); best before {s['before']['tx_per_s']:,.0f}/s, "
              f"after {s['after']['tx_per_s']:,.0f}/s", flush=True)
    if a.instructions:
        ins = {side: instructions(src, a.instructions) for side, src in sides.items()}
        if None in ins.values():
            print("instructions: not counted (neither perf stat nor valgrind could count a child)", flush=True)
        else:
            summary["instructions_per_tx"] = ins
            summary["instructions_tool"] = instruction_tool()
            summary["instructions_ratio"] = ins["after"] / ins["before"]  # type: ignore[operator]
            print(f"instructions per transfer ({instruction_tool()}): before {ins['before']:,.0f}, after "
                  f"{ins['after']:,.0f}, ratio {summary['instructions_ratio']:.3f}", flush=True)
    res["summary"] = summary
    out = Path(a.out)
    out.write_text(json.dumps(res, indent=1))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, mode in zip(axes, ("default_gc", "tuned_gc"), strict=True):
        for side, style in (("before", "o--"), ("after", "o-")):
            ax.plot([p[side][mode]["us_per_tx_median"] for p in res["runs"]], style, label=side)
        ax.set_xlabel("run pair (alternating)")
        ax.set_ylabel("CPU µs per transfer (median of chunks)")
        r = res["summary"][mode]["ratio_median"]
        ax.set_title(f"engine alone, {mode.replace('_gc', ' GC')}: after/before {r:.3f}")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(f"{res['date']} (shared machine: compare the ratios)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
