"""Open-loop HTTP/1.1 load generator for the end-to-end YCSB-T benchmark (runs in its own process).

Requests are *scheduled* at a fixed rate (request i is due at ``start + i / rate``) whatever the replies do, and
each latency is measured from its due time, so a server that stalls is charged for every request it delayed
(no coordinated omission). A scheduler task wakes every millisecond and queues every request that has become due;
``--connections`` worker tasks each own one keep-alive connection and a lean hand-written client (a request is
one write; a reply is one header read and one body read: httpx costs ~1 ms of CPU per request, too much for one
client process at these rates). A request that waits for a free connection is late from its due time, as it
would be for a real client.

Every transfer is ``POST /invoke/account/a<debtor>/transfer`` with ``{"args": ["a<creditor>", amount]}``, a
bearer token and a fresh ``Idempotency-Key``: the same request for every target. 200 is a committed transfer,
409 an abort (insufficient funds); anything else, a broken connection or no reply by the end of the drain is an
error.

During the measured window (requests due in ``[warmup, warmup + duration)``) it reads the CPU seconds of the
processes named with ``--watch NAME=PID`` (``NAME=PID+`` adds all their descendants, e.g. the PostgreSQL
postmaster's backends or Spark's JVM) and of itself, and the load average. It prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time

import psutil

from charon.bench.engines import HttpConnection, transfer_request


def cpu_snapshot(pid: int, tree: bool) -> dict[int, float]:
    """CPU seconds (user + system) of ``pid`` and, with ``tree``, of each of its descendants."""
    out: dict[int, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)] if tree else [root]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two snapshots (processes that started in between count from zero)."""
    return sum(v - before.get(pid, 0.0) for pid, v in after.items())


def percentile(sorted_ms: list[float], q: float) -> float | None:
    if not sorted_ms:
        return None
    k = min(len(sorted_ms) - 1, max(0, math.ceil(q / 100 * len(sorted_ms)) - 1))  # nearest rank
    return round(sorted_ms[k], 3)


async def run(args: argparse.Namespace) -> dict:
    host, port = args.url.removeprefix("http://").rstrip("/").split(":")
    rng = random.Random(args.seed)
    total_s = args.warmup + args.duration
    n_total = int(total_s * args.rate)
    due_q: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
    # per request: (due relative to start, done relative to start, status); status 0 = connection error
    results: list[tuple[float, float, int]] = []
    token = args.token.encode()
    hostb = host.encode()
    prefix = args.prefix.encode()
    watch = []
    for w in args.watch:
        name, _, pid = w.partition("=")
        watch.append((name, int(pid.rstrip("+")), pid.endswith("+")))
    me = psutil.Process()
    snaps: dict[str, dict] = {}
    lag: list[float] = []  # how late the scheduler queued requests (ms): the generator keeping up

    def request(i: int) -> bytes:
        a, b = rng.randrange(args.keys), rng.randrange(args.keys)
        while b == a and args.keys > 1:
            b = rng.randrange(args.keys)
        return transfer_request(hostb, token, a, b, rng.randint(1, args.max_amount), b"%s%d" % (prefix, i))

    async def worker(conn: HttpConnection) -> None:
        await conn.open()
        try:
            while True:
                i, due = await due_q.get()
                if i < 0:
                    return
                try:
                    status, _ = await conn.send(request(i))
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    results.append((due, time.perf_counter() - t0, 0))
                    await conn.reopen()
                    continue
                results.append((due, time.perf_counter() - t0, status))
        finally:
            conn.close()

    t0 = time.perf_counter() + 0.5  # the connections open first
    workers = [asyncio.create_task(worker(HttpConnection(host, int(port)))) for _ in range(args.connections)]
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    i = 0
    measuring = False
    while i < n_total:
        now = time.perf_counter() - t0
        if not measuring and now >= args.warmup:
            measuring = True
            snaps["start"] = {n: cpu_snapshot(p, tree) for n, p, tree in watch}
            snaps["start"]["generator"] = cpu_snapshot(me.pid, False)
            snaps["load_before"] = os.getloadavg()  # type: ignore[assignment]
        while i < n_total and i / args.rate <= now:
            due = i / args.rate
            if args.warmup <= due < total_s:
                lag.append((now - due) * 1000)
            due_q.put_nowait((i, due))
            i += 1
        await asyncio.sleep(0.001)
    while time.perf_counter() - t0 < total_s:
        await asyncio.sleep(0.001)
    snaps["end"] = {n: cpu_snapshot(p, tree) for n, p, tree in watch}
    snaps["end"]["generator"] = cpu_snapshot(me.pid, False)
    load_after = os.getloadavg()
    for _ in workers:
        due_q.put_nowait((-1, 0.0))
    _done, pending = await asyncio.wait(workers, timeout=args.drain)
    for t in pending:
        t.cancel()

    lo, hi = args.warmup, total_s
    measured = [r for r in results if lo <= r[0] < hi]
    ok = sorted((d - due) * 1000 for due, d, s in measured if s in (200, 409))
    answered_in_window = sum(1 for due, d, s in results if lo <= d < hi and s in (200, 409))
    n_sched = sum(1 for k in range(n_total) if lo <= k / args.rate < hi)
    statuses: dict[str, int] = {}
    for _due, _d, s in measured:
        statuses[str(s)] = statuses.get(str(s), 0) + 1
    unfinished = n_sched - len(measured)
    errors = unfinished + sum(v for k, v in statuses.items() if k not in ("200", "409"))
    cpu = {name: round(cpu_delta(snaps["start"][name], snaps["end"][name]), 3) for name in snaps["end"]}
    per_req = {name: (round(v / answered_in_window * 1e6, 1) if answered_in_window else None)
               for name, v in cpu.items()}
    lag.sort()
    return {
        "rate": args.rate, "duration_s": args.duration, "connections": args.connections,
        "scheduled": n_sched, "answered": len(ok), "committed": statuses.get("200", 0),
        "aborted": statuses.get("409", 0), "errors": errors, "unfinished": unfinished, "statuses": statuses,
        "throughput": round(answered_in_window / args.duration, 1),
        "latency_ms": {"p50": percentile(ok, 50), "p99": percentile(ok, 99), "p999": percentile(ok, 99.9),
                       "max": round(ok[-1], 3) if ok else None},
        "cpu_s": cpu, "cpu_us_per_request": per_req,
        "server_cpu_us_per_request": (round(sum(v for n, v in cpu.items() if n != "generator")
                                            / answered_in_window * 1e6, 1) if answered_in_window else None),
        "scheduler_lag_ms": {"p50": percentile(lag, 50), "p99": percentile(lag, 99)},
        "loadavg_1min": [round(snaps["load_before"][0], 2), round(load_after[0], 2)],  # type: ignore[index]
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--token", default="e2e")
    ap.add_argument("--rate", type=float, required=True, help="requests per second (scheduled)")
    ap.add_argument("--duration", type=float, default=10, help="measured seconds")
    ap.add_argument("--warmup", type=float, default=2)
    ap.add_argument("--drain", type=float, default=10, help="seconds to wait for replies after the schedule")
    ap.add_argument("--connections", type=int, default=256)
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--max-amount", type=int, default=10)
    ap.add_argument("--seed", type=int, default=24)
    ap.add_argument("--prefix", default="r", help="Idempotency-Key prefix (unique per run)")
    ap.add_argument("--watch", action="append", default=[], help="NAME=PID, or NAME=PID+ with descendants")
    args = ap.parse_args(argv)
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
