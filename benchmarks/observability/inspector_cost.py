"""What the invocation inspector costs per request: engine CPU with it on (the default) and off.

The in-process engine runs YCSB-T transfers (``charon.apps.ycsb``: a root and one call, two invocations) in epochs
of ``--epoch`` requests straight through ``InProcessRuntime.run_epoch`` (no gateway: the inspector's cost is in the
engine thread), over ``--accounts`` accounts; one mix without aborts and one where a tenth of the transfers overdraw
(an abort: a traceback is formatted and the abort logged, the log going nowhere). CPU time of the process
(``time.process_time``), the collector tuned as ``charon run`` tunes it; three modes interleaved, ``--reps`` times
each: off, the core's capture only (the partitions report each invocation, the store keeps nothing) and on; the
medians per request are reported. Beside them, ``timeit`` of the statement the core runs per invocation when on.

    .venv/bin/python benchmarks/observability/inspector_cost.py  # writes results/observability/inspector_cost.*
    .venv/bin/python benchmarks/observability/inspector_cost.py --quick    # a smoke run (figures not meaningful)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from charon import serde  # noqa: E402
from charon.apps import ycsb  # noqa: E402
from charon.core.tracebacks import format_traceback  # noqa: E402
from charon.messages import Request  # noqa: E402
from charon.runtime.control.inspector import InspectorSettings  # noqa: E402
from charon.runtime.node.inprocess import GC_THRESHOLD, InProcessRuntime  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "results" / "observability"


def run(mode: str, epochs: int, size: int, accounts: int, abort_every: int) -> float:
    """CPU µs per request of ``epochs`` epochs of ``size`` transfers (every ``abort_every``-th overdraws; 0: none)
    with the inspector ``mode``: off, on, or capture (the core observes, the store keeps nothing)."""
    rt = InProcessRuntime(ycsb.app, partitions=4, warmup_txns=0, gc_tuning=False,
                          inspector=InspectorSettings(enabled=mode == "on"))
    rt.coordinator.observe = mode != "off"
    rt.load("account", ycsb.initial_state(accounts, 10**9))
    gc.collect()
    gc.freeze()  # as charon run's tune_gc does at start: the loaded state is out of the collector's way
    gc.set_threshold(GC_THRESHOLD, 20, 100)
    n = 0
    batches = []
    for _ in range(epochs):
        batch = []
        for _ in range(size):
            amount = 10**12 if abort_every and n % abort_every == 0 else 1
            frm, to = ycsb.key((n * 7919) % accounts), ycsb.key((n * 104729 + 1) % accounts)
            batch.append(Request(f"r{n}", "account", frm, "transfer", serde.encode([to, amount]), 1.0))
            n += 1
        batches.append(batch)
    rt.run_epoch(batches[0])  # warm
    t0 = time.process_time()
    for b in batches[1:]:
        rt.run_epoch(b)
    cpu = (time.process_time() - t0) / (size * (epochs - 1)) * 1e6
    gc.unfreeze()  # the next run starts from the same collector state
    return cpu


def statement_ns() -> float:
    """ns of what ``PartitionUnit._process`` adds per invocation when observing (the test and the append)."""
    setup = "trace = []; tid, inv, op, key, fn, kind = 7, '0.1', 'account', 'a1', 'deposit', 1"
    stmt = "if trace is not None: trace.append((tid, inv, op, key, fn, kind))"
    n = 200_000
    best = min(timeit.repeat(stmt, setup, number=n, repeat=5))
    return best / n * 1e9


def traceback_us() -> float:
    """µs to format one abort's traceback (:func:`charon.core.tracebacks.format_traceback`, four user frames)."""
    def f(n: int) -> None:
        if n == 0:
            raise ValueError("no")
        f(n - 1)

    try:
        f(3)
    except ValueError as exc:
        err = exc
    n = 2000
    t0 = time.process_time()
    for _ in range(n):
        format_traceback(err)
    return (time.process_time() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=21)
    ap.add_argument("--epoch", type=int, default=1000)
    ap.add_argument("--accounts", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 3 epochs of 200, 1 repetition")
    ap.add_argument("--out", default=str(OUT / "inspector_cost"))
    a = ap.parse_args()
    if a.quick:
        a.epochs, a.epoch, a.reps = 3, 200, 1
    logging.getLogger("charon.requests").disabled = True  # the abort lines go nowhere (their cost is the record)
    mixes = {"commits": 0, "10% aborts": 10}
    load_before = os.getloadavg()
    res: dict[str, dict[str, object]] = {}
    for name, every in mixes.items():
        runs: dict[str, list[float]] = {"off": [], "capture": [], "on": []}
        for _ in range(a.reps):
            for mode, xs in runs.items():
                xs.append(run(mode, a.epochs, a.epoch, a.accounts, every))
        med = {m: statistics.median(xs) for m, xs in runs.items()}
        res[name] = {"runs_us": runs, "median_us": med,
                     "capture_ns_per_invocation": (med["capture"] - med["off"]) * 1000 / 2,
                     "on_minus_off_us_per_request": med["on"] - med["off"],
                     "overhead_pct": (med["on"] / med["off"] - 1) * 100}
        print(f"{name}: off {med['off']:.1f}, core capture only {med['capture']:.1f}, on {med['on']:.1f} µs/request "
              f"(on: {med['on'] - med['off']:+.2f} µs, {(med['on'] / med['off'] - 1) * 100:+.1f}%; capture: "
              f"{(med['capture'] - med['off']) * 500:+.0f} ns per invocation)")
    doc = {"what": "engine CPU per YCSB-T transfer (2 invocations): inspector off, core capture only, on",
           "results": res, "core_statement_ns": statement_ns(), "traceback_us": traceback_us(),
           "settings": vars(a), "python": platform.python_version(), "cpus": os.cpu_count(),
           "load_note": "CPU time of this process; other load on the machine still slows caches and frequency",
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip(),
           "command": " ".join(["python", *sys.argv])}
    Path(a.out.removesuffix(".json") + ".json").write_text(json.dumps(doc, indent=2) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(res)
    x = range(len(names))
    for j, (mode, label) in enumerate((("off", "inspector off"), ("capture", "core capture only"),
                                       ("on", "inspector on"))):
        ax.bar([i + (j - 1) * 0.27 for i in x], [res[n]["median_us"][mode] for n in names], 0.27,  # type: ignore[index]
               label=label)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("engine CPU µs per request (median)")
    ax.set_title("Invocation inspector: cost per request (in-process engine)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out.removesuffix(".json") + ".png", dpi=110)
    print(f"wrote {a.out.removesuffix('.json')}.json and .png")


if __name__ == "__main__":
    main()
