"""Where the engine-alone path spends its time (sampling profile, no instrumentation).

    .venv/bin/py-spy record -r 2000 -f raw -o /tmp/engine.spy -- \
        .venv/bin/python benchmarks/engine/engine_profile.py run
    .venv/bin/python benchmarks/engine/engine_profile.py table /tmp/engine.spy     # markdown tables

``run``: the engine-alone workload of ``engine_perf.py`` (YCSB-T transfers in epochs of 1,000, 10k accounts,
4 partitions, the tuned collector a started runtime uses), ``--epochs`` measured epochs after 3 warm-up ones.
``table``: self and inclusive shares per function, and the hottest lines, of the samples under
``InProcessRuntime.run_epoch`` (the measured loop; py-spy attributes C functions to their Python caller).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time


def run(epochs: int) -> None:
    import gc
    import random
    import uuid

    from charon import InProcessRuntime, serde
    from charon.apps import ycsb
    from charon.messages import Request

    n = 10_000
    rng = random.Random(0)
    raw = [[(rng.randrange(n), rng.randrange(n), rng.randint(1, 10)) for _ in range(1000)] for _ in range(epochs + 3)]
    rt = InProcessRuntime(ycsb.app, partitions=4)
    rt.load("account", ycsb.initial_state(n))
    batches = [[Request(uuid.uuid4().hex, "account", ycsb.key(a), "transfer", serde.encode([ycsb.key(b), x]))
                for a, b, x in batch] for batch in raw]
    for b in batches[:3]:
        rt.run_epoch(b)
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    t = time.process_time()
    for b in batches[3:]:
        rt.run_epoch(b)
    print(f"{(time.process_time() - t) / (epochs * 1000) * 1e6:.2f} CPU us per transfer", file=sys.stderr)


def table(path: str, top: int) -> None:
    selfc: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    lines: collections.Counter[str] = collections.Counter()
    total = 0

    def name(f: str) -> str:
        m = re.match(r"(\S+) \((?:.*/)?([^/]+\.py):(\d+)\)", f)
        return f"{m.group(1)} ({m.group(2)})" if m else f

    with open(path) as fh:
        for line in fh:
            stack, cnt = line.rstrip().rsplit(" ", 1)
            frames = stack.split(";")
            start = next((i for i, f in enumerate(frames) if f.startswith("InProcessRuntime.run_epoch ")), None)
            if start is None:
                continue
            frames = frames[start:]
            n = int(cnt)
            total += n
            selfc[name(frames[-1])] += n
            lines[frames[-1]] += n
            for f in {name(f) for f in frames}:
                incl[f] += n
    print(f"{total} samples under InProcessRuntime.run_epoch\n")
    print("| function (file) | self % | inclusive % |\n|---|---|---|")
    for k, v in selfc.most_common(top):
        print(f"| `{k}` | {100 * v / total:.1f} | {100 * incl[k] / total:.1f} |")
    print("\n| inclusive % | function (file) |\n|---|---|")
    for k, v in incl.most_common(top):
        print(f"| {100 * v / total:.1f} | `{k}` |")
    print("\n| self % | line |\n|---|---|")
    for k, v in lines.most_common(top):
        print(f"| {100 * v / total:.1f} | `{k}` |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("run", "table"))
    ap.add_argument("path", nargs="?", help="table: py-spy's raw output")
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    if a.what == "run":
        run(a.epochs)
    else:
        table(a.path, a.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
