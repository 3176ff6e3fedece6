"""The benchmark suite: JSON results, PNG plots and a report (RESULTS.md in ``--out``), in one command.

``benchmarks/run.py run`` runs it (one process per experiment and system) with the other benchmarks
``benchmarks/RESULTS.md`` shows, and ``benchmarks/run.py render`` writes that file from their JSON.

    .venv/bin/python benchmarks/workloads/suite.py                      # defaults: 10 s per point
    .venv/bin/python benchmarks/workloads/suite.py --duration 60 --only ycsb,tpcc
    .venv/bin/python benchmarks/workloads/suite.py --systems inprocess   # without the PostgreSQL baseline

Experiments: YCSB-T at several input rates; a Zipf sweep (0.0/0.5/0.9/0.99/0.999) with abort rates; TPC-C
NewOrder+Payment (W=1, reduced scale by default); the Deathstar travel mix and movie reviews. Systems:
``inprocess`` (Charon's in-process runtime), ``postgres`` (the SERIALIZABLE baseline), ``postgres-rc`` (READ
COMMITTED with ``SELECT ... FOR UPDATE`` in a fixed lock order; quote Charon against the better one) and ``spark``
(:func:`charon.bench.spark.spark_target`: the Spark runtime on ``--spark-master``, default local[2], its driver
in a child process so it does not share a GIL with the load generator):

    .venv/bin/python benchmarks/workloads/suite.py --systems inprocess,postgres,spark

The TPC-C population is :class:`charon.apps.tpcc_spark.Population`: every system loads the same database,
which the Spark target generates in parallel in Spark.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from charon.apps import deathstar, tpcc, tpcc_spark, ycsb
from charon.bench import harness, report
from charon.bench.postgres import (
    DeathstarSql,
    PostgresBaseline,
    PostgresCluster,
    SqlWorkload,
    TpccSql,
    YcsbSql,
)
from charon.runtime.node.inprocess import InProcessRuntime

ROOT = Path.cwd()  # results go under ./benchmarks of the directory the suite runs from
Record = tuple[str, str, Any, Any]


def ycsb_records(n: int) -> list[Record]:
    return [("account", k, v, None) for k, v in ycsb.initial_state(n).items()]


def ycsb_gen(n: int, zipf: float = 0.0) -> Callable:
    creditors = ycsb.Zipf(n, zipf)

    def gen(rng: Any) -> tuple:
        return ("account", ycsb.key(rng.randrange(n)), "transfer", [ycsb.key(creditors.sample(rng)),
                                                                     rng.randint(1, 10)])

    return gen


def load_runtime(rt: Any, records: list[Record]) -> None:
    for op, key, value, items in records:
        if value is not None:
            rt.load(op, {key: value})
        if items:
            rt.load_items(op, key, items)


class Ctx:
    """What an experiment needs to build targets."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cluster: PostgresCluster | None = None

    def pg(self) -> PostgresCluster:
        if self.cluster is None:
            self.cluster = PostgresCluster()
            self.cluster.start()
        return self.cluster


@contextlib.asynccontextmanager
async def inprocess_target(ctx: Ctx, app: Any, records: list[Record], sql: SqlWorkload) -> AsyncIterator[Any]:
    rt = InProcessRuntime(app, partitions=ctx.args.partitions, epoch_max_txns=ctx.args.epoch_max_txns,
                          epoch_max_ms=ctx.args.epoch_max_ms)
    load_runtime(rt, records)
    async with rt:
        yield rt


@contextlib.asynccontextmanager
async def postgres_target(ctx: Ctx, app: Any, records: list[Record], sql: SqlWorkload) -> AsyncIterator[Any]:
    cluster = ctx.pg()
    sql.setup(cluster.dsn, records)
    async with PostgresBaseline(cluster.dsn, sql, pool_size=ctx.args.pg_pool) as pg:
        yield pg


@contextlib.asynccontextmanager
async def postgres_rc_target(ctx: Ctx, app: Any, records: list[Record], sql: SqlWorkload) -> AsyncIterator[Any]:
    """PostgreSQL at READ COMMITTED with ``SELECT ... FOR UPDATE`` in a fixed lock order."""
    cluster = ctx.pg()
    sql.setup(cluster.dsn, records)
    async with PostgresBaseline(cluster.dsn, sql, pool_size=ctx.args.pg_pool, isolation="read_committed") as pg:
        yield pg


#: system name -> async context manager factory (ctx, app, records, sql_workload) -> target with submit().
#: The Spark runtime plugs in here: SYSTEM_FACTORIES["spark"] = spark_target.
SYSTEM_FACTORIES: dict[str, Callable[..., Any]] = {"inprocess": inprocess_target, "postgres": postgres_target,
                                                   "postgres-rc": postgres_rc_target}
SYSTEM_LABELS = {"inprocess": "charon-inprocess", "postgres": "postgres", "postgres-rc": "postgres-rc",
                 "spark": "charon-spark"}


def _spark_hook() -> None:
    """Register the Spark runtime if the project provides ``charon.bench.spark.spark_target``."""
    try:
        from charon.bench.spark import spark_target
    except ImportError:
        return
    SYSTEM_FACTORIES["spark"] = spark_target


def state_reader(target: Any) -> tuple[Callable | None, Callable | None]:
    return getattr(target, "read_state", None), getattr(target, "read_items", None)


async def run_points(ctx: Ctx, experiment: str, system: str, target: Any, gen: Callable, rates: list[float],
                     extra: dict | None = None, on_reply: Callable | None = None) -> list[dict]:
    out = []
    for rate in rates:
        t = time.time()
        load_before = os.getloadavg()[0]  # the machine's load around each point (a shared machine shows here)
        r = await harness.run_open_loop(target, gen, rate=rate, duration=ctx.args.duration, warmup=ctx.args.warmup,
                                        drain_timeout=ctx.args.drain, seed=int(rate), label=f"{experiment}@{rate}",
                                        on_reply=on_reply)
        r.update({"experiment": experiment, "system": SYSTEM_LABELS.get(system, system), **(extra or {}),
                  "load_before": load_before, "load_after": os.getloadavg()[0]})
        out.append(r)
        lat = r["latency_ms"]
        print(f"  {experiment:9s} {system:9s} {extra or ''} rate {rate:7.0f}: {r['committed_per_s']:8.1f} c/s "
              f"{r['aborted_per_s']:7.1f} a/s  p50 {lat['p50']:8.1f} p99 {lat['p99']:8.1f} ms "
              f"unfinished {r['unfinished']} ({time.time() - t:.0f}s)", flush=True)
    return out


async def exp_ycsb(ctx: Ctx, system: str) -> list[dict]:
    a = ctx.args
    records = ycsb_records(a.accounts)
    async with SYSTEM_FACTORIES[system](ctx, ycsb.app, records, YcsbSql()) as target:
        res = await run_points(ctx, "ycsb", system, target, ycsb_gen(a.accounts), a.ycsb_rates)
        total = await _ycsb_total(target, a.accounts)
    checks = [] if total == a.accounts * ycsb.INITIAL_BALANCE else [f"total balance {total} != "
                                                                     f"{a.accounts * ycsb.INITIAL_BALANCE}"]
    for r in res:
        r["checks"] = checks
    return res


async def _ycsb_total(target: Any, n: int) -> int:
    if isinstance(target, PostgresBaseline):
        conn = await target._pool.get()
        try:
            return await YcsbSql.total(conn)
        finally:
            target._pool.put_nowait(conn)
    return sum(target.read_state("account", ycsb.key(i), 0) for i in range(n))


async def exp_zipf(ctx: Ctx, system: str) -> list[dict]:
    a = ctx.args
    res = []
    for z in a.zipf:
        records = ycsb_records(a.accounts)
        async with SYSTEM_FACTORIES[system](ctx, ycsb.app, records, YcsbSql()) as target:
            rs = await run_points(ctx, "zipf", system, target, ycsb_gen(a.accounts, z), [a.zipf_rate], {"zipf": z})
            total = await _ycsb_total(target, a.accounts)
        for r in rs:
            r["checks"] = [] if total == a.accounts * ycsb.INITIAL_BALANCE else [f"total balance {total}"]
        res += rs
    return res


def tpcc_scale(name: str) -> tpcc.Scale:
    return {"small": tpcc.SMALL, "bench": tpcc.BENCH, "full": tpcc.Scale()}[name]


async def exp_tpcc(ctx: Ctx, system: str) -> list[dict]:
    a = ctx.args
    scale = tpcc_scale(a.tpcc_scale)
    records = tpcc_spark.Population(a.warehouses, scale)  # the Spark target generates it in Spark
    async with SYSTEM_FACTORIES[system](ctx, tpcc.app, records, TpccSql()) as target:
        res = await run_points(ctx, "tpcc", system, target, tpcc.generator(a.warehouses, scale), a.tpcc_rates,
                               {"warehouses": a.warehouses, "scale": a.tpcc_scale})
        rs, ri = state_reader(target)
        if isinstance(target, PostgresBaseline):
            checks = TpccSql.check(target.dsn)
        elif rs and ri:
            checks = tpcc.check(rs, ri)
        else:
            checks = ["(no state reader)"]
    for r in res:
        r["checks"] = checks
    return res


async def exp_deathstar(ctx: Ctx, system: str) -> list[dict]:
    a = ctx.args
    records = list(deathstar.populate())
    async with SYSTEM_FACTORIES[system](ctx, deathstar.app, records, DeathstarSql()) as target:
        res = await run_points(ctx, "deathstar", system, target, deathstar.next_request, a.deathstar_rates)
        if isinstance(target, PostgresBaseline):
            checks = DeathstarSql.check(target.dsn)
        else:
            checks = deathstar.check(target.read_state)
    for r in res:
        r["checks"] = checks
    return res


async def exp_movie(ctx: Ctx, system: str) -> list[dict]:
    if system.startswith("postgres"):
        return []  # the SQL baseline covers the travel mix only
    a = ctx.args
    records = list(deathstar.populate())
    committed: list[str] = []

    def on_reply(req: tuple, rep: Any) -> None:
        if rep.ok:
            committed.append(req[1])

    async with SYSTEM_FACTORIES[system](ctx, deathstar.app, records, DeathstarSql()) as target:
        res = await run_points(ctx, "movie", system, target, deathstar.next_movie_request, a.movie_rates,
                               on_reply=on_reply)
        checks = deathstar.check(target.read_state, review_ids=committed)
    for r in res:
        r["checks"] = checks
    return res


EXPERIMENTS = {"ycsb": exp_ycsb, "zipf": exp_zipf, "tpcc": exp_tpcc, "deathstar": exp_deathstar,
               "movie": exp_movie}


def floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "workloads" / "suite"),
                   help="JSON and PNG directory")
    p.add_argument("--results-md", default=None,
                   help="this run's report (default: RESULTS.md in --out; benchmarks/RESULTS.md itself is "
                        "rendered by benchmarks/run.py from benchmarks/results/)")
    p.add_argument("--only", default=",".join(EXPERIMENTS), help="experiments, comma-separated")
    p.add_argument("--systems", default="inprocess,postgres,postgres-rc",
                   help="inprocess,postgres,postgres-rc[,spark] (postgres: SERIALIZABLE with retries; "
                        "postgres-rc: READ COMMITTED with SELECT ... FOR UPDATE in a fixed lock order)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=2.0, help="discarded seconds per point")
    p.add_argument("--drain", type=float, default=10.0, help="seconds to wait for replies after a point")
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--epoch-max-txns", type=int, default=10_000, help="in-process epoch cap (adaptive below it)")
    p.add_argument("--epoch-max-ms", type=float, default=1.0)
    p.add_argument("--spark-master", default="local[2]", help="Spark master of the spark system")
    p.add_argument("--spark-max-batch", type=int, default=20_000, help="most requests per Spark epoch")
    p.add_argument("--pg-pool", type=int, default=16, help="PostgreSQL connections")
    p.add_argument("--accounts", type=int, default=10_000)
    p.add_argument("--ycsb-rates", type=floats, default=floats("250,500,1000,2000"))
    p.add_argument("--zipf", type=floats, default=floats("0.0,0.5,0.9,0.99,0.999"))
    p.add_argument("--zipf-rate", type=float, default=500.0)
    p.add_argument("--warehouses", type=int, default=1)
    p.add_argument("--tpcc-scale", choices=["small", "bench", "full"], default="bench",
                   help="bench = 10 districts x 300 customers, 10,000 items; full = the specification's")
    p.add_argument("--tpcc-rates", type=floats, default=floats("25,50,100"))
    p.add_argument("--deathstar-rates", type=floats, default=floats("250,500,1000"))
    p.add_argument("--movie-rates", type=floats, default=floats("100,250,500"))
    return p.parse_args(argv)


async def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    _spark_hook()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args)
    systems = [s for s in args.systems.split(",") if s]
    notes = [f"{args.duration:g} s measured + {args.warmup:g} s warm-up per point; in-process runtime with "
             f"{args.partitions} partitions, epochs of at most {args.epoch_max_txns} transactions / "
             f"{args.epoch_max_ms:g} ms; PostgreSQL pool of {args.pg_pool} connections.",
             f"YCSB-T: {args.accounts:,} accounts; TPC-C: W={args.warehouses}, scale `{args.tpcc_scale}`; "
             "Deathstar: 100 hotels, 100 flights (capacity 10), 500 users, 1,000 movies and users."]
    try:
        for exp in [e for e in args.only.split(",") if e]:
            for system in systems:
                if system not in SYSTEM_FACTORIES:
                    print(f"skipping {system}: not available", flush=True)
                    notes.append(f"{system}: not available in this run")
                    continue
                try:
                    res = await EXPERIMENTS[exp](ctx, system)
                except Exception as exc:  # keep going: one failing system must not lose the others' numbers
                    print(f"{exp} on {system} failed: {exc!r}", flush=True)
                    notes.append(f"{exp} on {system} failed: {type(exc).__name__}: {exc}")
                    continue
                if res:
                    harness.save(res, out / f"{exp}-{system}.json")
    finally:
        if ctx.cluster is not None:
            ctx.cluster.stop()
    argv_ = argv if argv is not None else sys.argv[1:]
    cmd = "benchmarks/workloads/suite.py " + " ".join(shlex.quote(x) for x in argv_)
    md = report.write_report(out, args.results_md or out / "RESULTS.md", command=cmd.strip(), notes=notes)
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.run(main()))
