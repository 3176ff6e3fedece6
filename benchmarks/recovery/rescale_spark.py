"""The pause of an online rescale of the Spark runtime (2 -> 4 -> 3 engine partitions, and 2 -> 4 -> 3 input-log
partitions) under load.

``SparkRuntime("charon.apps.holds:app")`` on ``local[2]`` with ``--keys`` accounts; closed-loop clients submit
transfers through the real log path (:meth:`SparkRuntime.submit`: the input log, the streaming query, the
output log); after a warm-up of four epochs, at ``t = duration/3`` and ``2*duration/3`` the runtime rescales
(:meth:`SparkRuntime.rescale`) while the query keeps running. Reported per move: ``wait_s`` (from the request
until the running epoch was done; epochs still ran), ``pause_s`` (the gate closed with no epoch running:
re-placing every key group from the durable copy, writing the new layout's bases, switching ``layout.json``),
the driver's CPU time in the move, and answered transactions per second and each transaction's latency
around it. The input log is resized too (:meth:`SparkRuntime.rescale_log`, 2 -> 4 at ``duration/6``, 4 -> 3
at ``duration/2``): it has no pause; reported per switch are its wall and CPU time and, in the ``WINDOW_S``
seconds before and after it, answered transactions per second, latency p50/p99 and the longest gap between
two answers (a pause would show there). Wall times are disturbed by other work on the machine (2 cores
shared); the CPU time is the steadier figure.

    .venv/bin/python benchmarks/recovery/rescale_spark.py --keys 10000 100000 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from charon import serde
from charon.config import SparkConfig
from charon.runtime.spark.runtime import SparkRuntime
from charon.runtime.spark.session import make_session

OUT = Path(__file__).resolve().parents[1] / "results" / "recovery"
APP = "charon.apps.holds:app"
BIN = 1.0
WINDOW_S = 2.0  # seconds before/after a log switch compared


def around(done: list[tuple[float, float, bool]], t0: float, at: float) -> dict:
    """Answers in the ``WINDOW_S`` before and after ``at`` (seconds since ``t0``): rate, p50/p99, longest gap."""
    out = {}
    for name, lo, hi in (("before", at - WINDOW_S, at), ("after", at, at + WINDOW_S)):
        ts = sorted(t - t0 for t, _, _ in done if lo <= t - t0 < hi)
        lats = sorted(dt * 1000 for t, dt, _ in done if lo <= t - t0 < hi)
        gaps = [b - a for a, b in zip([lo, *ts], [*ts, hi], strict=True)]
        out[name] = {"per_s": len(ts) / WINDOW_S, "p50_ms": statistics.median(lats) if lats else None,
                     "p99_ms": lats[int(0.99 * (len(lats) - 1))] if lats else None,
                     "max_gap_ms": max(gaps) * 1000}
    return out


async def client(rt: SparkRuntime, keys: int, seed: int, stop: threading.Event, done: list) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        a, b = rng.randrange(keys), rng.randrange(keys)
        if a == b:
            continue
        t = time.perf_counter()
        rep = await rt.submit("acct", f"k{a}", "transfer", [f"k{b}", 1], timeout=300)
        done.append((time.perf_counter(), time.perf_counter() - t, rep.ok))


def run(spark: object, keys: int, duration: float, clients: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="charon-rescale-spark-")
    try:
        cfg = SparkConfig(master="local[2]", data_dir=tmp, partitions=2, max_batch=2000, compact_every=10)
        rt = SparkRuntime(APP, cfg, spark=spark)
        rt.load("acct", {f"k{i}": 1000 for i in range(keys)})
        rt.start()
        done: list[tuple[float, float, bool]] = []
        stop = threading.Event()
        loop = asyncio.new_event_loop()

        async def clients_run() -> None:
            await asyncio.gather(*(client(rt, keys, s, stop, done) for s in range(clients)))

        th = threading.Thread(target=loop.run_until_complete, args=(clients_run(),), daemon=True)
        th.start()
        while rt.last_recorded_epoch() < 3:  # warm-up (Python workers, first jobs): not measured
            time.sleep(0.05)
        t0 = time.perf_counter()
        done.clear()
        moves, switches = [], []
        # (when, kind, count): the log grows, the engine grows, the log shrinks (route), the engine shrinks
        for when, kind, target in ((1 / 6, "log", 4), (1 / 3, "engine", 4), (1 / 2, "log", 3), (2 / 3, "engine", 3)):
            time.sleep(max(0.0, t0 + duration * when - time.perf_counter()))
            at = time.perf_counter() - t0
            if kind == "log":
                info = rt.rescale_log(target)
                switches.append({"at_s": at, **info})
                print(f"keys {keys}: log {info['from']} -> {info['to']} (physical {info['physical']}) switch "
                      f"{info['switch_s'] * 1000:.1f} ms, cpu {info['cpu_s'] * 1000:.1f} ms", flush=True)
                continue
            info = rt.rescale(target)
            moves.append({"at_s": at, **info})
            print(f"keys {keys}: {info['from']} -> {info['to']} wait {info['wait_s']:.3f} s, "
                  f"pause {info['pause_s']:.3f} s, cpu {info['cpu_s']:.3f} s", flush=True)
        time.sleep(max(0.0, t0 + duration - time.perf_counter()))
        stop.set()
        th.join(300)
        rt.wait_idle(300)
        rt.stop()
        total = sum(serde.decode(v) for k, v in rt.snapshot().items() if k.endswith(b"\0"))  # money conserved
        bins = int(duration / BIN) + 1
        per_bin = [0] * bins
        for t, _, _ in done:
            i = int((t - t0) / BIN)
            if 0 <= i < bins:
                per_bin[i] += 1
        lats = sorted(dt for _, dt, _ in done)
        for sw in switches:
            sw["around"] = around(done, t0, sw["at_s"])
        last = rt.read_record(rt.last_recorded_epoch())
        return {"log_switches": switches, "log_counts": list(rt.input_log.counts()),
                "last_epoch_log_partitions": len(last.ends) if last is not None else None,
                "keys": keys, "clients": clients, "duration_s": duration, "committed": sum(ok for *_, ok in done),
                "answered": len(done), "moves": moves, "bin_s": BIN, "per_bin": per_bin,
                "p50_ms": statistics.median(lats) * 1000, "p99_ms": lats[int(0.99 * (len(lats) - 1))] * 1000,
                "replies": [(round(t - t0, 4), round(dt * 1000, 1)) for t, dt, _ in done],
                "money": total, "money_expected": 1000 * keys,
                "epochs": rt.last_recorded_epoch() + 1}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(9, 3.2 * len(results)), squeeze=False)
    for ax, r in zip(axes[:, 0], results, strict=True):
        xs = [(i + 0.5) * r["bin_s"] for i in range(len(r["per_bin"]))]
        ax.step(xs, [n / r["bin_s"] for n in r["per_bin"]], where="mid", color="tab:blue")
        ax.set_ylabel("answered / s (1 s bins)", color="tab:blue")
        ax2 = ax.twinx()
        ax2.scatter([t for t, _ in r["replies"]], [ms for _, ms in r["replies"]], s=2, color="tab:orange")
        ax2.set_ylabel("latency of each reply (ms)", color="tab:orange")
        for m in r["moves"]:
            start = m["at_s"] + m["wait_s"]
            ax.axvspan(start, start + m["pause_s"], color="red", alpha=0.3)
            ax.annotate(f"{m['from']}→{m['to']}: pause {m['pause_s'] * 1000:.0f} ms", (start, ax.get_ylim()[1] * 0.9),
                        fontsize=8)
        for sw in r.get("log_switches", []):
            ax.axvline(sw["at_s"], color="green", linestyle="--")
            ax.annotate(f"log {sw['from']}→{sw['to']}: no pause ({sw['switch_s'] * 1000:.0f} ms switch)",
                        (sw["at_s"], ax.get_ylim()[1] * 0.75), fontsize=8, color="green")
        ax.set_title(f"Spark rescale under load (engine: red pauses; input log: green), {r['keys']:,} accounts, "
                     f"{r['clients']} clients")
        ax.set_xlabel("s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--keys", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=32)
    args = p.parse_args()
    spark = make_session(SparkConfig(master="local[2]", partitions=2))
    results = [run(spark, k, args.duration, args.clients) for k in args.keys]
    spark.stop()  # type: ignore[attr-defined]
    cmd = f"benchmarks/recovery/rescale_spark.py --keys {' '.join(map(str, args.keys))} --duration {args.duration} " \
          f"--clients {args.clients}"
    (OUT / "rescale_spark.json").write_text(json.dumps({"command": cmd, "results": results}, indent=1))
    plot(results, OUT / "rescale_spark.png")
    print(json.dumps([{k: r[k] for k in ("keys", "committed", "answered", "epochs")}
                      | {"moves": r["moves"], "log_switches": r["log_switches"]} for r in results], indent=1))


if __name__ == "__main__":
    main()
