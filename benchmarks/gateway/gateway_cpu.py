"""Server CPU per request through HTTP on the durable in-process node, and a profile of it.

Starts `charon run charon.apps.ycsb:app --data-dir DIR --token T` (fsync per epoch) in its own process, seeds
the accounts with one POST /admin/update (deposit on every key), then drives YCSB-T transfers from this process
(closed loop, keep-alive HTTP/1.1 connections of a lean client, one Idempotency-Key per request) for --duration
seconds and reads the server's CPU seconds (psutil, user + system) before and after: CPU per request = delta / requests.
With --profile, py-spy samples the server during the measured window (raw collapsed stacks, --format raw).

    .venv/bin/python benchmarks/gateway/gateway_cpu.py --concurrency 64 --duration 15
    .venv/bin/python benchmarks/gateway/gateway_cpu.py --concurrency 64 --duration 15 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import psutil

from charon.bench.engines import ConnectionPool, HttpConnection, start_node, transfer_request
from charon.bench.harness import latency_summary

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "results" / "gateway"
TOKEN = "t24"
KEYS = 1000


async def drive(url: str, concurrency: int, duration: float, warmup: float, proc: psutil.Process) -> dict:
    """Closed loop over `concurrency` keep-alive HTTP/1.1 connections with a lean hand-written client
    (:class:`charon.bench.engines.ConnectionPool`: a request is one write, a reply one header read and one body
    read), so that one client process can saturate the server: httpx's own cost (~1 ms per request) capped it at
    ~800/s."""
    rng = random.Random(24)
    lat: list[float] = []
    state = {"measure": False, "stop": False, "n": 0, "errors": 0, "seq": 0}
    pool = ConnectionPool(url, concurrency)
    host, token = pool.host.encode(), TOKEN.encode()

    async def worker(conn: HttpConnection) -> None:
        while not state["stop"]:
            state["seq"] += 1
            i = state["seq"]
            a, b = rng.randrange(KEYS), rng.randrange(KEYS)
            req = transfer_request(host, token, a, b, 1, b"r%d-%d" % (concurrency, i))
            t = time.perf_counter()
            status, _ = await conn.send(req)
            dt = (time.perf_counter() - t) * 1000
            if state["measure"]:
                if status == 200:
                    state["n"] += 1
                    lat.append(dt)
                else:
                    state["errors"] += 1

    async with pool:
        tasks = [asyncio.create_task(worker(c)) for c in pool.connections]
        await asyncio.sleep(warmup)
        th0 = {t.id: t.user_time + t.system_time for t in proc.threads()}
        cpu0, t0 = proc.cpu_times(), time.perf_counter()
        state["measure"] = True
        await asyncio.sleep(duration)
        state["measure"] = False
        cpu1, t1 = proc.cpu_times(), time.perf_counter()
        th1 = {t.id: t.user_time + t.system_time for t in proc.threads()}
        state["stop"] = True
        await asyncio.gather(*tasks)
    wall = t1 - t0
    user, system = cpu1.user - cpu0.user, cpu1.system - cpu0.system
    n = state["n"]
    return {"concurrency": concurrency, "requests": n, "errors": state["errors"], "wall_s": round(wall, 3),
            "requests_per_s": round(n / wall, 1), "server_cpu_s": round(user + system, 3),
            "server_user_s": round(user, 3), "server_system_s": round(system, 3),
            "server_cpu_us_per_request": round((user + system) / n * 1e6, 1) if n else None,
            "server_cpu_utilisation": round((user + system) / wall, 3), "latency_ms": latency_summary(lat),
            "server_thread_cpu_s": {str(k): round(v - th0.get(k, 0.0), 3) for k, v in th1.items()
                                    if v - th0.get(k, 0.0) > 0.005}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", default="64")
    ap.add_argument("--duration", type=float, default=15)
    ap.add_argument("--warmup", type=float, default=3)
    ap.add_argument("--profile", action="store_true", help="py-spy record the server during the window")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--tag", default="")
    ap.add_argument("--src", default=None, help="run the server from this checkout's charon package (A/B)")
    ap.add_argument("--out", default=str(OUT / "gateway_cpu.json"))
    args = ap.parse_args(argv)
    node = start_node("charon.apps.ycsb:app", engine="inprocess", token=TOKEN, src=args.src)
    rows = []
    try:
        node.seed(KEYS, 1_000_000, timeout=120)
        proc = psutil.Process(node.pid)
        for c in [int(x) for x in args.concurrency.split(",")]:
            spy = None
            if args.profile:
                raw = OUT / f"pyspy_c{c}{args.tag}.txt"
                spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                                        str(node.pid), "--format", "raw", "--threads", "-o", str(raw),
                                        "-r", str(args.rate),
                                        "-d", str(int(args.duration + args.warmup))],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            load0 = os.getloadavg()[0]
            row = asyncio.run(drive(node.url, c, args.duration, args.warmup, proc))
            row["loadavg_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            row["profiled"] = bool(spy)
            if spy:
                spy.wait(60)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        node.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "cpus": os.cpu_count(), "rows": rows},
                                         indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
