"""The watchdog's torture at length: 60 seeds x 2 SIGKILLed cycles x up to 300 epochs of the torture test's
``torture_cycle`` (every reply reproduced by replay, no escape, no leaked lock: the cycle asserts it). A
correctness run, not a timing: one JSON line per cycle, then the totals.

    .venv/bin/python benchmarks/recovery/watchdog_torture_long.py \
        > benchmarks/results/recovery/watchdog_torture_60_seeds.jsonl
"""

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "faults"))
sys.path.insert(0, str(ROOT))

from test_watchdog_torture import torture_cycle  # noqa: E402

t0 = time.time()
out = []
for seed in range(11, 71):
    with tempfile.TemporaryDirectory() as d:
        for c in range(2):
            f = torture_cycle(Path(d), seed, c, 300)
            f["seed"], f["cycle"] = seed, c
            out.append(f)
            print(json.dumps(f), flush=True)
tot = {k: sum(f[k] for f in out) for k in ("acked", "delivered", "deferred", "timeouts", "replayed_epochs")}
print(json.dumps({"total": tot, "cycles": len(out), "seconds": round(time.time() - t0)}), flush=True)
