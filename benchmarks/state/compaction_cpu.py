"""CPU of one snapshot (a compaction of a partition's durable copy) and of an executor's restore at scale:
the Python-object merge (base + deltas into a dict, sorted, written row by row) against the Arrow merge
(:meth:`DurableState.load_table`: concatenate, sort, keep the newest row per key) in the same process.

    .venv/bin/python benchmarks/state/compaction_cpu.py --keys 250000 --deltas 20 --delta-keys 600

250,000 keys is one of four partitions of the 1M-account YCSB-T state; a delta is one epoch's writes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "results" / "state"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=250_000)
    ap.add_argument("--deltas", type=int, default=20)
    ap.add_argument("--delta-keys", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(OUT / "compaction_cpu.json"))
    args = ap.parse_args(argv)

    import random

    from charon import serde
    from charon.core.routing import store_key
    from charon.state.durable import DurableState

    rng = random.Random(0)
    root = tempfile.mkdtemp(prefix="charon-compaction-")
    try:
        d = DurableState(root, fsync=False)
        keys = sorted(store_key("account", f"a{i}") for i in range(args.keys))
        d.write_base(0, -1, [(k, serde.encode(1_000_000)) for k in keys])
        for e in range(args.deltas):
            d.write_delta(0, e, {keys[rng.randrange(args.keys)]: serde.encode(rng.randrange(10**6))
                                 for _ in range(args.delta_keys)})
        m = d.manifest(0)

        def python_path() -> int:
            state, reached = d._merge(0, m, m.epoch)
            name = d._write_base_file(0, reached, sorted(state.items()))
            os.remove(d._path(0, name))
            return len(state)

        def arrow_path() -> int:
            table, reached = d._merge_table(0, m, m.epoch)
            name = d._write_base_table(0, reached, table)
            os.remove(d._path(0, name))
            return table.num_rows

        def restore_python() -> int:
            state, _ = d.load(0)
            return len(sorted(state.items()))

        def restore_arrow() -> int:
            from charon.state.lmdbstore import _rows

            table, _ = d.load_table(0)
            return sum(1 for _ in _rows(table))

        res: dict = {"command": " ".join([".venv/bin/python", "benchmarks/state/compaction_cpu.py", *sys.argv[1:]]),
                     "keys": args.keys, "deltas": args.deltas, "delta_keys": args.delta_keys}
        for name, fn in [("snapshot_python", python_path), ("snapshot_arrow", arrow_path),
                         ("restore_rows_python", restore_python), ("restore_rows_arrow", restore_arrow)]:
            cpu = []
            for _ in range(args.repeat):
                c0 = time.process_time()
                n = fn()
                cpu.append(time.process_time() - c0)
            res[name] = {"rows": n, "cpu_s_min": min(cpu), "cpu_s": cpu}
        assert res["snapshot_python"]["rows"] == res["snapshot_arrow"]["rows"]
        res["snapshot_speedup"] = res["snapshot_python"]["cpu_s_min"] / res["snapshot_arrow"]["cpu_s_min"]
        res["restore_speedup"] = res["restore_rows_python"]["cpu_s_min"] / res["restore_rows_arrow"]["cpu_s_min"]
        res["load_average"] = os.getloadavg()[0]
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
