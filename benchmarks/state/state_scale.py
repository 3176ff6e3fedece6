"""State at scale on the Spark runtime (Styx §7, Figs. 13-15): snapshot interference, recovery time, import.

Every experiment loads YCSB-T accounts with :meth:`SparkRuntime.load_rows` (written straight into the durable
copy as the epoch -1 snapshot: no Spark job, no request per key), runs the driver (Spark session, query,
epoch coordinator) as a child process and drives it open loop from this process through the SQLite input and
output logs (as a gateway would), so the driver can be SIGKILLed and restarted under load. Requests are timed
from due to reply; throughput and latency are binned per second of completion.

A *snapshot* is a compaction of every partition's durable copy into a new immutable base (the full checkpoint
a recovery loads); every epoch's delta file (the incremental snapshot) is always written.

    # Fig. 13: snapshots every second vs rare, alternating phases in one driver session
    .venv/bin/python benchmarks/state/state_scale.py interference --keys 1000000 --rate 300 --phase-s 45
    # Fig. 14: SIGKILL the driver (restarted at once), then lose the Python workers (pyspark daemon)
    .venv/bin/python benchmarks/state/state_scale.py recovery --keys 1000000 --rate 300 --kill driver
    .venv/bin/python benchmarks/state/state_scale.py recovery --keys 1000000 --rate 300 --kill worker
    # the driver restart without the restart ramp (SparkConfig.restart_batch = max_batch); the JSON's
    # recovery.trace lists the restarted driver's events (query start, micro-batches, Spark jobs, records)
    .venv/bin/python benchmarks/state/state_scale.py recovery --keys 1000000 --rate 200 --kill driver \
        --restart-batch 20000
    # Fig. 15 scaled down: a 3 GB state imported and snapshotted; disk use over a run with snapshots
    .venv/bin/python benchmarks/state/state_scale.py import --keys 1000000 --value-bytes 3000 --seconds 120
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "results" / "state"
APP = "charon.apps.ycsb:app"


# ---- the driver (a child process) ---------------------------------------------------------------------------
def _config(data_dir: str, partitions: int, master: str, restart_batch: int | None = None):
    from charon.config import SparkConfig

    # compaction only from the snapshot thread below (compact_every=0), at the interval the parent sets
    extra = {} if restart_batch is None else {"restart_batch": restart_batch}
    return SparkConfig(master=master, data_dir=data_dir, partitions=partitions, max_batch=20_000, compact_every=0,
                       local_dir=os.path.join(data_dir, "local"), **extra)


def run_driver(args: argparse.Namespace) -> int:
    """Start the runtime and take a snapshot every ``<data_dir>/snapshot_interval`` seconds until SIGTERM."""
    from charon.runtime.spark.runtime import SparkRuntime

    events = open(os.path.join(args.data_dir, "events.jsonl"), "a")  # noqa: SIM115 - open for the process
    lock = threading.Lock()

    def log(ev: str, **kw: object) -> None:
        with lock:
            events.write(json.dumps({"ev": ev, "t": time.time(), "pid": os.getpid(), **kw}) + "\n")
            events.flush()

    log("process_start")
    rt = SparkRuntime(APP, _config(args.data_dir, args.partitions, args.master, args.restart_batch))
    rt.spark  # noqa: B018 - the JVM and the session, timed apart from the query
    log("session_ready")
    compact = rt._compact

    def timed_compaction(upto: int) -> None:
        t0, c0 = time.time(), time.thread_time()
        compact(upto)
        size = sum(os.path.getsize(os.path.join(rt.durable._dir(p), n))
                   for p in range(rt.config.partitions) for n in rt.durable.files(p))
        log("snapshot", start=t0, end=time.time(), cpu_s=time.thread_time() - c0, upto=upto, bytes=size)

    rt._compact = timed_compaction  # type: ignore[method-assign]
    _trace_restart(rt, log)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rt.start()
    log("query_started", epoch=rt.last_epoch)

    def snapshots() -> None:
        last = time.time()
        while not stop.wait(0.05):
            try:
                interval = float(Path(args.data_dir, "snapshot_interval").read_text())
            except (OSError, ValueError):
                interval = math.inf
            if time.time() - last >= interval and rt.last_epoch >= 1:
                last = time.time()
                rt._start_compaction(rt.last_epoch - 1)  # as compact_every does: the recorded epoch before last

    threading.Thread(target=snapshots, daemon=True).start()
    stop.wait()
    log("stopping")
    rt.close()
    log("stopped")
    return 0


def _trace_restart(rt, log, jobs: int = 40) -> None:
    """Log the restart path: the query's start, each micro-batch (its epoch and size), the first ``jobs`` Spark
    jobs (one per round) and each epoch record written, with the epoch's restore time (executor LMDB open)."""
    from charon.runtime.spark.exchange import SparkExchange
    from charon.runtime.spark.source import batch_offsets

    start_query, on_batch, recorded = rt._start_query, rt._on_batch, rt._recorded
    run_job = SparkExchange.run_job
    left = [jobs]

    def traced_start_query() -> None:
        log("query_start_begin")
        start_query()
        log("query_start_returned")

    def traced_on_batch(df, batch_id: int) -> None:
        try:
            s, e = batch_offsets(rt._query_ckpt, int(batch_id))
            n = sum(b - a for a, b in zip(s, e, strict=True))
        except FileNotFoundError:
            n = None
        log("batch_begin", epoch=int(batch_id), requests=n, recorded=rt.last_recorded_epoch())
        on_batch(df, batch_id)
        log("batch_end", epoch=int(batch_id))

    def traced_recorded(rec) -> None:
        recorded(rec)
        log("recorded", epoch=rec.epoch, requests=sum(b - a for a, b in zip(rec.starts, rec.ends, strict=True)),
            restore_s=rec.stats.get("spark_restore_s"), job_s=rec.stats.get("spark_job_s"),
            jobs=rec.stats.get("spark_jobs"))

    def traced_run_job(self, payloads):
        t = time.time()
        out = run_job(self, payloads)
        if left[0] > 0:
            left[0] -= 1
            log("job", start=t, epoch=self.epoch, tasks=self.tasks_for(payloads),
                bytes=sum(len(b) for _, b in payloads))
        return out

    rt._start_query, rt._on_batch, rt._recorded = traced_start_query, traced_on_batch, traced_recorded
    SparkExchange.run_job = traced_run_job


# ---- the load (this process) --------------------------------------------------------------------------------
def bulk_load(data_dir: str, keys: int, partitions: int, master: str, value_bytes: int = 0) -> dict:
    """Write ``keys`` accounts (and a ``pad`` item of ``value_bytes`` each) as the first snapshot."""
    from charon import serde
    from charon.apps import ycsb
    from charon.runtime.spark.runtime import SparkRuntime

    rt = SparkRuntime(APP, _config(data_dir, partitions, master))  # no Spark session: nothing starts
    bal = serde.encode(ycsb.INITIAL_BALANCE)
    pad = serde.encode(os.urandom(value_bytes)) if value_bytes else None

    def rows():
        for i in range(keys):
            k = ycsb.key(i)
            yield "account", k, "", bal
            if pad is not None:
                yield "account", k, "pad", pad

    t0, c0 = time.perf_counter(), time.process_time()
    n = rt.load_rows(rows())
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    size = _du(os.path.join(rt.ckpt, "state"))
    return {"items": n, "keys": keys, "value_bytes": value_bytes, "wall_s": wall, "cpu_s": cpu, "bytes": size,
            "mb_per_s": size / 1e6 / wall, "items_per_s": n / wall}


def _du(path: str) -> int:
    if os.path.isfile(path):
        return os.lstat(path).st_blocks * 512
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512  # allocated (LMDB's map is sparse)
            except FileNotFoundError:
                pass
    return total


def disk_sample(data_dir: str) -> dict[str, int]:
    ck = os.path.join(data_dir, "checkpoint")
    out = {"state": _du(os.path.join(ck, "state")), "local_lmdb": _du(os.path.join(data_dir, "local")),
           "epoch_records": _du(os.path.join(ck, "epochs")), "spark_query_ckpt": _du(os.path.join(ck, "query")),
           "logs": sum(_du(os.path.join(data_dir, n)) for n in os.listdir(data_dir) if ".sqlite" in n)}
    out["total"] = _du(data_dir)
    return out


def spawn_driver(args: argparse.Namespace, data_dir: str) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "driver", "--data-dir", data_dir, "--partitions", str(args.partitions),
           "--master", args.master]
    if getattr(args, "restart_batch", None) is not None:
        cmd += ["--restart-batch", str(args.restart_batch)]
    log = open(os.path.join(data_dir, "driver.out"), "a")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def read_events(data_dir: str) -> list[dict]:
    try:
        return [json.loads(line) for line in Path(data_dir, "events.jsonl").read_text().splitlines() if line]
    except FileNotFoundError:
        return []


def wait_event(data_dir: str, ev: str, after: float, proc: subprocess.Popen, timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for e in read_events(data_dir):
            if e["ev"] == ev and e["t"] >= after:
                return e
        if proc.poll() is not None:
            raise RuntimeError(f"the driver exited ({proc.returncode}); see {data_dir}/driver.out")
        time.sleep(0.1)
    raise TimeoutError(ev)


def stop_driver(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def pyspark_workers(root_pid: int) -> list[int]:
    """The pyspark daemon and its forked Python workers under the driver process (local mode)."""
    import psutil

    out = []
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            if "pyspark.daemon" in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


async def drive(data_dir: str, keys: int, rate: float, seconds: float, on_tick=None, seed: int = 0) -> dict:
    """Open-loop YCSB-T transfers for ``seconds``; every request's due and reply time (absolute); the epoch
    records seen (file name -> first time seen). ``on_tick(t_rel)`` runs every 50 ms (phases, kills)."""
    import random

    from charon.apps import ycsb
    from charon.log.client import LogClient
    from charon.log.sqlite import InputLog, OutputLog

    client = LogClient(InputLog(os.path.join(data_dir, "input.sqlite")),
                       OutputLog(os.path.join(data_dir, "output.sqlite")))
    rng = random.Random(seed)
    samples: list[list] = []  # [due, done or None, ok]
    epochs_dir = os.path.join(data_dir, "checkpoint", "epochs")
    seen: dict[str, float] = {n: 0.0 for n in os.listdir(epochs_dir)}
    tasks: set[asyncio.Task] = set()
    loop = asyncio.get_running_loop()
    t0 = time.time()

    async def one(s: list, src: str, dst: str, amount: int) -> None:
        try:
            rep = await client.submit("account", src, "transfer", [dst, amount], request_id=uuid.uuid4().hex,
                                      timeout=600)
            s[2] = bool(rep.ok)
        except Exception:  # noqa: BLE001 - counted as unanswered
            s[2] = False
        s[1] = time.time()

    async def watch() -> None:
        while True:
            now = time.time()
            for n in os.listdir(epochs_dir):
                seen.setdefault(n, now)
            if on_tick is not None:
                on_tick(now - t0)
            await asyncio.sleep(0.05)

    watcher = loop.create_task(watch())
    total = int(seconds * rate)
    for i in range(total):
        due = t0 + i / rate
        if due > time.time():
            await asyncio.sleep(due - time.time())
        s = [due, None, False]
        samples.append(s)
        task = loop.create_task(one(s, ycsb.key(rng.randrange(keys)), ycsb.key(rng.randrange(keys)),
                                    rng.randint(1, 10)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(set(tasks), timeout=180)
    watcher.cancel()
    return {"t0": t0, "samples": samples, "epochs_seen": seen}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def bins(samples: list[list], t0: float, end: float) -> list[dict]:
    """Per second of completion: committed, answered, p50/p99 latency (ms) of the replies in that second."""
    n = int(math.ceil(end - t0)) + 1
    lat: list[list[float]] = [[] for _ in range(n)]
    ok = [0] * n
    for due, done, good in samples:
        if done is None:
            continue
        b = int(done - t0)
        if 0 <= b < n:
            lat[b].append((done - due) * 1000)
            ok[b] += bool(good)
    return [{"t": i, "committed": ok[i], "answered": len(lat[i]), "p50_ms": pct(lat[i], 50),
             "p99_ms": pct(lat[i], 99)} for i in range(n)]


def window(samples: list[list], lo: float, hi: float) -> dict:
    """Requests due in [lo, hi): committed per second (by completion inside the window), latency."""
    due = [s for s in samples if lo <= s[0] < hi]
    done = [s for s in due if s[1] is not None]
    lat = [(s[1] - s[0]) * 1000 for s in done]
    thr = sum(1 for s in samples if s[1] is not None and s[2] and lo <= s[1] < hi) / max(hi - lo, 1e-9)
    return {"requests": len(due), "answered": len(done), "committed_per_s": thr, "p50_ms": pct(lat, 50),
            "p99_ms": pct(lat, 99), "mean_ms": sum(lat) / len(lat) if lat else None}


def conservation(data_dir: str, partitions: int, keys: int) -> dict:
    """Sum the account balances in the durable copy as of the last recorded epoch: YCSB-T conserves money."""
    from charon import serde
    from charon.apps import ycsb
    from charon.state.durable import DurableState

    d = DurableState(os.path.join(data_dir, "checkpoint", "state"))
    names = os.listdir(os.path.join(data_dir, "checkpoint", "epochs"))
    last = max(int(n.split(".")[0]) for n in names if n.endswith(".msgpack"))  # the last recorded epoch
    total, n = 0, 0
    for p in range(partitions):
        state, _ = d.load(p, last)
        for k, v in state.items():
            if k.endswith(b"\0"):  # item "" = the balance
                total += serde.decode(v)
                n += 1
    return {"epoch": last, "accounts": n, "total": total, "expected": keys * ycsb.INITIAL_BALANCE,
            "conserved": total == keys * ycsb.INITIAL_BALANCE and n == keys}


def _cleanup(args: argparse.Namespace, data: str) -> None:
    if args.keep:
        print(f"[scale] kept {data}", flush=True)
    else:
        shutil.rmtree(data, ignore_errors=True)


def _env() -> None:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def _setup(args: argparse.Namespace, value_bytes: int = 0) -> tuple[str, dict]:
    data = tempfile.mkdtemp(prefix="charon-scale-", dir=args.tmp)
    load = bulk_load(data, args.keys, args.partitions, args.master, value_bytes)
    print(f"[scale] loaded {load['items']:,} items ({load['bytes'] / 1e6:.0f} MB) in {load['wall_s']:.1f} s "
          f"({load['mb_per_s']:.0f} MB/s, {load['items_per_s']:,.0f} items/s)", flush=True)
    return data, load


def _meta(args: argparse.Namespace) -> dict:
    return {"command": " ".join([".venv/bin/python", "benchmarks/state/state_scale.py", *sys.argv[1:]]),
            "master": args.master, "partitions": args.partitions, "keys": args.keys, "when": time.time(),
            "cpus": os.cpu_count(), "restart_batch": getattr(args, "restart_batch", None)}


# ---- experiments --------------------------------------------------------------------------------------------
def interference(args: argparse.Namespace) -> dict:
    """Alternating phases of snapshots every ``--every-s`` and rare ones (none), in one driver session."""
    data, load = _setup(args)
    phases = args.phases.split(",")
    interval = {"every": args.every_s, "rare": math.inf}
    Path(data, "snapshot_interval").write_text("inf")
    t_spawn = time.time()
    proc = spawn_driver(args, data)
    started = wait_event(data, "query_started", t_spawn, proc)
    print(f"[scale] driver up in {started['t'] - t_spawn:.1f} s", flush=True)
    seconds = args.warmup_s + len(phases) * args.phase_s
    bounds: list[tuple[str, float, float]] = []
    loads: list[float] = []
    state = {"i": -1}

    def tick(t: float) -> None:
        i = min(len(phases) - 1, int(max(0.0, t - args.warmup_s) // args.phase_s)) if t >= args.warmup_s else -1
        if i != state["i"]:
            state["i"] = i
            Path(data, "snapshot_interval").write_text(str(interval[phases[i]]) if i >= 0 else "inf")
        if int(t * 20) % 20 == 0:
            loads.append(os.getloadavg()[0])

    res = asyncio.run(drive(data, args.keys, args.rate, seconds, tick))
    stop_driver(proc)
    t0 = res["t0"]
    for i, ph in enumerate(phases):
        lo = t0 + args.warmup_s + i * args.phase_s
        bounds.append((ph, lo, lo + args.phase_s))
    events = read_events(data)
    snaps = [e for e in events if e["ev"] == "snapshot"]
    per_phase = []
    for ph, lo, hi in bounds:
        w = window(res["samples"], lo + args.settle_s, hi)
        s = [e for e in snaps if lo <= e["start"] < hi]
        w.update({"phase": ph, "start_s": lo - t0, "end_s": hi - t0, "snapshots": len(s),
                  "snapshot_s_mean": sum(e["end"] - e["start"] for e in s) / len(s) if s else None,
                  "snapshot_cpu_s_mean": sum(e["cpu_s"] for e in s) / len(s) if s else None})
        per_phase.append(w)

    def agg(ph: str, k: str) -> float:
        vals = [w[k] for w in per_phase if w["phase"] == ph and w[k] is not None]
        return sum(vals) / len(vals) if vals else math.nan

    ratios = {k: agg("every", k) / agg("rare", k) for k in ("committed_per_s", "p50_ms", "p99_ms")}
    out = {"experiment": "snapshot_interference", **_meta(args), "rate": args.rate, "phases": per_phase,
           "ratios_every_over_rare": ratios, "load": load, "load_average_mean": sum(loads) / max(1, len(loads)),
           "load_average_max": max(loads, default=None), "snapshot_every_s": args.every_s,
           "timeline": bins(res["samples"], t0, max((s[1] or 0) for s in res["samples"])),
           "snapshots": [{"start_s": e["start"] - t0, "end_s": e["end"] - t0, "cpu_s": e["cpu_s"],
                          "bytes": e["bytes"]} for e in snaps],
           "unanswered": sum(1 for s in res["samples"] if s[1] is None),
           "conservation": conservation(data, args.partitions, args.keys), "disk_end": disk_sample(data)}
    _cleanup(args, data)
    return out


def recovery(args: argparse.Namespace) -> dict:
    """SIGKILL the driver's process group (restarted at once) or the pyspark daemon and its workers."""
    data, load = _setup(args)
    Path(data, "snapshot_interval").write_text(str(args.snapshot_s))
    t_spawn = time.time()
    proc = spawn_driver(args, data)
    started = wait_event(data, "query_started", t_spawn, proc)
    print(f"[scale] driver up in {started['t'] - t_spawn:.1f} s", flush=True)
    info: dict = {}
    loads: list[float] = []

    def tick(t: float) -> None:
        nonlocal proc
        if int(t * 20) % 20 == 0:
            loads.append(os.getloadavg()[0])
        if "kill_t" in info or t < args.kill_at:
            return
        if args.kill == "driver":
            info["killed_pids"] = [proc.pid]
            info["kill_t"] = time.time()
            os.killpg(proc.pid, signal.SIGKILL)  # the driver, its JVM and the Python workers (its own group)
            proc.wait()
            info["restart_t"] = time.time()
            proc = spawn_driver(args, data)
        else:
            pids = pyspark_workers(proc.pid)
            info["killed_pids"] = pids
            info["kill_t"] = time.time()
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        print(f"[scale] killed {args.kill} {info['killed_pids']} at {t:.1f} s", flush=True)

    res = asyncio.run(drive(data, args.keys, args.rate, args.seconds, tick))
    stop_driver(proc)
    t0, kill = res["t0"], info["kill_t"]
    commits = sorted(t for t in res["epochs_seen"].values() if t > 0)
    after = [t for t in commits if t > kill]
    before = [t for t in commits if t <= kill]
    events = read_events(data)
    ev_after = {e["ev"]: e["t"] for e in events if e["t"] > kill and e["ev"] not in ("snapshot",)}
    first = after[0] if after else None
    replies_after = sorted(s[1] for s in res["samples"] if s[1] is not None and s[1] > kill and s[2])
    rec = {"first_commit_after_kill_s": first - kill if first else None,
           "last_commit_before_kill_s": kill - before[-1] if before else None,
           "first_reply_after_kill_s": replies_after[0] - kill if replies_after else None,
           "epoch_gap_s": (first - before[-1]) if first and before else None}
    # the backlog the downtime left (the requests due before the first new commit): answered by when
    backlog = [s[1] for s in res["samples"] if first and kill <= s[0] < first and s[1] is not None]
    rec["backlog_requests"] = len(backlog)
    rec["backlog_answered_after_kill_s"] = max(backlog) - kill if backlog else None
    rec["commits_in_10s_after_first"] = sum(1 for t in after if first and t <= first + 10)
    if args.kill == "driver":
        rec["driver_process_start_s"] = ev_after.get("process_start", math.nan) - kill
        rec["jvm_session_start_s"] = ev_after.get("session_ready", math.nan) - ev_after.get("process_start", math.nan)
        rec["query_start_s"] = ev_after.get("query_started", math.nan) - ev_after.get("session_ready", math.nan)
        rec["first_commit_after_query_start_s"] = (first - ev_after["query_started"]) if first and \
            "query_started" in ev_after else None
    # the restart path, from the kill: query start, micro-batches, Spark jobs (rounds), epoch records
    rec["trace"] = [{**{k: v for k, v in e.items() if k not in ("t", "pid")}, "t_s": e["t"] - kill}
                    for e in events if e["t"] > kill and e["ev"] not in ("snapshot",)][:80]
    out = {"experiment": f"recovery_{args.kill}", **_meta(args), "rate": args.rate, "kill_at_s": kill - t0,
           "killed_pids": info["killed_pids"], "recovery": rec, "load": load,
           "load_average_mean": sum(loads) / max(1, len(loads)), "load_average_max": max(loads, default=None),
           "before_kill": window(res["samples"], kill - 20, kill),
           "after_recovery": window(res["samples"], (first or kill) + 5, t0 + args.seconds),
           "timeline": bins(res["samples"], t0, max((s[1] or 0) for s in res["samples"])),
           "commits_s": [t - t0 for t in commits],
           "unanswered": sum(1 for s in res["samples"] if s[1] is None),
           "aborted_or_failed": sum(1 for s in res["samples"] if s[1] is not None and not s[2]),
           "conservation": conservation(data, args.partitions, args.keys), "disk_end": disk_sample(data)}
    _cleanup(args, data)
    return out


def import_state(args: argparse.Namespace) -> dict:
    """Import a large state, then run with a snapshot every ``--snapshot-s``; disk sampled over time."""
    data, load = _setup(args, args.value_bytes)
    Path(data, "snapshot_interval").write_text(str(args.snapshot_s))
    t_spawn = time.time()
    proc = spawn_driver(args, data)
    started = wait_event(data, "query_started", t_spawn, proc, timeout=1800)
    disk: list[dict] = []
    loads: list[float] = []
    last = {"t": -1.0}

    def tick(t: float) -> None:
        if t - last["t"] >= args.sample_s:
            last["t"] = t
            disk.append({"t": t, **disk_sample(data)})
            loads.append(os.getloadavg()[0])

    res = asyncio.run(drive(data, args.keys, args.rate, args.seconds, tick))
    stop_driver(proc)
    t0 = res["t0"]
    commits = sorted(t for t in res["epochs_seen"].values() if t > 0)
    snaps = [e for e in read_events(data) if e["ev"] == "snapshot"]
    out = {"experiment": "import", **_meta(args), "rate": args.rate, "value_bytes": args.value_bytes, "load": load,
           "driver_start_s": started["t"] - t_spawn,
           "first_epoch_after_query_start_s": (commits[0] - started["t"]) if commits else None,
           "snapshots": [{"start_s": e["start"] - t0, "end_s": e["end"] - t0, "wall_s": e["end"] - e["start"],
                          "cpu_s": e["cpu_s"], "bytes": e["bytes"],
                          "mb_per_s": e["bytes"] / 1e6 / max(e["end"] - e["start"], 1e-9)} for e in snaps],
           "disk": disk, "load_average_mean": sum(loads) / max(1, len(loads)),
           "load_average_max": max(loads, default=None),
           "run": window(res["samples"], t0 + 10, t0 + args.seconds),
           "timeline": bins(res["samples"], t0, max((s[1] or 0) for s in res["samples"])),
           "unanswered": sum(1 for s in res["samples"] if s[1] is None),
           "conservation": conservation(data, args.partitions, args.keys)}
    _cleanup(args, data)
    return out


# ---- plots --------------------------------------------------------------------------------------------------
def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = res["timeline"]
    t = [b["t"] for b in tl]
    rows = 3 if res["experiment"] == "import" else 2
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.6 * rows), sharex=True)
    a1, a2 = axes[0], axes[1]
    a1.plot(t, [b["committed"] for b in tl], lw=1, marker=".", ms=2, label="committed/s")
    a1.axhline(res["rate"], color="gray", ls=":", lw=1, label=f"input {res['rate']:.0f}/s")
    a1.set_ylabel("transactions/s")
    a2.plot(t, [b["p50_ms"] for b in tl], lw=1, marker=".", ms=2, label="p50")
    a2.plot(t, [b["p99_ms"] for b in tl], lw=1, marker=".", ms=2, label="p99")
    a2.set_ylabel("latency (ms)")
    a2.set_yscale("log")
    for s in res.get("snapshots", []):
        for a in axes[:2]:
            a.axvspan(s["start_s"], s["end_s"], color="tab:orange", alpha=0.15, lw=0)
    for ph in res.get("phases", []):
        if ph["phase"] == "every":
            a1.annotate("snapshots every 1 s", (ph["start_s"], 0), fontsize=7)
        for a in axes[:2]:
            a.axvline(ph["start_s"], color="k", lw=0.5)
    if "kill_at_s" in res:
        for a in axes[:2]:
            a.axvline(res["kill_at_s"], color="red", lw=1, label=f"SIGKILL {res['experiment'][9:]}")
        for c in res["commits_s"]:
            a1.plot([c], [0], "|", color="tab:green", ms=4)
        rec = res.get("recovery", {})
        t = res["kill_at_s"]  # the restart's phases, shaded from the kill to the first new commit
        for key, color, name in (("driver_process_start_s", "tab:gray", "process"),
                                 ("jvm_session_start_s", "tab:purple", "JVM+session"),
                                 ("query_start_s", "tab:blue", "query start"),
                                 ("first_commit_after_query_start_s", "tab:cyan", "to 1st commit")):
            d = rec.get(key)
            if isinstance(d, (int, float)) and d == d:
                a1.axvspan(t, t + d, color=color, alpha=0.2, lw=0, label=f"{name} {d:.1f} s")
                t += d
    if rows == 3:
        d = res["disk"]
        a3 = axes[2]
        for k in ("total", "state", "local_lmdb", "logs"):
            a3.plot([x["t"] for x in d], [x[k] / 1e9 for x in d], lw=1, label=k)
        a3.set_ylabel("disk (GB)")
        a3.legend(fontsize=7)
    axes[-1].set_xlabel("time (s)")
    a1.legend(fontsize=7, loc="upper right")
    a2.legend(fontsize=7, loc="upper right")
    title = {"snapshot_interference": "snapshot interference (Styx Fig. 13)", "import": "import (Styx Fig. 15)"}
    fig.suptitle(f"{title.get(res['experiment'], res['experiment'] + ' (Styx Fig. 14)')}: {res['keys']:,} keys, "
                 f"{res['master']}, {res['partitions']} partitions, load avg {res['load_average_mean']:.1f}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--keys", type=int, default=100_000)
    common.add_argument("--partitions", type=int, default=4)
    common.add_argument("--master", default="local[2]")
    common.add_argument("--rate", type=float, default=300.0)
    common.add_argument("--tmp", default=None, help="parent of the run's data directory")
    common.add_argument("--out", default=str(OUT), help="directory of the JSON and PNG")
    common.add_argument("--label", default="")
    common.add_argument("--keep", action="store_true", help="keep the data directory")
    common.add_argument("--restart-batch", type=int, default=None,
                        help="SparkConfig.restart_batch (default: its default; 20000 = no ramp after a restart)")
    d = sub.add_parser("driver")
    d.add_argument("--data-dir", required=True)
    d.add_argument("--partitions", type=int, default=4)
    d.add_argument("--master", default="local[2]")
    d.add_argument("--restart-batch", type=int, default=None)
    i = sub.add_parser("interference", parents=[common])
    i.add_argument("--phases", default="rare,every,rare,every")
    i.add_argument("--phase-s", type=float, default=40.0)
    i.add_argument("--warmup-s", type=float, default=15.0)
    i.add_argument("--settle-s", type=float, default=5.0, help="skipped at the start of each phase")
    i.add_argument("--every-s", type=float, default=1.0)
    r = sub.add_parser("recovery", parents=[common])
    r.add_argument("--kill", choices=["driver", "worker"], default="driver")
    r.add_argument("--kill-at", type=float, default=30.0)
    r.add_argument("--seconds", type=float, default=90.0)
    r.add_argument("--snapshot-s", type=float, default=10.0)
    m = sub.add_parser("import", parents=[common])
    m.add_argument("--value-bytes", type=int, default=3000)
    m.add_argument("--seconds", type=float, default=120.0)
    m.add_argument("--snapshot-s", type=float, default=10.0)
    m.add_argument("--sample-s", type=float, default=2.0)
    rp = sub.add_parser("replot", help="redraw the PNG of a result JSON")
    rp.add_argument("json")
    args = ap.parse_args(argv)
    _env()
    if args.cmd == "replot":
        plot(json.loads(Path(args.json).read_text()), Path(args.json).with_suffix(".png"))
        return 0
    if args.cmd == "driver":
        return run_driver(args)
    res = {"interference": interference, "recovery": recovery, "import": import_state}[args.cmd](args)
    name = {"interference": "state_scale_interference", "recovery": f"state_scale_recovery_{getattr(args, 'kill', '')}",
            "import": "state_scale_import"}[args.cmd] + (f"_{args.label}" if args.label else "")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=float))
    plot(res, out / f"{name}.png")
    summary = {k: v for k, v in res.items() if k not in ("timeline", "commits_s", "disk", "snapshots")}
    print(json.dumps(summary, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
