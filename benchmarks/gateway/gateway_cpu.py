"""Issue 24, step 1: server CPU per request through HTTP on the durable in-process node, and a profile of it.

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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from charon.bench.harness import latency_summary
from charon.server.serve import free_port

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "results" / "gateway"
TOKEN = "t24"
KEYS = 1000


async def drive(url: str, concurrency: int, duration: float, warmup: float, proc: psutil.Process) -> dict:
    """Closed loop over `concurrency` keep-alive HTTP/1.1 connections with a lean hand-written client (a
    request is one write, a reply one header read and one body read), so that one client process can saturate
    the server: httpx's own cost (~1 ms per request) capped it at ~800/s."""
    host, port = url.removeprefix("http://").split(":")
    rng = random.Random(24)
    lat: list[float] = []
    state = {"measure": False, "stop": False, "n": 0, "errors": 0, "seq": 0}

    async def worker(w: int) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        while not state["stop"]:
            state["seq"] += 1
            i = state["seq"]
            a, b = rng.randrange(KEYS), rng.randrange(KEYS)
            body = b'{"args":["a%d",1]}' % b
            req = (b"POST /invoke/account/a%d/transfer HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
                   b"Content-Type: application/json\r\nIdempotency-Key: r%d-%d\r\nContent-Length: %d\r\n\r\n"
                   % (a, host.encode(), TOKEN.encode(), concurrency, i, len(body))) + body
            t = time.perf_counter()
            writer.write(req)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            j = head.lower().index(b"content-length:")
            n = int(head[j + 15:head.index(b"\r\n", j)])
            await reader.readexactly(n)
            dt = (time.perf_counter() - t) * 1000
            if state["measure"]:
                if status == 200:
                    state["n"] += 1
                    lat.append(dt)
                else:
                    state["errors"] += 1
        writer.close()

    tasks = [asyncio.create_task(worker(w)) for w in range(concurrency)]
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
    tmp = tempfile.mkdtemp(prefix="charon-i24-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(Path(sys.executable).parent / "charon"), "run", "charon.apps.ycsb:app", "--engine", "inprocess",
           "--data-dir", os.path.join(tmp, "data"), "--port", str(port), "--token", TOKEN]
    env = dict(os.environ)
    if args.src:
        env["PYTHONPATH"] = str(Path(args.src).resolve())
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp, env=env)
    rows = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("node did not start")
            time.sleep(0.1)
        r = httpx.post(f"{url}/admin/update", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120,
                       json={"id": "seed", "operator": "account", "function": "deposit", "args": [1_000_000],
                             "keys": [f"a{i}" for i in range(KEYS)]})
        r.raise_for_status()
        proc = psutil.Process(server.pid)
        for c in [int(x) for x in args.concurrency.split(",")]:
            spy = None
            if args.profile:
                raw = OUT / f"pyspy_c{c}{args.tag}.txt"
                spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                                        str(server.pid), "--format", "raw", "--threads", "-o", str(raw),
                                        "-r", str(args.rate),
                                        "-d", str(int(args.duration + args.warmup))],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            load0 = os.getloadavg()[0]
            row = asyncio.run(drive(url, c, args.duration, args.warmup, proc))
            row["loadavg_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
            row["profiled"] = bool(spy)
            if spy:
                spy.wait(60)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "cpus": os.cpu_count(), "rows": rows},
                                         indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
