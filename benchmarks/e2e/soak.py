"""Soak: minutes of mixed load on one engine through the HTTP gateway, with the RSS of every process sampled.

`charon run charon.apps.ycsb:app` runs in its own process (with Spark: plus the JVM and Python workers, all
its descendants are sampled). The load is ``--workers`` paced clients sharing ``--rate`` requests/s (a
client never bursts to catch up): YCSB-T transfers, balance reads (a read-only transaction), transfers that
abort (amount above any balance) and ``GET /state`` reads, each POST with its own Idempotency-Key.
Every ``--sample-s`` seconds the RSS of each process is recorded with the window's throughput and
latency. The verdict fits a line to the total RSS after ``--warmup-min`` minutes: "RSS flat after warm-up"
when the fitted growth over that window is at most max(10 MB, 3 % of its mean).
At the end the total balance is checked (money is conserved) and a JSON file and a PNG plot are written.

    .venv/bin/python benchmarks/e2e/soak.py --engine inprocess --minutes 10
    .venv/bin/python benchmarks/e2e/soak.py --engine spark --minutes 10      # Spark local mode, CHARON_* honoured
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil

from charon.apps.ycsb import INITIAL_BALANCE
from charon.bench.engines import start_node
from charon.bench.harness import percentile

OUT = Path(__file__).resolve().parents[1] / "results" / "e2e"
TOKEN = "soak"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
MIX = (("transfer", 0.60), ("balance", 0.20), ("abort", 0.10), ("state", 0.10))


def parse_mix(spec: str) -> dict[str, float]:
    """``kind=weight,...`` over the kinds of MIX."""
    out = {}
    for part in spec.split(","):
        kind, _, w = part.partition("=")
        if kind not in dict(MIX):
            raise argparse.ArgumentTypeError(f"unknown kind {kind!r} (one of {', '.join(dict(MIX))})")
        out[kind] = float(w)
    return out


def rss_sample(root: psutil.Process) -> dict[str, int]:
    """RSS in bytes of the server and each of its descendants, keyed 'pid name'.

    A JVM forks before it execs a helper (Spark's Python workers, shell commands): for that instant the child
    is a copy of the JVM named after the forking thread ("stream executio") whose RSS repeats the JVM's.
    Such a child (the JVM's executable under another name) is not counted."""
    out: dict[str, int] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            name = p.name()
            if p is not root and name != "java" and os.path.basename(p.exe()) == "java":
                continue  # a JVM thread's fork that has not exec'd its helper yet
            if name.startswith("python"):
                cmd = " ".join(p.cmdline()[1:3])[:40]
                name = f"python {cmd}"
            out[f"{p.pid} {name}"] = p.memory_info().rss
        except psutil.Error:
            pass
    return out


def disk_sample(data_dir: str) -> dict[str, int]:
    """Bytes on disk under ``data_dir`` by part: the logs, the durable state, the epoch records, Spark's query
    checkpoint, the log files (spark.log, server.log) and the rest."""
    out: dict[str, int] = {}
    for root, _, files in os.walk(data_dir):
        rel = os.path.relpath(root, data_dir).split(os.sep)
        for f in files:
            try:
                size = os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                continue  # replaced meanwhile
            if rel[0] == ".":
                part = "logs" if f.endswith(".log") else f.split(".")[0]  # input/output(.sqlite, -wal, -shm)
            elif rel[0] == "checkpoint" and len(rel) > 1:
                part = f"checkpoint/{rel[1]}"
            else:
                part = rel[0]
            out[part] = out.get(part, 0) + size
    return out


def fit_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


async def soak(args: argparse.Namespace, url: str, proc: psutil.Process) -> dict:
    rng = random.Random(args.seed)
    accounts = [f"a{i}" for i in range(args.accounts)]
    limits = httpx.Limits(max_connections=args.workers + 32, max_keepalive_connections=args.workers + 32)
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=60, limits=limits) as client:
        # initial balances, through the gateway like everything else
        sem = asyncio.Semaphore(32)

        async def fund(a: str) -> None:
            async with sem:
                r = await client.post(f"/invoke/account/{a}/deposit", json={"args": [INITIAL_BALANCE]},
                                      headers={"Idempotency-Key": f"fund-{a}"})
                r.raise_for_status()

        await asyncio.gather(*(fund(a) for a in accounts))

        windows: list[dict] = []
        cur: dict = {"lat": [], "ok": 0, "aborted": 0, "errors": 0}
        kinds = list(args.mix)
        weights = list(args.mix.values())

        async def one(kind: str) -> None:
            src, dst = rng.sample(accounts, 2)
            t = time.perf_counter()
            try:
                if kind == "state":
                    r = await client.get(f"/state/account/{src}")
                else:
                    fn, a = {"transfer": ("transfer", [dst, rng.randint(1, 10)]), "balance": ("balance", []),
                             "abort": ("transfer", [dst, 10 * INITIAL_BALANCE * args.accounts])}[kind]
                    r = await client.post(f"/invoke/account/{src}/{fn}", json={"args": a},
                                          headers={"Idempotency-Key": uuid.uuid4().hex})
                ms = (time.perf_counter() - t) * 1000
                if r.status_code == 200:
                    cur["ok"] += 1
                    cur["lat"].append(ms)
                elif r.status_code == 409:
                    cur["aborted"] += 1
                    cur["lat"].append(ms)
                else:
                    cur["errors"] += 1
            except httpx.HTTPError:
                cur["errors"] += 1

        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        sent = 0
        stalled: float | None = None  # when nothing was answered for --stall-s seconds

        async def worker(w: int) -> None:
            # paced: each worker sends rate/workers requests per second and never bursts to catch up,
            # so a slow moment shows as lower throughput and higher latency, not as a client-side backlog
            nonlocal sent
            period = args.workers / args.rate
            due = t0 + period * w / args.workers
            while True:
                now = time.monotonic()
                if now >= end:
                    return
                if due > now:
                    await asyncio.sleep(due - now)
                due = max(due + period, time.monotonic())
                sent += 1
                await one(rng.choices(kinds, weights)[0])

        async def sampler() -> None:
            nonlocal cur, stalled
            next_sample = t0
            last_answer = t0
            while True:
                now = time.monotonic()
                rss = rss_sample(proc)
                disk = disk_sample(args.data_dir_used)
                lat = cur["lat"]
                windows.append({
                    "t_s": round(now - t0, 2), "loadavg": os.getloadavg()[0], "rss": rss,
                    "rss_total_mb": sum(rss.values()) / 2**20, "disk": disk,
                    "disk_mb": sum(v for k, v in disk.items() if k != "logs") / 2**20,
                    "ok": cur["ok"], "aborted": cur["aborted"], "errors": cur["errors"],
                    "p50_ms": percentile(lat, 50) if lat else None, "p99_ms": percentile(lat, 99) if lat else None,
                })
                cur = {"lat": [], "ok": 0, "aborted": 0, "errors": 0}
                if args.verbose:
                    w = windows[-1]
                    p50 = f"{w['p50_ms']:.1f}" if lat else "-"
                    p99 = f"{w['p99_ms']:.1f}" if lat else "-"
                    print(f"{w['t_s']:7.1f}s rss {w['rss_total_mb']:8.1f} MB disk {w['disk_mb']:6.1f} MB  "
                          f"ok {w['ok']} aborted {w['aborted']} "
                          f"errors {w['errors']} p50 {p50} ms p99 {p99} ms", flush=True)
                if windows[-1]["ok"] + windows[-1]["aborted"]:
                    last_answer = now
                if now - last_answer > args.stall_s:
                    stalled = round(now - t0, 1)
                    print(f"the engine answered nothing for {args.stall_s:.0f} s: stopping", flush=True)
                    return
                if now >= end:
                    return
                next_sample += args.sample_s
                await asyncio.sleep(max(0.0, min(next_sample, end) - time.monotonic()))

        workers = [asyncio.ensure_future(worker(w)) for w in range(args.workers)]
        await sampler()
        if stalled is not None:
            for t in workers:
                t.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        for k in ("ok", "aborted", "errors"):  # requests that finished after the last sample
            windows[-1][k] += cur[k]

        async def bal(a: str) -> int:  # a read-only transaction per account, after the load
            async with sem:
                r = await client.post(f"/invoke/account/{a}/balance", json={"args": []}, timeout=60)
                r.raise_for_status()
                return int(r.json()["value"] or 0)

        total: int | None = None
        if stalled is None:
            try:
                total = sum(await asyncio.gather(*(bal(a) for a in accounts)))
            except httpx.HTTPError as exc:
                print(f"could not read the balances: {exc!r}", flush=True)
    return {"windows": windows, "sent": sent, "total_balance": total, "stalled_at_s": stalled,
            "conserved": None if total is None else total == INITIAL_BALANCE * args.accounts}


def per_process_slopes(windows: list[dict], warmup_s: float) -> dict[str, float]:
    """MB/min after warm-up of each process that lived through the whole window (fitted like the total)."""
    ws = [w for w in windows if w["t_s"] >= warmup_s]
    procs = set.intersection(*(set(w["rss"]) for w in ws)) if ws else set()
    return {p: round(fit_slope([w["t_s"] / 60 for w in ws], [w["rss"][p] / 2**20 for w in ws]), 3)
            for p in sorted(procs)}


def disk_verdict(windows: list[dict], warmup_s: float) -> dict:
    """The data directory's size (without log files) after warm-up: fitted slope and range."""
    pts = [(w["t_s"] / 60, w["disk_mb"]) for w in windows if w["t_s"] >= warmup_s and "disk_mb" in w]
    if not pts:
        return {}
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    slope = fit_slope(xs, ys)
    growth = slope * (xs[-1] - xs[0])
    limit = max(5.0, 0.05 * statistics.fmean(ys))
    return {"slope_mb_per_min": round(slope, 3), "fitted_growth_mb": round(growth, 2),
            "allowed_growth_mb": round(limit, 2), "min_mb": round(min(ys), 2), "max_mb": round(max(ys), 2),
            "flat": growth <= limit, "final_by_part_mb": {k: round(v / 2**20, 2)
                                                         for k, v in windows[-1].get("disk", {}).items()}}


def verdict(windows: list[dict], warmup_s: float) -> dict:
    pts = [(w["t_s"], w["rss_total_mb"]) for w in windows if w["t_s"] >= warmup_s]
    xs, ys = [p[0] / 60 for p in pts], [p[1] for p in pts]
    slope = fit_slope(xs, ys)  # MB per minute
    span = (xs[-1] - xs[0]) if len(xs) > 1 else 0.0
    growth = slope * span
    mean = statistics.fmean(ys) if ys else 0.0
    limit = max(10.0, 0.03 * mean)
    return {
        "warmup_s": warmup_s, "points": len(pts), "slope_mb_per_min": round(slope, 3),
        "fitted_growth_mb": round(growth, 2), "allowed_growth_mb": round(limit, 2),
        "rss_mean_mb": round(mean, 1), "rss_min_mb": round(min(ys), 1) if ys else None,
        "rss_max_mb": round(max(ys), 1) if ys else None,
        "flat": bool(pts) and growth <= limit,
        "verdict": "RSS flat after warm-up" if pts and growth <= limit else "RSS grows after warm-up",
        "slope_mb_per_min_by_process": per_process_slopes(windows, warmup_s),
        "disk": disk_verdict(windows, warmup_s),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = result["windows"]
    ts = [w["t_s"] / 60 for w in ws]
    fig, (ax1, ax2, ax4) = plt.subplots(3, 1, figsize=(10, 10), sharex=True, height_ratios=[3, 3, 1.5])
    procs = sorted({p for w in ws for p in w["rss"]})
    for p in procs:
        ax1.plot(ts, [w["rss"].get(p, 0) / 2**20 for w in ws], label=p, linewidth=1)
    ax1.plot(ts, [w["rss_total_mb"] for w in ws], label="total", color="black", linewidth=2)
    ax1.axvline(result["verdict"]["warmup_s"] / 60, color="grey", linestyle="--", label="end of warm-up")
    ax1.set_ylabel("RSS (MB)")
    ax1.set_title(f"soak: {result['config']['engine']} — {result['verdict']['verdict']} "
                  f"({result['verdict']['slope_mb_per_min']} MB/min)")
    ax1.legend(fontsize=7, loc="upper left")
    s = result["config"]["sample_s"]
    ax2.plot(ts, [(w["ok"] + w["aborted"]) / s for w in ws], label="answered/s")
    ax2.set_ylabel("answered/s")
    ax3 = ax2.twinx()
    ax3.plot(ts, [w["p50_ms"] for w in ws], color="tab:green", label="p50 ms")
    ax3.plot(ts, [w["p99_ms"] for w in ws], color="tab:red", label="p99 ms")
    ax3.set_ylabel("latency (ms)")
    ax3.set_yscale("log")
    ax4.plot(ts, [w.get("disk_mb", 0) for w in ws], color="tab:brown")
    ax4.set_ylabel("data dir (MB)")
    ax4.set_ylim(bottom=0)
    ax4.set_xlabel("minutes")
    ax2.legend(loc="upper left")
    ax3.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=["inprocess", "spark"], default="inprocess")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=150.0, help="requests per second (open loop)")
    ap.add_argument("--accounts", type=int, default=1000)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--workers", type=int, default=16, help="concurrent clients sharing --rate")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--warmup-min", type=float, default=None, help="default: a fifth of the run, at most 2 min")
    ap.add_argument("--mix", type=parse_mix, default=dict(MIX),
                    help="weights, e.g. transfer=0.6,balance=0.2,abort=0.1,state=0.1 (the default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stall-s", type=float, default=90.0, help="stop when nothing is answered this long")
    ap.add_argument("--data-dir", default=None, help="default: a fresh temporary directory")
    ap.add_argument("--out", default=None, help="output prefix (default benchmarks/results/e2e/soak-ENGINE)")
    ap.add_argument("--verbose", "-v", action="store_true")
    ap.add_argument("--replot", default=None, help="only redraw the PNG of this result JSON")
    ap.add_argument("extra", nargs="*", help="more `charon run` options after --, e.g. -- --no-fsync")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return
    data_dir = args.data_dir or tempfile.mkdtemp(prefix=f"charon-soak-{args.engine}-")
    os.makedirs(data_dir, exist_ok=True)
    args.data_dir_used = data_dir
    node = start_node("charon.apps.ycsb:app", engine=args.engine, token=TOKEN, workdir=data_dir,
                      data_dir=data_dir, durable="--ephemeral" not in args.extra,
                      args=["--partitions", str(args.partitions), *args.extra], log=Path(data_dir) / "server.log")
    try:
        t_start = time.time()
        run = asyncio.run(soak(args, node.url, psutil.Process(node.pid)))
    finally:
        node.stop(timeout=120)
    warmup_s = 60 * (args.warmup_min if args.warmup_min is not None else min(2.0, args.minutes / 5))
    ws = run["windows"]
    lat_ok = [w for w in ws if w["p50_ms"] is not None]
    result = {
        "config": {**{k: v for k, v in vars(args).items() if k not in ("verbose", "data_dir_used")},
                   "data_dir": data_dir,
                   "started": t_start, "mix": args.mix, "python": sys.version.split()[0],
                   "env": {k: v for k, v in os.environ.items() if k.startswith("CHARON_")},
                   "cpus": os.cpu_count()},
        "verdict": verdict(ws, warmup_s) if run["stalled_at_s"] is None else {
            "warmup_s": warmup_s, "flat": False, "slope_mb_per_min": None,
            "verdict": f"engine stalled: nothing answered for {args.stall_s:.0f} s, at {run['stalled_at_s']} s"},
        "sent": run["sent"],
        "answered": sum(w["ok"] + w["aborted"] for w in ws),
        "errors": sum(w["errors"] for w in ws),
        "conserved": run["conserved"], "total_balance": run["total_balance"], "stalled_at_s": run["stalled_at_s"],
        "p50_ms_median_window": statistics.median(w["p50_ms"] for w in lat_ok) if lat_ok else None,
        "p99_ms_max_window": max(w["p99_ms"] for w in lat_ok) if lat_ok else None,
        "windows": ws,
    }
    prefix = Path(args.out) if args.out else OUT / f"soak-{args.engine}"
    prefix.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(result, prefix.with_suffix(".png"))
    v = result["verdict"]
    if run["stalled_at_s"] is not None:
        print(f"{args.engine}: {v['verdict']}; sent {result['sent']}, errors {result['errors']}; "
              f"wrote {prefix}.json/.png (server log: {data_dir}/server.log)")
        sys.exit(1)
    print(f"{args.engine}: {v['verdict']}: slope {v['slope_mb_per_min']} MB/min after {warmup_s:.0f} s "
          f"(fitted growth {v['fitted_growth_mb']} MB, allowed {v['allowed_growth_mb']} MB; "
          f"RSS {v['rss_min_mb']}-{v['rss_max_mb']} MB; by process {v['slope_mb_per_min_by_process']}; "
          f"disk {v['disk']}); sent {result['sent']}, errors {result['errors']}, "
          f"money conserved: {result['conserved']}; wrote {prefix}.json/.png")
    if not result["conserved"] or not v["flat"] or not v["disk"].get("flat", True):
        sys.exit(1)


if __name__ == "__main__":
    main()
