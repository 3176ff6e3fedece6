"""Issue 10, engine15: instructions and CPU time per YCSB-T transaction of the engine alone, before and after.

``python benchmarks/issue10/engine15.py --before-src DIR [--out benchmarks/issue10/engine15.json]`` where DIR holds
another checkout's ``charon/`` (e.g. ``git archive main | tar -x -C DIR``); "after" is the installed package.
Instructions (``perf stat``, PYTHONHASHSEED=0, 40 measured epochs of 1,000 transfers): five runs per side, the
median; by shape too. CPU µs/tx (tuned GC, process time): three runs per side alternating, the best median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engine_perf as ep  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--before-src", required=True)
    p.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    sides = {"before": a.before_src, "after": None}
    res: dict = {"when": time.time(), "cpus": os.cpu_count(), "load_before": os.getloadavg(), "sides": {}}
    for side, src in sides.items():
        vals = [ep.engine_instructions(src, 43, hash_seed="0") for _ in range(a.runs)]
        shapes = {s: ep.engine_instructions(src, 43, s, hash_seed="0") for s in ep.SHAPES}
        res["sides"][side] = {"instructions_per_tx_runs": vals, "instructions_per_tx": statistics.median(vals),
                              "shapes": shapes, "cpu_us_per_tx_runs": []}
        print(side, statistics.median(vals), shapes, flush=True)
    for _ in range(3):  # alternate: the neighbours' load hits both alike
        for side, src in sides.items():
            r = ep.run_child("engine", src=src, epochs=23)
            res["sides"][side]["cpu_us_per_tx_runs"].append(r["tuned_gc"]["us_per_tx_median"])
    for side in sides:
        d = res["sides"][side]
        d["cpu_us_per_tx_best"] = min(d["cpu_us_per_tx_runs"])
        print(side, d["cpu_us_per_tx_runs"], flush=True)
    res["load_after"] = os.getloadavg()
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
