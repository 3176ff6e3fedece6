"""Cost of one-request Deathstar epochs (the in-process engine at low rates: every request is its own epoch).

    .venv/bin/python benchmarks/engine/deathstar_epoch_cost.py                     # CPU µs per epoch, by request kind
    .venv/bin/python benchmarks/engine/deathstar_epoch_cost.py --perf              # + user instructions per epoch
    .venv/bin/python benchmarks/engine/deathstar_epoch_cost.py --src /tmp/before   # another checkout (before/after)
    .venv/bin/python benchmarks/engine/deathstar_epoch_cost.py --profile           # cProfile of the mix
    .venv/bin/python benchmarks/engine/deathstar_epoch_cost.py --perf --size 4     # epochs of 4 requests each
    .venv/bin/python benchmarks/engine/deathstar_epoch_cost.py --fixed             # fixed costs: empty epoch, rounds

Kinds: ``mix`` (the travel mix), ``search``, ``dis`` (recommend by distance), ``rp`` (recommend by rate or
price). CPU time is disturbed by a shared machine; ``--perf`` counts instructions (``perf stat -e
instructions:u``) of two runs that differ only in their number of epochs, so start-up cancels out (run with
``PYTHONHASHSEED=0`` for counts stable to ~1%).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from typing import Any


def _use_src(src: str | None) -> None:
    if src:
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                            and "editable" not in getattr(f, "__name__", "").lower()]
        sys.path.insert(0, src)


def _wanted(kind: str, fn: str, args: list) -> bool:
    if kind == "mix":
        return True
    if kind == "search":
        return fn == "search"
    if kind == "dis":
        return fn == "recommend" and args[2] == "dis"
    return fn == "recommend" and args[2] != "dis"  # rp


def _loaded_runtime() -> Any:
    """An in-process Deathstar runtime (4 partitions) loaded with the benchmark's data."""
    from charon import InProcessRuntime
    from charon.apps import deathstar

    rt = InProcessRuntime(deathstar.app, partitions=4)
    for op, key, value, items in deathstar.populate():
        if value is not None:
            rt.load(op, {key: value})
        if items:
            rt.load_items(op, key, items)
    return rt


def run(src: str | None, kinds: list[str], epochs: int, profile: bool, size: int = 1) -> dict[str, float]:
    """CPU µs per epoch of ``size`` requests of each kind (200 warm-up epochs first)."""
    _use_src(src)
    import cProfile
    import gc
    import pstats

    from charon import serde
    from charon.apps import deathstar
    from charon.messages import Request

    rt = _loaded_runtime()
    out = {}
    rng = random.Random(1)
    for kind in kinds:
        batches = []
        while len(batches) < epochs + 201:
            op, key, fn, args = deathstar.next_request(rng)
            if _wanted(kind, fn, args):
                req = Request(uuid.uuid4().hex, op, key, fn, serde.encode(args))
                if batches and len(batches[-1]) < size:
                    batches[-1].append(req)
                else:
                    batches.append([req])
        if len(batches[-1]) < size:
            batches.pop()
        for b in batches[:200]:
            rt.run_epoch(b)
        gc.collect()
        gc.freeze()
        pr = cProfile.Profile() if profile else None
        if pr is not None:
            pr.enable()
        t = time.process_time()
        for b in batches[200:200 + epochs]:
            rt.run_epoch(b)
        out[kind] = (time.process_time() - t) / epochs * 1e6
        if pr is not None:
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    return out


def instructions(src: str | None, kind: str, epochs: int, size: int = 1) -> float | None:
    """User instructions per epoch: perf stat of (epochs + 500) minus 500 epochs."""
    perf = shutil.which("perf")
    if perf is None:
        return None
    counts = []
    for n in (500, 500 + epochs):
        cmd = [perf, "stat", "-x,", "-e", "instructions:u", sys.executable, __file__, "--kinds", kind,
               "--epochs", str(n), "--size", str(size)] + (["--src", src] if src else [])
        err = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ).stderr
        line = next(x for x in err.splitlines() if "instructions" in x)
        counts.append(int(line.split(",")[0]))
    return (counts[1] - counts[0]) / epochs


MICRO = {
    "epoch_empty": "an epoch with no request (its finalize round included)",
    "round_empty": "a coordinator dry-run round delivering nothing (no partition stepped)",
    "round_final_idle": "a finalize round over 4 partitions the epoch never reached",
}


def micro(src: str | None, what: str, n: int) -> None:
    """Run ``n`` of one fixed-cost unit (see MICRO) on a loaded Deathstar runtime."""
    _use_src(src)
    from charon.core.epoch import _Track
    from charon.core.partition import Control

    rt = _loaded_runtime()
    c, stats = rt.coordinator, {}
    for i in range(n):
        if what == "epoch_empty":
            rt.run_epoch([])
        elif what == "round_empty":
            c._round(Control(5, Control.DRY), [], _Track(), stats)
        else:
            c._round(Control(5 + i, Control.FALLBACK, finalize=True), [], _Track(), stats)


def fixed_instructions(src: str | None) -> dict[str, float]:
    """User instructions of each fixed-cost unit: perf stat of 11,000 runs minus 1,000."""
    perf = shutil.which("perf")
    out = {}
    for what in MICRO:
        counts = []
        for n in (1000, 11000):
            cmd = [perf or "perf", "stat", "-x,", "-e", "instructions:u", sys.executable, __file__, "--micro", what,
                   "--epochs", str(n)] + (["--src", src] if src else [])
            err = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ).stderr
            counts.append(int(next(x for x in err.splitlines() if "instructions" in x).split(",")[0]))
        out[what] = (counts[1] - counts[0]) / 10000
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", help="a checkout to import charon from (default: the installed one)")
    ap.add_argument("--kinds", default="mix,search,dis,rp")
    ap.add_argument("--epochs", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--size", type=int, default=1, help="requests per epoch (default 1)")
    ap.add_argument("--perf", action="store_true", help="also count user instructions per epoch (perf stat)")
    ap.add_argument("--fixed", action="store_true", help="count the fixed costs (empty epoch, rounds) instead")
    ap.add_argument("--micro", choices=sorted(MICRO), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.micro:
        micro(a.src, a.micro, a.epochs)
        return 0
    if a.fixed:
        for what, ins in fixed_instructions(a.src).items():
            print(f"{what}: {ins:,.0f} user instructions ({MICRO[what]})", flush=True)
        return 0
    kinds = a.kinds.split(",")
    for kind, us in run(a.src, kinds, a.epochs, a.profile, a.size).items():
        line = f"{kind}: {us:.1f} us CPU per epoch of {a.size} request(s)"
        if a.perf:
            ins = instructions(a.src, kind, 1500, a.size)
            line += f", {ins:,.0f} user instructions per epoch" if ins is not None else " (no perf)"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
