"""The Spark runtime as a benchmark target for ``benchmarks/workloads/suite.py`` (system ``spark``).

:func:`spark_target` starts a :class:`~charon.runtime.spark.runtime.SparkRuntime` (``local[2]`` by default, a temporary
data directory) **in a child process** and gives the benchmark a :class:`SparkTarget` in its own process:

- ``submit`` appends to the runtime's SQLite input log (group-committed) and tails its output log through a
  :class:`~charon.log.client.LogClient`, exactly as the HTTP gateway or ``benchmarks/spark/spark_ycsb.py``'s load
  generator does. The Spark driver (the streaming query, the epoch coordinator, the serialization of every
  round) and the open-loop generator therefore do not share a GIL: in one process the generator's event loop
  and the coordinator would slow each other down and the measured latency would include that contention.
- ``epoch_stats`` reads the epoch records the driver writes under its checkpoint (the same dictionaries as
  ``SparkRuntime.epoch_stats``), so the harness can summarize epoch sizes and durations.
- ``read_state`` / ``read_items`` answer from one consistent snapshot: the child waits until every request
  appended so far has run, then sends ``SparkRuntime.snapshot()`` (the durable state as of the last epoch)
  once; it is decoded into a dictionary (reading keys one by one through Spark jobs would be far slower).

The initial state is bulk-loaded as the first snapshot with ``SparkRuntime.load_dataframe``: YCSB accounts
from ``spark.range``; TPC-C generated in parallel by :mod:`charon.apps.tpcc_spark` (one Spark task per unit)
when the records are a :class:`~charon.apps.tpcc_spark.Population`; anything else (Deathstar) as a DataFrame
of the records' rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from charon import serde
from charon.config import SparkConfig
from charon.operator import Application

Record = tuple[str, str, Any, Any]


# ---------------------------------------------------------------------------------------------- loading


@dataclass
class LoadSpec:
    """How to build the initial state in Spark: ``ycsb`` (n accounts, one balance), ``tpcc`` (W, scale,
    seed: generated in parallel) or ``rows`` (explicit ``(operator, key, item, value bytes)`` rows)."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    rows: list[tuple[str, str, str, bytes]] = field(default_factory=list)


def app_ref(app: Application) -> str:
    """``module:attribute`` of an application object (Spark executors import it by that name)."""
    for name, mod in sorted(list(sys.modules.items())):
        if name in ("__main__", "__mp_main__") or mod is None:
            continue
        for attr, val in list(vars(mod).items()):
            if val is app:
                return f"{name}:{attr}"
    raise LookupError(f"application {app.name!r} is not a module attribute")


def load_spec(app: Application, records: Iterable[Record]) -> LoadSpec:
    """Pick the cheapest way to build ``records`` in Spark."""
    from charon.apps import tpcc_spark, ycsb

    if isinstance(records, tpcc_spark.Population):
        return LoadSpec("tpcc", {"warehouses": records.warehouses, "scale": records.scale, "seed": records.seed})
    recs = list(records)
    if app is ycsb.app and recs:
        balance = recs[0][2]
        if all(r == ("account", ycsb.key(i), balance, None) for i, r in enumerate(recs)):
            return LoadSpec("ycsb", {"n": len(recs), "balance": balance})
    return LoadSpec("rows", rows=list(tpcc_spark.to_rows(recs)))


def _ycsb_rows(balance: int, it: Iterable[Any]) -> Iterable[tuple[str, str, str, bytes]]:
    from charon.apps import ycsb

    value = serde.encode(balance)
    for r in it:
        yield "account", ycsb.key(r.id), "", value


def bulk_load(rt: Any, spec: LoadSpec) -> int:
    """Load a fresh SparkRuntime from a :class:`LoadSpec` as its first snapshot; returns the rows written."""
    from functools import partial

    from charon.apps import tpcc_spark

    spark = rt.spark
    if spec.kind == "tpcc":
        p = spec.params
        return tpcc_spark.load(rt, p["warehouses"], p["scale"], p["seed"])
    if spec.kind == "ycsb":
        n, slices = spec.params["n"], max(2, rt.config.partitions)
        rdd = spark.range(n, numPartitions=slices).rdd.mapPartitions(partial(_ycsb_rows, spec.params["balance"]))
        return rt.load_dataframe(spark.createDataFrame(rdd, tpcc_spark.SCHEMA))
    if spec.kind == "rows":
        if not spec.rows:
            return 0
        df = spark.createDataFrame(spec.rows, tpcc_spark.SCHEMA)
        return rt.load_dataframe(df)
    raise ValueError(f"unknown load spec {spec.kind!r}")


# ---------------------------------------------------------------------------------------------- the driver


def _driver(conn: Any, ref: str, cfg: SparkConfig, spec: LoadSpec) -> None:
    """Child process: the Spark driver. Commands over ``conn``: ``snapshot``, ``stop``."""
    rt = None
    try:
        from charon.runtime.spark.runtime import SparkRuntime

        t0 = time.time()
        rt = SparkRuntime(ref, cfg)
        rows = bulk_load(rt, spec)
        t1 = time.time()
        rt.start()
        conn.send(("ready", {"rows": rows, "load_s": t1 - t0, "start_s": time.time() - t1}))
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd == "snapshot":
                if any(rt.input_log.end_offsets()):
                    rt.wait_idle(600)
                if rt._compactor is not None:
                    rt._compactor.join()
                conn.send(("snapshot", (rt.last_epoch, rt.snapshot())))
        rt.close()
        rt = None
        conn.send(("bye", None))
    except BaseException:  # report to the parent, which raises it
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    finally:
        if rt is not None:
            with contextlib.suppress(Exception):
                rt.close()


class SparkTarget:
    """A benchmark target in the harness's process for a Spark runtime in a child process."""

    def __init__(self, app: Application, cfg: SparkConfig, spec: LoadSpec, start_timeout: float = 900.0) -> None:
        self.app = app
        self.config = cfg
        self.info: dict[str, Any] = {}
        self.client: Any = None
        self._state: dict[tuple[str, str], Any] | None = None
        self._items: dict[tuple[str, str], dict[str, Any]] = {}
        self._records: dict[str, dict[str, float]] = {}
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_driver, args=(child, app_ref(app), cfg, spec), daemon=True,
                                 name="charon-spark-driver")
        self._proc.start()
        child.close()
        self._start_timeout = start_timeout

    def _recv(self, want: str, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"the Spark driver sent no {want!r} within {timeout:.0f} s")
        kind, payload = self._conn.recv()
        if kind == "error":
            raise RuntimeError(f"the Spark driver failed:\n{payload}")
        if kind != want:
            raise RuntimeError(f"expected {want!r} from the Spark driver, got {kind!r}")
        return payload

    async def start(self) -> None:
        """Wait for the child to load the state and start the streaming query; open the log client."""
        from charon.log.client import LogClient
        from charon.log.location import log_locations, open_input_log, open_output_log

        self.info = await asyncio.to_thread(self._recv, "ready", self._start_timeout)
        inp, out = log_locations(os.path.abspath(self.config.data_dir), self.config.log_url)
        self.client = LogClient(open_input_log(inp), open_output_log(out))

    async def submit(self, operator: str, key: str, function: str, args: list | tuple = (), *,
                     request_id: str | None = None) -> Any:
        """Append a request to the input log and await its reply from the output log."""
        self._state = None
        return await self.client.submit(operator, key, function, args, request_id=request_id)

    @property
    def epoch_stats(self) -> list[dict[str, float]]:
        """Per-epoch statistics, from the epoch records under the driver's checkpoint (in epoch order)."""
        from charon.state.records import decode_record

        folder = os.path.join(self.config.checkpoint_dir, "epochs")
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if name.endswith(".msgpack") and name not in self._records:
                with open(os.path.join(folder, name), "rb") as f:
                    rec = decode_record(f.read())
                self._records[name] = {"epoch": rec.epoch, **rec.stats}
        return [self._records[k] for k in sorted(self._records)]

    def _snapshot(self) -> dict[tuple[str, str], Any]:
        if self._state is None:
            from charon.core.routing import split_store_key

            self._conn.send("snapshot")
            _, snap = self._recv("snapshot", 900.0)
            state: dict[tuple[str, str], Any] = {}
            items: dict[tuple[str, str], dict[str, Any]] = {}
            for k, v in snap.items():
                op, key, item = split_store_key(k)
                if item == "":
                    state[(op, key)] = serde.decode(v)
                elif item.startswith("\x01"):
                    items.setdefault((op, key), {})[item[1:]] = serde.decode(v)
            self._state, self._items = state, items
        return self._state

    def read_state(self, operator: str, key: str, default: Any = None) -> Any:
        """An entity's committed value once every submitted request has run."""
        return self._snapshot().get((operator, key), default)

    def read_items(self, operator: str, key: str) -> dict[str, Any]:
        """An entity's committed named items (without the ``\\x01`` prefix)."""
        self._snapshot()
        return dict(self._items.get((operator, key), {}))

    def close(self) -> None:
        """Stop the streaming query and the child process."""
        if self._proc.is_alive():
            with contextlib.suppress(Exception):
                self._conn.send("stop")
                self._recv("bye", 120.0)
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


def bench_config(args: Any, data_dir: str) -> SparkConfig:
    """The Spark runtime settings of a benchmark run (``--spark-master``, ``--partitions``, ...; other
    settings from ``CHARON_*`` variables, e.g. ``CHARON_PIPELINE_FINALIZE=0`` for a before/after)."""
    return SparkConfig.from_env(
        master=getattr(args, "spark_master", None) or "local[2]",
        data_dir=data_dir,
        partitions=getattr(args, "partitions", 4),
        max_batch=getattr(args, "spark_max_batch", None) or 20_000,
        compact_every=50,
        app_name="charon-bench",
    )


@contextlib.asynccontextmanager
async def spark_target(ctx: Any, app: Application, records: Iterable[Record], sql: Any = None
                       ) -> AsyncIterator[SparkTarget]:
    """run_all's factory for the ``spark`` system: a started :class:`SparkTarget` loaded with ``records``."""
    data = tempfile.mkdtemp(prefix="charon-bench-spark-")
    target = SparkTarget(app, bench_config(ctx.args, data), load_spec(app, records))
    try:
        await target.start()
        print(f"  spark: {target.info.get('rows', 0):,} rows loaded in {target.info.get('load_s', 0):.1f}s, "
              f"query started in {target.info.get('start_s', 0):.1f}s", flush=True)
        yield target
    finally:
        await asyncio.to_thread(target.close)
        shutil.rmtree(data, ignore_errors=True)
