"""In-process targets: the engine alone, the YCSB-T open loop, Deathstar travel against PostgreSQL.

    .venv/bin/python benchmarks/engine/engine_perf.py --before-src /work/main      # before (that checkout) and after
    .venv/bin/python benchmarks/engine/engine_perf.py --quick                      # shorter runs
    .venv/bin/python benchmarks/engine/engine_perf.py --only-engine --before-src /work/main   # figure 1 only

Writes ``benchmarks/results/engine/engine_perf.json`` and ``.png``. Every measurement runs in a fresh
child process; ``--before-src`` points at a checkout of the code before the change (the child imports
``charon`` from there), so before and after come from the same run on the same machine.

The machine is shared (2 cores, other jobs): wall-clock latencies depend on how much CPU this process got,
so each point also reports the CPU time per request (``time.process_time``, robust to the others' load) and
the CPU share the process received (CPU seconds / wall seconds). Figures:

1. engine alone: batches of 1,000 YCSB-T transfers (10k accounts, 4 partitions) through ``run_epoch``, one
   core; µs of CPU per transaction with the default collector and with :func:`tune_gc` (what a started
   runtime uses); before and after alternate ``--repeat`` times (the best median counts), next to a bare
   arithmetic epoch loop with Aria's commit rule (no functions, no messages: a machine-speed reference
   showing how much the shared machine inflates CPU times, not a reachable ceiling). With ``perf`` installed,
   also user-space instructions per transaction (:func:`engine_instructions`), which the neighbours' load
   hardly moves: the figure to compare small before/after differences with.
2. open loop: YCSB-T at several rates against a started ``InProcessRuntime`` (load generator in the same
   process, as the suite runs it): latency percentiles, epoch sizes, CPU per request.
3. Deathstar travel mix: CPU per request in batches, and the open loop at several rates, next to PostgreSQL
   (both isolation modes, the load generator in its own process reporting its own CPU, pool size chosen by
   measurement: the best of ``--pg-pools`` at the highest rate).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = ROOT / "benchmarks" / "results" / "engine"


# ------------------------------------------------------------------------------------------- child side


def _use_src(src: str | None) -> None:
    """Import ``charon`` from ``src`` (a checkout) instead of the installed (editable) package."""
    if src:
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                            and "editable" not in getattr(f, "__name__", "").lower()]
        sys.path.insert(0, src)


def _run(main: object) -> object:
    """Run a coroutine on an event loop with microsecond timers (select(2); epoll rounds every timeout up to a
    whole millisecond, which would delay the generator's sends): the same loop for every system measured."""
    import asyncio
    import selectors

    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selectors.SelectSelector())) as runner:
        return runner.run(main)


def _deathstar_runtime(**kw: object) -> object:
    from charon import InProcessRuntime
    from charon.apps import deathstar

    rt = InProcessRuntime(deathstar.app, partitions=4, **kw)
    for op, key, value, items in deathstar.populate():
        if value is not None:
            rt.load(op, {key: value})
        if items:
            rt.load_items(op, key, items)
    return rt


def bare_loop(n_accounts: int, batches: list[list[tuple[int, int, int]]]) -> float:
    """CPU µs per transfer of a minimal deterministic epoch loop: dry run on a snapshot, Aria commit, serial rerun."""
    state = dict.fromkeys(range(n_accounts), 1_000_000)
    t0 = time.process_time()
    n = 0
    for batch in batches:
        writes: list[dict[int, int]] = []
        min_writer: dict[int, int] = {}
        for tid, (a, b, amt) in enumerate(batch):
            w = {}
            bal = state[a]
            if bal >= amt:
                w[a] = bal - amt
                w[b] = state[b] + amt if b != a else bal
            writes.append(w)
            for k in (a, b):
                if k not in min_writer:
                    min_writer[k] = tid
        for tid, (a, b, _amt) in enumerate(batch):
            if min_writer[a] < tid or min_writer[b] < tid:  # conflict: rerun in TID order after the commits
                continue
            state.update(writes[tid])
        for tid, (a, b, amt) in enumerate(batch):
            if min_writer[a] < tid or min_writer[b] < tid:
                if state[a] >= amt:
                    state[a] -= amt
                    state[b] += amt
        n += len(batch)
    return (time.process_time() - t0) / n * 1e6


def child_engine(src: str | None, epochs: int) -> dict:
    _use_src(src)
    import gc
    import random
    import uuid

    from charon import InProcessRuntime, serde
    from charon.apps import ycsb
    from charon.messages import Request

    n = 10_000
    rng = random.Random(0)
    raw = [[(rng.randrange(n), rng.randrange(n), rng.randint(1, 10)) for _ in range(1000)] for _ in range(epochs)]
    out: dict = {"bare_loop_us": min(bare_loop(n, raw) for _ in range(3))}
    for mode in ("default_gc", "tuned_gc"):
        rt = InProcessRuntime(ycsb.app, partitions=4)
        rt.load("account", ycsb.initial_state(n))
        batches = [[Request(uuid.uuid4().hex, "account", ycsb.key(a), "transfer", serde.encode([ycsb.key(b), x]))
                    for a, b, x in batch] for batch in raw]
        for b in batches[:3]:  # warm-up
            rt.run_epoch(b)
        if mode == "tuned_gc":
            gc.collect()
            gc.freeze()
            gc.set_threshold(50_000, 20, 100)
        chunks = []
        for i in range(3, len(batches), 5):
            t = time.process_time()
            for b in batches[i:i + 5]:
                rt.run_epoch(b)
            chunks.append((time.process_time() - t) / (1000 * len(batches[i:i + 5])) * 1e6)
        out[mode] = {"us_per_tx_chunks": chunks, "us_per_tx_best": min(chunks),
                     "us_per_tx_median": sorted(chunks)[len(chunks) // 2]}
        if mode == "tuned_gc":
            gc.unfreeze()
            gc.set_threshold(700, 10, 10)
    return out


def child_engine_run(src: str | None, epochs: int, run: int) -> dict:
    """The engine-alone workload of :func:`child_engine` (tuned GC): three warm-up epochs, then ``run`` more
    (for :func:`engine_instructions`, which counts the difference of two such processes)."""
    _use_src(src)
    import random
    import uuid

    from charon import InProcessRuntime, serde
    from charon.apps import ycsb
    from charon.messages import Request

    n = 10_000
    rng = random.Random(0)
    raw = [[(rng.randrange(n), rng.randrange(n), rng.randint(1, 10)) for _ in range(1000)] for _ in range(epochs)]
    rt = InProcessRuntime(ycsb.app, partitions=4)
    rt.load("account", ycsb.initial_state(n))
    batches = [[Request(uuid.uuid4().hex, "account", ycsb.key(a), "transfer", serde.encode([ycsb.key(b), x]))
                for a, b, x in batch] for batch in raw]
    return _warm_then_run(rt, batches, run)


def _warm_then_run(rt: Any, batches: list, run: int) -> dict:
    """Three warm-up epochs, the collector tuned as a started runtime tunes it, then ``run`` measured epochs."""
    import gc

    for b in batches[:3]:
        rt.run_epoch(b)
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    for b in batches[3:3 + run]:
        rt.run_epoch(b)
    return {"ran": min(run, len(batches) - 3)}


def _shapes_app() -> object:
    """Transactions of one shape each (the costs a transfer adds up): ``noop`` (one invocation, nothing else),
    ``rw`` (one invocation reading and writing its entity), ``call`` (one call to another entity that does
    nothing), ``transfer`` (YCSB-T's: ``rw`` plus a call that reads and writes)."""
    from charon import Application, Context, Operator

    account = Operator("account")

    @account.function(public=True)
    async def noop(ctx: Context, to: str, amount: int) -> int:
        return amount

    @account.function(public=True)
    async def rw(ctx: Context, to: str, amount: int) -> int:
        b = ctx.get(default=0)
        ctx.put(b - amount)
        return b

    @account.function(public=True)
    async def nothing(ctx: Context, amount: int) -> None:
        return None

    @account.function(public=True)
    async def call(ctx: Context, to: str, amount: int) -> int:
        await ctx.call(account, to, nothing, amount)
        return amount

    @account.function(public=True)
    async def deposit(ctx: Context, amount: int) -> None:
        ctx.put(ctx.get(default=0) + amount)

    @account.function(public=True)
    async def transfer(ctx: Context, to: str, amount: int) -> int:
        b = ctx.get(default=0)
        ctx.put(b - amount)
        await ctx.call(account, to, deposit, amount)
        return b - amount

    return Application("shapes", [account])


SHAPES = ("noop", "rw", "call", "transfer")


def child_shape_run(src: str | None, shape: str, epochs: int, run: int) -> dict:
    """The engine-alone workload (tuned GC) with transactions of one :func:`_shapes_app` shape."""
    _use_src(src)
    import random
    import uuid

    from charon import InProcessRuntime, serde
    from charon.messages import Request

    n = 10_000
    rng = random.Random(0)
    raw = [[(rng.randrange(n), rng.randrange(n), rng.randint(1, 10)) for _ in range(1000)] for _ in range(epochs)]
    rt = InProcessRuntime(_shapes_app(), partitions=4)
    rt.load("account", {f"a{i}": 1_000_000 for i in range(n)})
    batches = [[Request(uuid.uuid4().hex, "account", f"a{a}", shape, serde.encode([f"a{b}", x])) for a, b, x in batch]
               for batch in raw]
    return _warm_then_run(rt, batches, run)


def child_deathstar_batch(src: str | None, epochs: int, size: int) -> dict:
    _use_src(src)
    import gc
    import random
    import uuid

    from charon import InProcessRuntime, serde
    from charon.apps import deathstar
    from charon.messages import Request

    rt = InProcessRuntime(deathstar.app, partitions=4)
    for op, key, value, items in deathstar.populate():
        if value is not None:
            rt.load(op, {key: value})
        if items:
            rt.load_items(op, key, items)
    rng = random.Random(0)
    batches = []
    for _ in range(epochs):
        b = []
        for _ in range(size):
            op, key, fn, args = deathstar.next_request(rng)
            b.append(Request(uuid.uuid4().hex, op, key, fn, serde.encode(args)))
        batches.append(b)
    for b in batches[:2]:
        rt.run_epoch(b)
    gc.collect()
    gc.freeze()
    t = time.process_time()
    for b in batches[2:]:
        rt.run_epoch(b)
    return {"us_per_request": (time.process_time() - t) / ((epochs - 2) * size) * 1e6, "epoch_size": size}


def child_open_loop(src: str | None, workload: str, rates: list[float], duration: float, warmup: float) -> dict:
    _use_src(src)

    from charon import InProcessRuntime
    from charon.apps import deathstar, ycsb
    from charon.bench import harness

    async def main() -> list[dict]:
        if workload == "ycsb":
            import random as _r
            n = 10_000

            def gen(rng: _r.Random) -> tuple:
                return ("account", ycsb.key(rng.randrange(n)), "transfer", [ycsb.key(rng.randrange(n)),
                                                                             rng.randint(1, 10)])
            rt = InProcessRuntime(ycsb.app, partitions=4)
            rt.load("account", ycsb.initial_state(n))
        else:
            gen = deathstar.next_request
            rt = InProcessRuntime(deathstar.app, partitions=4)
            for op, key, value, items in deathstar.populate():
                if value is not None:
                    rt.load(op, {key: value})
                if items:
                    rt.load_items(op, key, items)
        res = []
        async with rt:
            for rate in rates:
                c0, w0 = time.process_time(), time.perf_counter()
                r = await harness.run_open_loop(rt, gen, rate=rate, duration=duration, warmup=warmup, seed=int(rate),
                                                drain_timeout=20)
                cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                r.pop("timeline", None)
                r["cpu_us_per_request"] = cpu / max(r["sent"], 1) * 1e6
                r["cpu_share"] = cpu / wall
                res.append(r)
        return res

    return {"points": _run(main())}


def child_postgres(dsn: str, workload: str, isolation: str, pool: int, rates: list[float], duration: float,
                   warmup: float) -> dict:

    from charon.apps import deathstar, ycsb
    from charon.bench import harness
    from charon.bench.postgres import DeathstarSql, PostgresBaseline, YcsbSql

    async def main() -> list[dict]:
        if workload == "ycsb":
            n = 10_000

            def gen(rng):  # noqa: ANN001, ANN202
                return ("account", ycsb.key(rng.randrange(n)), "transfer", [ycsb.key(rng.randrange(n)),
                                                                             rng.randint(1, 10)])
            sql = YcsbSql()
        else:
            gen, sql = deathstar.next_request, DeathstarSql()
        res = []
        async with PostgresBaseline(dsn, sql, pool_size=pool, isolation=isolation) as pg:
            for rate in rates:
                c0, w0 = time.process_time(), time.perf_counter()
                r = await harness.run_open_loop(pg, gen, rate=rate, duration=duration, warmup=warmup, seed=int(rate),
                                                drain_timeout=20)
                cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                r.pop("timeline", None)
                r["client_cpu_us_per_request"] = cpu / max(r["sent"], 1) * 1e6
                r["client_cpu_share"] = cpu / wall  # the load generator's own process
                r.update({"isolation": isolation, "pool": pool})
                res.append(r)
        return res

    return {"points": _run(main())}


def child_serve(src: str | None, port: int, token: str) -> dict:
    """The Deathstar application on an in-process runtime behind Charon's HTTP gateway (``charon run``'s
    server: uvicorn, volatile runtime), until SIGTERM."""
    _use_src(src)
    from charon.server.serve import serve

    serve(_deathstar_runtime(), port=port, token=token)  # type: ignore[arg-type]
    return {}


class _HttpReply:
    __slots__ = ("ok", "error_type")

    def __init__(self, ok: bool, error_type: str = "") -> None:
        self.ok, self.error_type = ok, error_type


def child_http_loop(url: str, token: str, rates: list[float], duration: float, warmup: float) -> dict:
    """The open loop in its own process against the gateway at ``url`` (Charon's own ``AsyncClient``)."""
    from charon.apps import deathstar
    from charon.bench import harness
    from charon.client import AsyncClient
    from charon.errors import TransactionAborted

    async def main() -> list[dict]:
        async with AsyncClient(url, token=token, retries=0) as client:
            class Target:
                async def submit(self, op: str, key: str, fn: str, args: list, *,
                                 request_id: str | None = None) -> _HttpReply:
                    try:
                        await client.invoke_result(op, key, fn, *args, request_id=request_id)
                    except TransactionAborted as exc:
                        return _HttpReply(False, exc.error_type)
                    return _HttpReply(True)

            res = []
            for rate in rates:
                c0, w0 = time.process_time(), time.perf_counter()
                r = await harness.run_open_loop(Target(), deathstar.next_request, rate=rate, duration=duration,
                                                warmup=warmup, seed=int(rate), drain_timeout=20)
                cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                r.pop("timeline", None)
                r["client_cpu_us_per_request"] = cpu / max(r["sent"], 1) * 1e6
                r["client_cpu_share"] = cpu / wall
                res.append(r)
            return res

    return {"points": _run(main())}


CHILDREN = {"serve": child_serve, "http_loop": child_http_loop,
            "engine": child_engine, "engine_run": child_engine_run, "shape_run": child_shape_run,
            "deathstar_batch": child_deathstar_batch,
            "open_loop": child_open_loop,
            "postgres": child_postgres}


# ------------------------------------------------------------------------------------------ parent side


def run_child(kind: str, **kw: object) -> dict:
    """Run one measurement in a fresh interpreter (this file, ``--child``) and return its JSON."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--child-args", json.dumps(kw)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _count_instructions(cmd: list[str], env: dict) -> int | None:
    """User-space instructions of one child: ``perf stat`` where the machine has the counter, else Valgrind's
    ``cachegrind`` (a VM without performance counters; about 30x slower, the same figure within ~1%); None when
    neither can count."""
    import shutil

    perf, valgrind = shutil.which("perf"), shutil.which("valgrind")
    if perf is not None and _INSTRUCTIONS.get("tool", "perf") == "perf":
        p = subprocess.run([perf, "stat", "-x,", "-e", "instructions:u", *cmd], capture_output=True, text=True,
                           cwd=ROOT, check=False, env=env)
        lines = [ln for ln in p.stderr.splitlines() if "instructions" in ln]
        value = lines[-1].split(",")[0] if lines else ""
        if p.returncode == 0 and value.isdigit():
            _INSTRUCTIONS["tool"] = "perf"
            return int(value)
    if valgrind is None:
        return None
    # (cmd[0] must be the interpreter or a symlink to it, as a venv's is: of a launcher script, such as pyenv's
    # shims, valgrind would count the script's shell only)
    p = subprocess.run([valgrind, "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null", *cmd],
                       capture_output=True, text=True, cwd=ROOT, check=False, env=env)
    refs = [ln for ln in p.stderr.splitlines() if "I   refs:" in ln or "I    refs:" in ln]
    if p.returncode != 0 or not refs:
        return None
    _INSTRUCTIONS["tool"] = "valgrind"
    return int(refs[-1].split(":")[1].strip().replace(",", ""))


_INSTRUCTIONS: dict[str, str] = {}  # {"tool": "perf" | "valgrind"}: what counted (see instruction_tool)


def instruction_tool() -> str | None:
    """What counted the instructions of the last :func:`engine_instructions` (``perf`` or ``valgrind``)."""
    return _INSTRUCTIONS.get("tool")


def engine_instructions(src: str | None, epochs: int, shape: str | None = None,
                        hash_seed: str | None = None) -> float | None:
    """User-space instructions per transaction of the engine-alone workload (``perf stat``, or Valgrind where
    the machine has no counters: :func:`_count_instructions`; None without either).

    Two children build the same workload and run 3 warm-up epochs; one then runs ``epochs - 3`` more: the
    difference, per transaction, is what those epochs cost. Unlike CPU time it hardly moves with the
    neighbours' load (about 0.3% between runs here), so small before/after differences show; string hashing
    (``PYTHONHASHSEED``, random by default) moves it by up to ±2%, so ``hash_seed`` can fix it. ``shape``: a
    :func:`_shapes_app` shape instead of YCSB-T's transfer."""
    env = dict(os.environ)
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    counts = []
    for run in (0, epochs - 3):
        kind, args = ("engine_run", {"src": src, "epochs": epochs, "run": run}) if shape is None else (
            "shape_run", {"src": src, "shape": shape, "epochs": epochs, "run": run})
        n = _count_instructions([sys.executable, str(Path(__file__).resolve()), "--child", kind, "--child-args",
                                 json.dumps(args)], env)
        if n is None:
            return None
        counts.append(n)
    return (counts[1] - counts[0]) / ((epochs - 3) * 1000)


def proc_cpu_s(pid: int, children: bool = False) -> float:
    """CPU seconds of process ``pid`` (all its threads; with ``children``, plus its reaped children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + ((cutime + cstime) if children else 0)) / os.sysconf("SC_CLK_TCK")


def http_layout(src: str | None, rates: list[float], duration: float, warmup: float) -> list[dict]:
    """Deathstar through the gateway: the engine (in-process runtime + HTTP gateway) in one process, the load
    generator in another (one fresh generator per rate, the server kept), as PostgreSQL is driven; the server's
    CPU per request is read from /proc around each rate."""
    import signal

    from charon.bench.engines import free_port, wait_healthy

    port = free_port()
    url, token = f"http://127.0.0.1:{port}", "bench"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "serve", "--child-args",
           json.dumps({"src": src, "port": port, "token": token})]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_healthy(url, proc, timeout=120, interval=0.2)
        pts = []
        for rate in rates:
            before = proc_cpu_s(proc.pid)
            p = run_child("http_loop", url=url, token=token, rates=[rate], duration=duration,
                          warmup=warmup)["points"][0]
            p["server_cpu_us_per_request"] = (proc_cpu_s(proc.pid) - before) / max(p["sent"], 1) * 1e6
            p["total_cpu_us_per_request"] = p["server_cpu_us_per_request"] + p["client_cpu_us_per_request"]
            pts.append(p)
        return pts
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def server_cpu_s(data_dir: Path) -> float:
    """CPU seconds of a PostgreSQL server: the postmaster's own plus its exited children's (the backends of a
    pool are reaped when the pool's connections close)."""
    pid = int((data_dir / "postmaster.pid").read_text().split()[0])
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")


def git_head(src: str) -> str:
    try:
        return subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - not a git checkout
        return "unknown"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(25, 4.2))
    ax = axes[0]
    labels, vals = [], []
    for side in ("before", "after"):
        e = result["engine"].get(side)
        if e:
            for mode in ("default_gc", "tuned_gc"):
                labels.append(f"{side}\n{mode.replace('_gc', ' GC')}")
                vals.append(e[mode]["us_per_tx_median"])
    e = result["engine"].get("after")
    if e:
        labels.append("bare loop\n(reference)")
        vals.append(e["bare_loop_us"])
    ax.bar(labels, vals, color=["#999", "#bbb", "#1f77b4", "#4a9fe0", "#2ca02c"][-len(vals):])
    ax.axhline(25, color="r", ls="--", lw=1, label="target 25 µs")
    ax.set_ylabel("CPU µs per transaction")
    ax.set_title("1. engine alone (YCSB-T, batches of 1,000)")
    ax.legend()
    for i, (side, key) in enumerate((("ycsb", "p99"), ("deathstar", "p99"), ("deathstar", "p50"))):
        ax = axes[1 + i]
        for who, style in (("before", "o--"), ("after", "o-")):
            pts = result["open_loop"].get(side, {}).get(who)
            if pts:
                ax.plot([p["input_rate"] for p in pts], [p["latency_ms"][key] for p in pts], style,
                        label=f"charon {who} (one process)")
            pts = result.get("http", {}).get(side, {}).get(who)
            if pts:
                ax.plot([p["input_rate"] for p in pts], [p["latency_ms"][key] for p in pts], "^" + style[1:],
                        label=f"charon {who} (HTTP, generator apart)")
        for iso, pts in result.get("postgres", {}).get(side, {}).items():
            ax.plot([p["input_rate"] for p in pts], [p["latency_ms"][key] for p in pts], "s:", label=f"pg {iso}")
        ax.set_yscale("log")
        ax.set_xlabel("input rate (requests/s)")
        ax.set_ylabel(f"{key} latency (ms)")
        ax.set_title(f"{2 + i}. {side} open loop, {key} (shared machine)")
        ax.legend(fontsize=8)
    ax = axes[4]
    for who, style in (("before", "o--"), ("after", "o-")):
        pts = result["open_loop"].get("deathstar", {}).get(who)
        if pts:
            ax.plot([p["input_rate"] for p in pts], [p["cpu_us_per_request"] for p in pts], style,
                    label=f"charon {who} (engine + generator)")
    for iso, pts in result.get("postgres", {}).get("deathstar", {}).items():
        if pts and "total_cpu_us_per_request" in pts[0]:
            ax.plot([p["input_rate"] for p in pts], [p["total_cpu_us_per_request"] for p in pts], "s:",
                    label=f"pg {iso} (server + generator)")
    ax.set_xlabel("input rate (requests/s)")
    ax.set_ylabel("CPU µs per request")
    for who, style in (("before", "^--"), ("after", "^-")):
        pts = result.get("http", {}).get("deathstar", {}).get(who)
        if pts:
            ax.plot([p["input_rate"] for p in pts], [p["total_cpu_us_per_request"] for p in pts], style,
                    label=f"charon {who} HTTP (server + generator)")
    ax.set_title("5. deathstar: CPU per request (load-independent)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_engine(result: dict, path: Path) -> None:
    """Figure 1 alone (``--only-engine``): CPU µs and user instructions per transaction, before and after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_shapes = any(result["engine"].get(side, {}).get("shapes") for side in ("before", "after"))
    fig, axes = plt.subplots(1, 3 if with_shapes else 2, figsize=(17 if with_shapes else 11, 4.2))
    ax, bx = axes[0], axes[1]
    labels, vals, ilabels, ivals = [], [], [], []
    for side in ("before", "after"):
        e = result["engine"].get(side)
        if not e:
            continue
        for mode in ("default_gc", "tuned_gc"):
            labels.append(f"{side}\n{mode.replace('_gc', ' GC')}")
            vals.append(e[mode]["us_per_tx_median"])
        if e.get("instructions_per_tx"):
            ilabels.append(side)
            ivals.append(e["instructions_per_tx"] / 1000)
    ax.bar(labels, vals, color=["#999", "#bbb", "#1f77b4", "#4a9fe0"][-len(vals):])
    ax.axhline(25, color="r", ls="--", lw=1, label="target 25 µs (quiet machine)")
    ax.set_ylabel("CPU µs per transaction (best of the runs' medians)")
    ax.set_title("engine alone: CPU time (shared machine, load-dependent)")
    ax.legend(fontsize=8)
    bx.bar(ilabels, ivals, color=["#bbb", "#4a9fe0"][-len(ivals):])
    for i, v in enumerate(ivals):
        bx.text(i, v, f"{v:,.1f}K", ha="center", va="bottom")
    bx.set_ylabel("user instructions per transaction (thousands)")
    bx.set_title("engine alone: instructions (perf stat, tuned GC)")
    if with_shapes:
        cx = axes[2]
        width = 0.4
        for i, side in enumerate(("before", "after")):
            shapes = result["engine"].get(side, {}).get("shapes") or {}
            xs = [j + (i - 0.5) * width for j in range(len(SHAPES))]
            ys = [shapes.get(sh, 0) / 1000 for sh in SHAPES]
            cx.bar(xs, ys, width, label=side, color=["#bbb", "#4a9fe0"][i])
            for x, y in zip(xs, ys, strict=True):
                cx.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=8)
        cx.set_xticks(range(len(SHAPES)), SHAPES)
        cx.set_ylabel("user instructions per transaction (thousands)")
        cx.set_title("by transaction shape (mean of 3 hash seeds)")
        cx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-args", help=argparse.SUPPRESS)
    ap.add_argument("--before-src", help="checkout of the code before the change (e.g. /work/main)")
    ap.add_argument("--after-src", help="checkout of the code after the change (default: the installed charon)")
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--ycsb-rates", default="5000,10000,20000")
    ap.add_argument("--deathstar-rates", default="250,500,1000")
    ap.add_argument("--pg-pools", default="4,8,16,32")
    ap.add_argument("--no-postgres", action="store_true")
    ap.add_argument("--no-http", action="store_true", help="skip Deathstar through the HTTP gateway")
    ap.add_argument("--http-rates", default="100,250", help="Deathstar rates through the HTTP gateway")
    ap.add_argument("--only-deathstar", action="store_true", help="skip the engine-alone and YCSB-T measurements")
    ap.add_argument("--only-engine", action="store_true",
                    help="the engine-alone figures only (CPU time and, with perf, instructions per transaction)")
    ap.add_argument("--postgres-only", action="store_true", help="re-measure PostgreSQL into an existing --out")
    ap.add_argument("--shapes", action="store_true",
                    help="with --only-engine: also instructions/tx of the noop, rw, call and transfer shapes (perf)")
    ap.add_argument("--repeat", type=int, default=3, help="engine-alone runs per side, alternating")
    ap.add_argument("--engine-epochs", type=int, default=None,
                    help="epochs of 1,000 of the engine-alone runs (default 23, --quick 13)")
    ap.add_argument("--out", default=str(OUT / "engine_perf.json"))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(CHILDREN[a.child](**json.loads(a.child_args))))
        return 0
    dur, warm, epochs = (3.0, 1.0, 13) if a.quick else (8.0, 2.0, 23)
    epochs = a.engine_epochs or epochs
    sides = {"after": a.after_src}
    if a.before_src:
        sides = {"before": a.before_src, "after": a.after_src}
    after_commit = git_head(a.after_src) if a.after_src else "unknown"
    if after_commit == "unknown":  # a snapshot (git archive) of this checkout
        after_commit = git_head(str(ROOT))
    res: dict = {"when": time.time(), "after_commit": after_commit, "machine": os.uname().nodename,
                 "cpus": os.cpu_count(), "engine": {}, "deathstar_batch": {}, "open_loop": {"ycsb": {},
                                                                                        "deathstar": {}},
                 "postgres": {}}
    if a.before_src:
        res["before_commit"] = git_head(a.before_src)
    ycsb_rates = [float(x) for x in a.ycsb_rates.split(",")]
    ds_rates = [float(x) for x in a.deathstar_rates.split(",")]
    if a.postgres_only:
        res = json.loads(Path(a.out).read_text())
        res["postgres"] = {}
        sides = {}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for i in range(0 if a.only_deathstar else a.repeat):  # alternate before/after: the neighbours' load hits both alike
        for side, src in sides.items():
            r = run_child("engine", src=src, epochs=epochs)
            runs[side].append(r)
            print(f"[{side}] engine alone run {i}: default GC {r['default_gc']['us_per_tx_median']:.1f}, tuned GC "
                  f"{r['tuned_gc']['us_per_tx_median']:.1f} us/tx; bare loop {r['bare_loop_us']:.2f}", flush=True)
    for side in ([] if a.only_deathstar else sides):
        best = {"runs": runs[side], "bare_loop_us": min(r["bare_loop_us"] for r in runs[side])}
        for mode in ("default_gc", "tuned_gc"):
            m = min(r[mode]["us_per_tx_median"] for r in runs[side])
            best[mode] = {"us_per_tx_median": m, "tx_per_s": 1e6 / m}
        best["instructions_per_tx"] = engine_instructions(sides[side], epochs)
        if best["instructions_per_tx"] is not None:
            print(f"[{side}] engine alone: {best['instructions_per_tx']:,.0f} user instructions per transaction "
                  "(perf stat, tuned GC)", flush=True)
        if a.shapes:  # instructions per transaction by shape, the mean over three fixed hash seeds
            best["shapes"] = {}
            for shape in SHAPES:
                vals = [engine_instructions(sides[side], epochs, shape, seed) for seed in ("0", "1", "2")]
                if None not in vals:
                    best["shapes"][shape] = sum(vals) / len(vals)  # type: ignore[arg-type]
                    print(f"[{side}] shape {shape}: {best['shapes'][shape]:,.0f} instructions/tx", flush=True)
        res["engine"][side] = best
    if a.only_engine:
        out = Path(a.out)
        out.write_text(json.dumps(res, indent=1, default=float))
        plot_engine(res, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png')}")
        return 0
    for side, src in ([] if a.only_deathstar else sides.items()):
        res["deathstar_batch"][side] = run_child("deathstar_batch", src=src, epochs=12, size=100)
        print(f"[{side}] deathstar batch: {res['deathstar_batch'][side]['us_per_request']:.0f} us/request",
              flush=True)
    for side, src in sides.items():
        for wl, rates in ((("ycsb", ycsb_rates),) if not a.only_deathstar else ()) + (("deathstar", ds_rates),):
            print(f"[{side}] open loop {wl} {rates} ...", flush=True)
            pts = run_child("open_loop", src=src, workload=wl, rates=rates, duration=dur, warmup=warm)["points"]
            res["open_loop"][wl][side] = pts
            for p in pts:
                lat = p["latency_ms"]
                print(f"    {p['input_rate']:7.0f}/s: {p['committed_per_s']:8.0f} c/s p50 {lat['p50']:8.2f} "
                      f"p99 {p['latency_ms']['p99']:8.2f} ms, cpu {p['cpu_us_per_request']:.0f} us/req, "
                      f"cpu share {p['cpu_share']:.2f}, epochs {p['epochs']['size_mean']:.0f}", flush=True)
    if not a.no_http:
        res["http"] = {"deathstar": {}}
        for side, src in sides.items():
            print(f"[{side}] deathstar over HTTP (generator in its own process) {a.http_rates} ...", flush=True)
            http_rates = [float(x) for x in a.http_rates.split(",")]
            pts = res["http"]["deathstar"][side] = http_layout(src, http_rates, dur, warm)
            for p in pts:
                lat = p["latency_ms"]
                print(f"    {p['input_rate']:7.0f}/s: {p['committed_per_s']:8.0f} c/s p50 {lat['p50']:8.2f} "
                      f"p99 {p['latency_ms']['p99']:8.2f} ms, client cpu {p['client_cpu_us_per_request']:.0f} "
                      f"us/req, server cpu {p['server_cpu_us_per_request']:.0f} us/req", flush=True)
    if not a.no_postgres:
        from charon.apps import deathstar
        from charon.bench.postgres import DeathstarSql, PostgresCluster

        with PostgresCluster() as cluster:
            pools = [int(x) for x in a.pg_pools.split(",")]
            res["postgres"]["deathstar"] = {}
            res["postgres"]["pool_sweep"] = {}
            for iso in ("serializable", "read_committed"):
                best = None
                for pool in pools:  # pool size by measurement: the best committed rate at the highest rate
                    DeathstarSql().setup(cluster.dsn, deathstar.populate())
                    p = run_child("postgres", dsn=cluster.dsn, workload="deathstar", isolation=iso, pool=pool,
                                  rates=[max(ds_rates)], duration=min(dur, 3.0), warmup=1.0)["points"][0]
                    res["postgres"]["pool_sweep"].setdefault(iso, []).append(p)
                    score = (p["committed_per_s"], -p["latency_ms"]["p99"])
                    if best is None or score > best[0]:
                        best = (score, pool)
                pool = best[1]
                DeathstarSql().setup(cluster.dsn, deathstar.populate())
                pts = []
                for rate in ds_rates:  # one child per rate: the server's CPU is read around each
                    before = server_cpu_s(cluster.dir / "data")
                    p = run_child("postgres", dsn=cluster.dsn, workload="deathstar", isolation=iso, pool=pool,
                                  rates=[rate], duration=dur, warmup=warm)["points"][0]
                    time.sleep(0.5)  # the backends exit and are reaped
                    p["server_cpu_us_per_request"] = (server_cpu_s(cluster.dir / "data") - before) / p["sent"] * 1e6
                    p["total_cpu_us_per_request"] = p["server_cpu_us_per_request"] + p["client_cpu_us_per_request"]
                    pts.append(p)
                res["postgres"]["deathstar"][iso] = pts
                for p in pts:
                    print(f"    pg {iso} pool {pool} {p['input_rate']:6.0f}/s: {p['committed_per_s']:7.0f} c/s "
                          f"p50 {p['latency_ms']['p50']:7.1f} p99 {p['latency_ms']['p99']:7.1f} ms, client cpu "
                          f"{p['client_cpu_us_per_request']:.0f} us/req, server cpu "
                          f"{p['server_cpu_us_per_request']:.0f} us/req", flush=True)
    out = Path(a.out)
    out.write_text(json.dumps(res, indent=1, default=float))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
