"""YCSB-T on the Spark runtime (local[2]): latency vs input rate, epoch-time breakdown; JSON + PNG.

The driver (Spark, the epoch coordinator) runs in this process; the open-loop load generator runs in a
separate process that appends to the input log and tails the output log (as a gateway would), so the two
do not share a GIL.

    .venv/bin/python benchmarks/spark/spark_ycsb.py --rates 250,500,1000,2000,4000 --duration 20
    .venv/bin/python benchmarks/spark/spark_ycsb.py --rates 1000 --variants before,after,before,after --label ab
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

OUT = Path(__file__).resolve().parents[1] / "results" / "spark"


def _generator(data_dir: str, rate: float, duration: float, warmup: float, n: int, zipf: float, seed: int,
               out: str) -> None:
    from charon.apps import ycsb
    from charon.bench.harness import run, run_open_loop
    from charon.log.client import LogClient
    from charon.log.sqlite import InputLog, OutputLog

    sampler = ycsb.Zipf(n, zipf)

    def gen(rng):
        d = rng.randrange(n)
        return ("account", ycsb.key(d), "transfer", [ycsb.key(sampler.sample(rng)), rng.randint(1, 10)])

    async def main():
        target = LogClient(InputLog(os.path.join(data_dir, "input.sqlite")),
                           OutputLog(os.path.join(data_dir, "output.sqlite")))
        return await run_open_loop(target, gen, rate=rate, duration=duration, warmup=warmup,
                                   drain_timeout=30.0, seed=seed, label=f"spark zipf={zipf}")

    res = run(main())
    res["generator_cpu_s"] = time.process_time()  # this process: the generator and its SQLite log client
    Path(out).write_text(json.dumps(res))


def _lean_generator(data_dir: str, rate: float, duration: float, warmup: float, n: int, zipf: float, seed: int,
                    out: str, group_commit_s: float = 0.004, drain_timeout: float = 30.0,
                    on_clock: Callable[[bool], None] | None = None) -> None:
    """The same open loop as :func:`_generator` without a coroutine, future and timeout per request.

    The whole schedule is built before the clock starts (request ``i`` is due at ``i / rate``; the RNG draws
    debtor, creditor, amount per request as ``_generator``'s ``gen``, so a seed gives the same workload). Then
    one loop wakes every ``group_commit_s`` on a fixed grid, appends what is due in one SQLite transaction (as
    LogClient's group commit; the log stamps the append time) and reads the replies that arrived when the
    output log's ``data_version`` moved. Latency is measured from each request's due time to the moment its
    reply is seen. Per request the loop only appends it and matches its reply (the replies of a read decoded in
    one call, only their id and outcome; outcomes in flat arrays), so it measures the engine's ceiling on a
    machine whose cores the generator shares (``benchmarks/spark/generator_cost.py`` measures its CPU per request;
    the schedule takes ~300 bytes per request: 120 MiB at 16,000/s for 25 s). In the result,
    ``generator_cpu_s`` is the process's CPU time, ``generator_loop_cpu_s`` the open loop's alone;
    ``on_clock(True)`` / ``on_clock(False)`` are called as the open loop starts and ends (a profiler's hook)."""
    import array
    import itertools
    import operator
    import random
    import uuid

    from charon import serde
    from charon.apps import ycsb
    from charon.bench.harness import summarize
    from charon.log.sqlite import InputLog, OutputLog
    from charon.messages import Request

    sampler = ycsb.Zipf(n, zipf)
    rng = random.Random(seed)
    inp = InputLog(os.path.join(data_dir, "input.sqlite"))
    outp = OutputLog(os.path.join(data_dir, "output.sqlite"))
    seq = outp.last_seq()
    total = int((warmup + duration) * rate)
    prefix = uuid.uuid4().hex[:16]
    keys = [ycsb.key(d) for d in range(n)]
    encode, getrandbits, bits, uniform = serde.encode, rng.getrandbits, n.bit_length(), zipf <= 0
    reqs = []
    for i in range(total):
        # _generator's gen() draw for draw: debtor rng.randrange(n), creditor sampler.sample(rng) (randrange(n)
        # when uniform), amount rng.randint(1, 10); randrange(m) inlined as CPython draws it (getrandbits of
        # m's bit length until below m), which tests/bench/test_bench.py checks against random.Random itself
        d = getrandbits(bits)
        while d >= n:
            d = getrandbits(bits)
        if uniform:
            c = getrandbits(bits)
            while c >= n:
                c = getrandbits(bits)
        else:
            c = sampler.sample(rng)
        a = getrandbits(4)
        while a >= 10:
            a = getrandbits(4)
        reqs.append(Request(f"{prefix}{i:x}", "account", keys[d], "transfer", encode([keys[c], a + 1])))
    waiting = {r.request_id: k for k, r in enumerate(reqs)}  # request id -> index, until its reply is seen
    # when request k's reply was seen (s after t0), -1: not yet; slot ``total`` takes the replies of others
    done = array.array("d", [-1.0]) * (total + 1)
    errors: dict[int, str] = {}  # error_type of the requests that failed
    outcomes = msgspec.msgpack.Decoder(list[_Outcome])
    pop, data_of, id_of, ok_of = waiting.pop, operator.itemgetter(1), operator.attrgetter("request_id"), \
        operator.attrgetter("ok")
    if on_clock is not None:
        on_clock(True)
    cpu0 = time.process_time()
    t0 = time.monotonic() + 0.05
    tick = t0
    i = 0
    seen = None
    drain_end = None
    while True:
        now = time.monotonic()
        if i < total and t0 + i / rate <= now:
            j = min(total, max(i + 1, int((now - t0) * rate)))
            while j > i + 1 and t0 + (j - 1) / rate > now:  # exactly the requests due by now
                j -= 1
            while j < total and t0 + j / rate <= now:
                j += 1
            inp.append_many(reqs[i:j])
            i = j
        version = outp.version()
        if version != seen:
            rows = outp.read_raw_since(seq, 100_000)
            if len(rows) < 100_000:
                seen = version
            if rows:
                seq = rows[-1][0]
                at = time.monotonic() - t0
                # the batch in one decode (a msgpack array header before the replies' own msgpack objects), only
                # request_id / ok / error_type of each; matched by the id: its index, or ``total`` for the id of
                # another client or one already seen
                got = outcomes.decode(b"\xdd" + len(rows).to_bytes(4, "big") + b"".join(map(data_of, rows)))
                idx = list(map(pop, map(id_of, got), itertools.repeat(total)))
                for k in idx:
                    done[k] = at
                if not all(map(ok_of, got)):
                    errors.update((k, o.error_type) for k, o in zip(idx, got, strict=True) if not o.ok and k < total)
        if i >= total:
            drain_end = drain_end or time.monotonic() + drain_timeout
            if not waiting or time.monotonic() > drain_end:
                break
            time.sleep(0.003)
        else:  # the next group commit, on a fixed grid of group_commit_s (after a late wake-up: at once)
            tick = max(tick + group_commit_s, now)
            time.sleep(max(0.0, tick - time.monotonic()))
    wall = time.monotonic() - t0
    loop_cpu = time.process_time() - cpu0
    if on_clock is not None:
        on_clock(False)
    del reqs
    samples = [{"due": k / rate, "done": done[k] if done[k] >= 0 else None,
                "ok": done[k] >= 0 and k not in errors, "error_type": errors.get(k, "")} for k in range(total)]
    res = summarize(samples, rate=rate, duration=duration, warmup=warmup,
                    extra={"label": f"spark zipf={zipf} lean", "wall_s": wall, "when": time.time()})
    res["generator_loop_cpu_s"] = loop_cpu
    res["generator_cpu_s"] = time.process_time()
    Path(out).write_text(json.dumps(res))


class _Outcome(msgspec.Struct):
    """What the lean generator decodes of a :class:`~charon.messages.Reply` (its other fields are skipped)."""

    request_id: str
    ok: bool
    error_type: str = ""


def _tree_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of this process and every live descendant, by pid: (kind, seconds), kind ``driver`` (this
    process), ``jvm`` or ``python`` (the Python workers, including the source's planner)."""
    import psutil

    me = psutil.Process()
    out: dict[int, tuple[str, float]] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            kind = "driver" if proc.pid == me.pid else ("jvm" if "java" in proc.name() else "python")
        except psutil.Error:
            continue
        out[proc.pid] = (kind, t.user + t.system)
    return out


def cpu_split(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], skip: int) -> dict:
    """CPU seconds per process kind between two :func:`_tree_cpu` samples (``skip``: the generator's pid)."""
    out = {"driver": 0.0, "jvm": 0.0, "python": 0.0}
    for pid, (kind, v) in after.items():
        if pid != skip:
            out[kind] += v - before.get(pid, (kind, 0.0))[1]
    return out


def breakdown(epochs: list[dict]) -> dict:
    """Where an epoch's time goes, as means over the epochs (ms)."""
    def mean(k: str, scale: float = 1000.0) -> float:
        vals = [e.get(k, 0.0) * scale for e in epochs]
        return statistics.fmean(vals) if vals else float("nan")

    return {
        "epoch_ms": mean("duration_ms", 1.0),
        "rounds": mean("rounds", 1.0),
        "spark_jobs_per_epoch": mean("spark_jobs", 1.0),
        "spark_tasks_per_epoch": mean("spark_tasks", 1.0),
        "ms_per_job": (mean("spark_job_s") / mean("spark_jobs", 1.0)) if mean("spark_jobs", 1.0) else float("nan"),
        "finalize_deferred": mean("finalize_deferred", 1.0),
        "conflicts": mean("conflicts", 1.0),
        "spark_jobs_ms": mean("spark_job_s"),
        "task_function_exec_ms": mean("spark_step_s"),
        "task_cpu_ms": mean("spark_task_cpu_s"),  # the task functions' own CPU (time.thread_time), all tasks
        "task_state_restore_ms": mean("spark_restore_s"),
        "driver_serialization_ms": mean("spark_ser_s"),
        "coordinator_ms": statistics.fmean(
            [e.get("duration_ms", 0.0) - 1000 * e.get("exchange_s", 0.0) for e in epochs]
        ) if epochs else float("nan"),
        "bytes_per_epoch": mean("spark_bytes_out", 1.0) + mean("spark_bytes_in", 1.0),
        # the epoch thread's CPU in the driver (time.thread_time): all of it, the input-log read, the replies' write
        "driver_thread_cpu_ms": mean("driver_cpu_s"),
        "driver_read_cpu_ms": mean("driver_read_cpu_s"),
        "driver_deliver_cpu_ms": mean("driver_deliver_cpu_s"),
        "driver_ser_ms": mean("spark_ser_s"),
        "split_rests_per_epoch": mean("spark_split_rests", 1.0),
        "hub_rounds_per_epoch": mean("spark_hub_rounds", 1.0),
        "hub_wait_ms": mean("spark_hub_s"),  # summed over a split rest's tasks (waits for the others included)
        "size": mean("size", 1.0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="250,500,1000,2000,4000")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--accounts", type=int, default=10_000)
    ap.add_argument("--zipf", type=float, default=0.0)
    ap.add_argument("--partitions", type=int, default=None,
                    help="engine partitions (default: what charon run gives a new deployment on --master)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--max-batch", type=int, default=5000,
                    help="SparkConfig.max_batch, most requests per epoch (uniform YCSB-T over 10k accounts: beyond "
                         "~5,000 conflicts make a transaction cost more than the per-epoch overhead saves)")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--label", default="", help="suffix of the output file names")
    ap.add_argument("--variants", default="after",
                    help="comma-separated, run in turn on one Spark session per rate (e.g. before,after,before,"
                         "after to average out load drift): after = the defaults; before = every issue-10 lever "
                         "off (finalize round of its own, fallback and rest round by round, tasks per core)")
    ap.add_argument("--stop-p99-ms", type=float, default=None,
                    help="stop after the first rate whose p99 exceeds this (or that leaves requests unfinished)")
    ap.add_argument("--generator", choices=("logclient", "lean"), default="logclient",
                    help="logclient: a coroutine per request through charon.log.client.LogClient (as the gateway); "
                         "lean: one loop appending and reading in batches (the engine's ceiling, see _lean_generator)")
    ap.add_argument("--python-profile", default=None, metavar="DIR",
                    help="profile the Python workers' tasks (spark.python.profile) and dump cProfile stats here")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from charon.apps import ycsb
    from charon.bench.harness import save
    from charon.config import SparkConfig
    if args.partitions is None:
        args.partitions = SparkConfig(master=args.master).default_partitions()
    from charon.runtime.spark.runtime import SparkRuntime
    from charon.runtime.spark.session import make_session

    levers = {
        "after": {},
        "before": {"pipeline_finalize": False, "single_task_fallback": False, "single_task_rest": False,
                   "task_min_bytes": 1, "gc_threshold": 0},  # the collector's tuning is per process: run before first
        "serial_finalize": {"finalize_threads": 1},
        "cap3k": {"max_batch": 3000},
        "cap5k": {"max_batch": 5000},
        "cap10k": {"max_batch": 10_000},
        "uncapped": {"max_batch": 20_000},  # the fixed cap before --max-batch
        # issue 24: the rest of an epoch in one task, or split over the cores (every rest, whatever its size): the
        # job-per-round exchange's levers (the resident exchange has no split rest)
        "onetask": {"split_rest": "off", "exchange": "jobs"},
        "split": {"split_rest": "on", "split_rest_min_bytes": 1, "exchange": "jobs"},
        "splitlarge": {"split_rest": "on", "exchange": "jobs"},  # split only a rest of >= 2 x split_rest_min_bytes
    }
    variants = args.variants.split(",")
    unknown = set(variants) - levers.keys()
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    session_dir = tempfile.mkdtemp(prefix="charon-bench-session-")  # spark.log of the shared session
    conf = {"spark.python.profile": "true"} if args.python_profile else {}
    spark = make_session(SparkConfig(master=args.master, partitions=args.partitions, data_dir=session_dir,
                                     spark_conf=conf))
    results = []
    ctx = mp.get_context("spawn")
    stop = False
    for rate in [float(r) for r in args.rates.split(",")]:
        if stop:
            break
        for variant in variants:
            data = tempfile.mkdtemp(prefix="charon-bench-spark-")
            cfg = SparkConfig(master=args.master, data_dir=data, partitions=args.partitions,
                              compact_every=50, **{"max_batch": args.max_batch, **levers[variant]})
            rt = SparkRuntime("charon.apps.ycsb:app", cfg, spark=spark)
            try:
                t0 = time.time()
                rt.load("account", ycsb.initial_state(args.accounts))
                rt.start()
                print(f"[bench] {variant}: Spark runtime up in {time.time() - t0:.1f}s ({args.master}, "
                      f"{args.partitions} partitions)", flush=True)
                out = os.path.join(data, f"run-{rate}.json")
                before = len(rt.epoch_stats)
                c0 = time.process_time()
                cpu0 = _tree_cpu()
                target = _lean_generator if args.generator == "lean" else _generator
                p = ctx.Process(target=target, args=(data, rate, args.duration, args.warmup, args.accounts,
                                                     args.zipf, int(rate), out))
                p.start()
                p.join()
                cpu1 = _tree_cpu()
                driver_cpu = time.process_time() - c0
                # CPU of the driver, its JVM and the Python workers (not the load generator): load-independent
                split = cpu_split(cpu0, cpu1, p.pid)
                spark_cpu = sum(split.values())
                if p.exitcode != 0 or not os.path.exists(out):
                    print(f"[bench] rate {rate}: load generator failed ({p.exitcode})", flush=True)
                    continue
                res = json.loads(Path(out).read_text())
                epochs = [e for e in rt.epoch_stats[before:] if e.get("size", 0) > 0]
            finally:
                rt.stop()
                shutil.rmtree(data, ignore_errors=True)
            res.update({"system": "charon-spark", "experiment": "ycsb", "zipf": args.zipf, "rate": rate,
                        "breakdown": breakdown(epochs), "master": args.master, "variant": variant,
                        "driver_cpu_s": driver_cpu, "spark_cpu_s": spark_cpu, "generator": args.generator,
                        "spark_cpu_us_per_request": spark_cpu / max(1, res.get("sent", 0)) * 1e6,
                        "cpu_us_per_request": {k: v / max(1, res.get("sent", 0)) * 1e6 for k, v in
                                               {**split, "generator": res.get("generator_cpu_s", 0.0),
                                                # the lean generator's open loop alone (what competes with the
                                                # engine; "generator" adds imports, schedule and summary)
                                                **({"generator_loop": res["generator_loop_cpu_s"]}
                                                   if "generator_loop_cpu_s" in res else {})}.items()},
                        "epochs": len(epochs),
                        "load_average": os.getloadavg()[0],
                        "settings": {k: getattr(cfg, k) for k in ("pipeline_finalize", "single_task_fallback",
                                                                   "single_task_rest", "task_min_bytes",
                                                                   "rest_max_bytes", "gc_threshold", "split_rest",
                                                                   "split_rest_min_bytes",
                                                                   "finalize_threads", "max_batch",
                                                                   "partitions")}})
            results.append(res)
            lat = res.get("latency_ms", {})
            b = res["breakdown"]
            print(f"[bench] {variant} rate {rate:>7.0f}/s: committed {res.get('committed_per_s', 0):8.1f}/s "
                  f"p50 {lat.get('p50', float('nan')):7.1f} ms p99 {lat.get('p99', float('nan')):7.1f} ms "
                  f"unfinished {res.get('unfinished', 0)}; epoch {b['epoch_ms']:.0f} ms "
                  f"({b['spark_jobs_per_epoch']:.1f} jobs, {b['spark_tasks_per_epoch']:.1f} tasks, "
                  f"{b['ms_per_job']:.0f} ms/job); Spark side CPU {res['spark_cpu_us_per_request']:.0f} µs/request; "
                  f"load average {res['load_average']:.1f}", flush=True)
            print("[bench]   CPU µs/request: " + ", ".join(f"{k} {v:.0f}" for k, v in res["cpu_us_per_request"].items())
                  + f"; per epoch of {b['size']:.0f}: driver thread {b['driver_thread_cpu_ms']:.1f} ms CPU (log read "
                  f"{b['driver_read_cpu_ms']:.1f}, replies {b['driver_deliver_cpu_ms']:.1f}, pickling "
                  f"{b['driver_ser_ms']:.1f} wall), task function {b['task_function_exec_ms']:.1f} ms wall, "
                  f"{b['task_cpu_ms']:.1f} ms CPU", flush=True)
            if args.stop_p99_ms is not None and (res.get("unfinished", 0) or lat.get("p99", 0) > args.stop_p99_ms):
                stop = True
    if args.python_profile:
        spark.sparkContext.dump_profiles(args.python_profile)
    spark.stop()
    shutil.rmtree(session_dir, ignore_errors=True)
    name = f"spark_ycsb_zipf{args.zipf}{'_' + args.label if args.label else ''}"
    path = save(results, Path(args.out) / f"{name}.json")
    plot(results, Path(args.out) / f"{name}.png")
    print(f"[bench] wrote {path}")
    return 0


def plot(results: list[dict], path: Path) -> None:
    """Latency (p50, p99) and Spark jobs per epoch by variant, one group per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['variant']}\n{r['rate']:.0f}/s" for r in results]
    x = range(len(results))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    a1.bar([i - 0.2 for i in x], [r["latency_ms"]["p50"] for r in results], 0.4, label="p50")
    a1.bar([i + 0.2 for i in x], [r["latency_ms"]["p99"] for r in results], 0.4, label="p99")
    a1.set_xticks(list(x), labels)
    a1.set_ylabel("latency (ms)")
    a1.legend()
    a2.bar([i - 0.2 for i in x], [r["breakdown"]["spark_jobs_per_epoch"] for r in results], 0.4, label="jobs")
    a2.bar([i + 0.2 for i in x], [r["breakdown"]["spark_tasks_per_epoch"] for r in results], 0.4, label="tasks")
    a2.set_xticks(list(x), labels)
    a2.set_ylabel("per epoch")
    a2.legend()
    fig.suptitle("YCSB-T on Spark local[2] (shared 2-core machine: see load_average in the JSON)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    raise SystemExit(main())
