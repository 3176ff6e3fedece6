"""Gateway overhead: HTTP invoke through `charon run` (a separate process) vs a direct in-process submit.

Both measured in the same run, closed loop at a fixed number of requests in flight, YCSB-T deposits.

    .venv/bin/python benchmarks/gateway/gateway_overhead.py --requests 3000 --concurrency 1,16,64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from charon.bench.engines import start_node
from charon.bench.harness import latency_summary

OUT = Path(__file__).resolve().parents[1] / "results" / "gateway"
TOKEN = "bench"


async def closed_loop(call, n: int, concurrency: int) -> dict:
    lat: list[float] = []
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            t = time.perf_counter()
            await call(i)
            lat.append((time.perf_counter() - t) * 1000)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"requests_per_s": n / wall, "latency_ms": latency_summary(lat), "requests": n}


async def direct(n: int, concurrency: int) -> dict:
    from charon import InProcessRuntime
    from charon.apps import ycsb

    async with InProcessRuntime(ycsb.app, partitions=4) as rt:
        async def call(i: int) -> None:
            rep = await rt.submit("account", f"a{i % 1000}", "deposit", [1])
            assert rep.ok
        return await closed_loop(call, n, concurrency)


async def http(url: str, n: int, concurrency: int) -> dict:
    from charon.client import AsyncClient

    async with AsyncClient(url, token=TOKEN) as client:
        async def call(i: int) -> None:
            await client.invoke("account", f"a{i % 1000}", "deposit", 1)
        return await closed_loop(call, n, concurrency)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--out", default=str(OUT / "gateway_overhead.json"))
    args = ap.parse_args(argv)
    # no --data-dir: the node's own default, in its temporary working directory
    node = start_node("charon.apps.ycsb:app", engine="inprocess", token=TOKEN, durable=False)
    try:
        rows = []
        for c in [int(x) for x in args.concurrency.split(",")]:
            d = asyncio.run(direct(args.requests, c))
            h = asyncio.run(http(node.url, args.requests, c))
            rows.append({"concurrency": c, "direct": d, "http": h,
                         "throughput_ratio_http_over_direct": h["requests_per_s"] / d["requests_per_s"],
                         "p50_ratio_http_over_direct": h["latency_ms"]["p50"] / d["latency_ms"]["p50"]})
            print(f"concurrency {c:>3}: direct {d['requests_per_s']:8.0f}/s p50 {d['latency_ms']['p50']:6.2f} ms | "
                  f"http {h['requests_per_s']:7.0f}/s p50 {h['latency_ms']['p50']:6.2f} ms "
                  f"p99 {h['latency_ms']['p99']:6.2f} ms", flush=True)
    finally:
        node.stop(timeout=30)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
