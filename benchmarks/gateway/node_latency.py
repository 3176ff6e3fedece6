"""Latency of one invoke through the gateway of `charon run --engine inprocess`, per durability mode.

One client, one request in flight (YCSB-T deposits with Idempotency-Keys), after a warm-up; p50/p99 per mode:
``--ephemeral`` (volatile), durable with ``--no-fsync`` (survives a killed process) and durable with fsync per
epoch (the default: survives an OS crash). Modes are interleaved round by round so machine load hits all alike.

    .venv/bin/python benchmarks/gateway/node_latency.py --requests 300 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import httpx

from charon.bench.engines import start_node
from charon.bench.harness import percentile

MODES = {"ephemeral": ["--ephemeral"], "durable-no-fsync": ["--no-fsync"], "durable-fsync": []}
BEFORE: str | None = None  # --before CHECKOUT: also measure that checkout's (volatile) `charon run`
TOKEN = "lat"


def measure(mode: str, n: int, warmup: int) -> list[float]:
    flags = list(MODES.get(mode, []))
    # "before": that checkout's volatile node (its flags may differ); "ephemeral": no data directory
    node = start_node("charon.apps.ycsb:app", engine="inprocess", token=TOKEN, args=flags,
                      durable=mode not in ("before", "ephemeral"),
                      env={"PYTHONPATH": BEFORE or ""} if mode == "before" else None)
    try:
        with httpx.Client(base_url=node.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c:
            lat = []
            for i in range(warmup + n):
                t = time.perf_counter()
                r = c.post(f"/invoke/account/a{i % 100}/deposit", json={"args": [1]},
                           headers={"Idempotency-Key": f"{mode}-{i}"})
                ms = (time.perf_counter() - t) * 1000
                r.raise_for_status()
                if i >= warmup:
                    lat.append(ms)
            return lat
    finally:
        node.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "gateway"
                                         / "node_latency.json"))
    ap.add_argument("--before", default=None, help="a checkout of the code before (e.g. /work/main)")
    args = ap.parse_args()
    global BEFORE
    BEFORE = args.before
    modes = (["before"] if args.before else []) + list(MODES)
    lat: dict[str, list[float]] = {m: [] for m in modes}
    load = []
    for _ in range(args.rounds):
        for m in modes:
            load.append(os.getloadavg()[0])
            lat[m].extend(measure(m, args.requests, args.warmup))
    out = {m: {"n": len(v), "p50_ms": round(percentile(v, 50), 3), "p99_ms": round(percentile(v, 99), 3)}
           for m, v in lat.items()}
    out["loadavg_1min"] = [round(x, 2) for x in load]
    out["cpus"] = os.cpu_count()
    Path(args.out).write_text(json.dumps(out, indent=1))
    for m in modes:
        print(f"{m:18s} p50 {out[m]['p50_ms']:8.2f} ms  p99 {out[m]['p99_ms']:8.2f} ms  (n={out[m]['n']})")
    print(f"load average during the runs: {out['loadavg_1min']} on {out['cpus']} CPUs")


if __name__ == "__main__":
    main()
