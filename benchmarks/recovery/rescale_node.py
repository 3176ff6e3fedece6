"""The pause of an online rescale of the durable node engine (2 -> 4 -> 3 partitions) under load.

Closed-loop clients submit YCSB-T-style transfers (``charon.apps.holds``) to ``InProcessRuntime(data_dir=...)``
in this process; at ``t = duration/3`` and ``2*duration/3`` the runtime rescales (``await rt.rescale(n)``).
Reported per state size: each move's pause (wall time and this process's CPU time inside the move: flush of
pending checkpoints, re-placing every key group, writing the new layout's bases, switching ``node.json``),
and committed transactions per 100 ms around it. Wall times are disturbed by other work on the machine;
the CPU time is the steadier figure.

    .venv/bin/python benchmarks/recovery/rescale_node.py --keys 10000 100000 --duration 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

from charon import InProcessRuntime
from charon.apps.holds import app

OUT = Path(__file__).resolve().parents[1] / "results" / "recovery"


async def client(rt: InProcessRuntime, keys: int, seed: int, end: float, done: list[float]) -> None:
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    while loop.time() < end:
        a, b = rng.randrange(keys), rng.randrange(keys)
        if a == b:
            continue
        await rt.submit("acct", f"k{a}", "transfer", [f"k{b}", 1])
        done.append(time.perf_counter())


async def run(keys: int, duration: float, clients: int, fsync: bool) -> dict:
    tmp = tempfile.mkdtemp(prefix="charon-rescale-")
    try:
        rt = InProcessRuntime(app, partitions=2, data_dir=tmp, fsync=fsync)
        rt.load("acct", {f"k{i}": 1000 for i in range(keys)})
        done: list[float] = []
        moves = []
        async with rt:
            loop = asyncio.get_running_loop()
            t0 = time.perf_counter()
            end = loop.time() + duration
            tasks = [asyncio.create_task(client(rt, keys, s, end, done)) for s in range(clients)]
            for target in (4, 3):
                await asyncio.sleep(duration / 3)
                c0, w0 = time.process_time(), time.perf_counter()
                pause = await rt.rescale(target)
                moves.append({"to": target, "at_s": w0 - t0, "pause_s": pause,
                              "await_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0})
            await asyncio.gather(*tasks)
        total = sum(rt.entities("acct").values())
        assert total == 1000 * keys, "money is conserved"
        rt.close()
        buckets = [0] * (int(duration / 0.1) + 2)
        for t in done:
            i = int((t - t0) / 0.1)
            if 0 <= i < len(buckets):
                buckets[i] += 1
        return {"keys": keys, "fsync": fsync, "clients": clients, "duration_s": duration, "committed": len(done),
                "moves": moves, "per_100ms": buckets,
                "pauses": [{k: v for k, v in p.items() if k in ("from", "to", "epoch", "pause_s", "keys")}
                           for p in rt.rescale_pauses]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 2.8 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        xs = [i * 0.1 for i in range(len(r["per_100ms"]))]
        ax.plot(xs, [n * 10 for n in r["per_100ms"]], lw=1)
        for m in r["moves"]:
            ax.axvspan(m["at_s"], m["at_s"] + m["await_s"], color="tab:red", alpha=0.3)
            ax.annotate(f"-> {m['to']}: {m['pause_s'] * 1000:.0f} ms", (m["at_s"], 0), fontsize=8)
        ax.set_title(f"{r['keys']:,} accounts, durable node, rescale 2 -> 4 -> 3 under load")
        ax.set_ylabel("committed/s")
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--keys", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--fsync", action="store_true")
    a = p.parse_args()
    results = [asyncio.run(run(k, a.duration, a.clients, a.fsync)) for k in a.keys]
    for r in results:
        print(r["keys"], [(m["to"], round(m["pause_s"] * 1000, 1), round(m["cpu_s"] * 1000, 1)) for m in r["moves"]],
              r["committed"])
    (OUT / "rescale_node.json").write_text(json.dumps(
        {"command": "benchmarks/recovery/rescale_node.py --keys " + " ".join(str(k) for k in a.keys)
         + f" --duration {a.duration}", "results": results}, indent=1))
    plot(results, OUT / "rescale_node.png")


if __name__ == "__main__":
    main()
