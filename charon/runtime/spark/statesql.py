"""SQL over state: an operator's state as a Spark DataFrame at one consistent epoch, read from the durable copy.

Schema of :func:`state_frame` (one row per stored value of the operator):

==============  =========  ==========================================================================
column          type       meaning
==============  =========  ==========================================================================
``key``         string     the entity key
``item``        string     ``""`` for the entity's main value, else the named item
``value``       inferred   the decoded value: bigint if every value is an integer, double if numbers,
                           boolean, string if strings; otherwise the value as JSON text
``value_json``  string     the decoded value as JSON text (always)
``epoch``       bigint     the epoch the whole frame reflects (one consistent cut)
==============  =========  ==========================================================================

The engine's internal entries are left out, as ``charon read`` leaves them out: an entity's pending timers
(items under :data:`charon.core.timers.ITEM_PREFIX`) and the timers' due-time index (an operator of its own).

Each partition's durable copy (Arrow base + deltas, :class:`charon.state.durable.DurableState`) is read by one
Spark task, so the read runs in parallel on the executors and never waits for (or stalls) the running
query: it reads files the epochs already wrote. The Spark runtime can show every epoch since the durable
copy's base; an in-process node's data directory the epochs it checkpointed (``retained_epochs``).
This is ``charon sql``'s path (a Spark session of its own); the gateway's SQL box never runs a query in the
engine's JVM (:mod:`charon.runtime.control.sqlstate`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import msgspec

from charon import serde
from charon.core.routing import split_store_key
from charon.core.timers import INDEX_PREFIX, ITEM_PREFIX
from charon.runtime.contract import EpochNotRetained
from charon.runtime.control.reads import node_retained_epochs
from charon.runtime.spark.layout import read_layout, records_dir
from charon.state.durable import DurableState, DurableStateError, durable_at

__all__ = ["state_frame", "layout_of", "register_views", "DataDirLayout"]


class DataDirLayout(msgspec.Struct):
    """Where a data directory keeps its durable state: root, partitions, newest consistent epoch, engine."""

    root: str
    partitions: int
    epoch: int
    engine: str
    retained: list[int] | None = None  # node: the readable epochs (None: every epoch since the base)


def _newest_record(epochs_dir: str) -> int:
    """The newest epoch with a record under ``epochs_dir`` (-1: none)."""
    names = os.listdir(epochs_dir) if os.path.isdir(epochs_dir) else []
    return max((int(n.split(".")[0]) for n in names if n.endswith(".msgpack")), default=-1)


def layout_of(data_dir: str) -> DataDirLayout:
    """Inspect a data directory of either runtime (``charon run --data-dir``; it may be in use)."""
    ckpt = os.path.join(data_dir, "checkpoint")
    spark = read_layout(ckpt)
    if spark is not None:  # a rescale names its state directory
        return DataDirLayout(os.path.join(ckpt, spark.state), spark.partitions,
                             _newest_record(records_dir(ckpt)), "spark")
    node = os.path.join(data_dir, "node.json")
    if os.path.isfile(node):
        with open(node) as f:
            layout = json.load(f)
        parts = int(layout["partitions"])
        root = os.path.join(data_dir, layout.get("state", "state"))  # a rescaled node names its state directory
        retained = node_retained_epochs(DurableState(root, fsync=False), parts)
        epoch = _newest_record(os.path.join(data_dir, "epochs"))
        return DataDirLayout(root, parts, epoch, "inprocess", retained + ([epoch] if epoch not in retained else []))
    raise FileNotFoundError(f"{data_dir} holds no Charon deployment (no checkpoint/layout.json, no node.json)")


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int" if -(1 << 63) <= v < (1 << 63) else "json"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    return "json"


def _read_partition(root: str, epoch: int, operator: str | None, pids: Iterator[int]) -> Iterator[tuple]:
    with tempfile.TemporaryDirectory(prefix="charon-sql-") as cache:  # object storage: what the task read
        yield from _read_durable_rows(durable_at(root, cache, fsync=False), epoch, operator, pids)


def _read_durable_rows(durable: DurableState, epoch: int, operator: str | None, pids: Iterator[int],
                       ) -> Iterator[tuple]:
    for pid in pids:
        try:
            state, _ = durable.load(pid, epoch)
        except DurableStateError as exc:
            raise EpochNotRetained(f"the state as of epoch {epoch} is no longer retained: {exc}") from None
        for k, raw in state.items():
            if k.startswith(INDEX_PREFIX):
                continue  # the timers' due-time index: the engine's, not an operator's
            op, key, item = split_store_key(k)
            if (operator is not None and op != operator) or item.startswith(ITEM_PREFIX):
                continue  # an entity's pending timers: the engine's entries beside its items
            v = serde.decode(raw)
            yield (op, key, item.lstrip("\x01"), v, _kind(v))


_VALUE_TYPES = {"int": "bigint", "float": "double", "bool": "boolean", "str": "string"}


def _value_type(kinds: set[str]) -> str:
    if not kinds:
        return "bigint"
    if kinds == {"int"}:
        return "int"
    if kinds <= {"int", "float"}:
        return "float"
    if len(kinds) == 1 and kinds <= {"bool", "str"}:
        return next(iter(kinds))
    return "json"


def _frame(spark: Any, layout: DataDirLayout, epoch: int, operator: str | None) -> Any:
    from pyspark.sql.types import (
        BooleanType,
        DoubleType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    if epoch > layout.epoch or epoch < -1:
        raise EpochNotRetained(f"epoch {epoch} is not committed (the newest is {layout.epoch})")
    if layout.retained is not None and epoch not in layout.retained and epoch != -1:
        raise EpochNotRetained(f"epoch {epoch} is not retained (retained: {layout.retained[-20:]})")
    root, n = layout.root, layout.partitions
    rdd = spark.sparkContext.parallelize(range(n), n).mapPartitions(
        lambda it: _read_partition(root, epoch, operator, it)
    )
    kinds = set(rdd.map(lambda r: r[4]).distinct().collect())  # a first pass picks the value column's type
    vt = _value_type(kinds)
    spark_type = {"int": LongType(), "float": DoubleType(), "bool": BooleanType(), "str": StringType(),
                  "json": StringType()}[vt]

    def row(r: tuple) -> tuple:
        op, key, item, v, _ = r
        text = json.dumps(v, sort_keys=True, default=repr)
        value = text if vt == "json" else (float(v) if vt == "float" else v)
        return (op, key, item, value, text, epoch)

    schema = StructType([
        StructField("operator", StringType(), False), StructField("key", StringType(), False),
        StructField("item", StringType(), False), StructField("value", spark_type, True),
        StructField("value_json", StringType(), False), StructField("epoch", LongType(), False),
    ])
    return spark.createDataFrame(rdd.map(row), schema)


def state_frame(spark: Any, layout: DataDirLayout, operator: str, epoch: int | None = None) -> Any:
    """``operator``'s state as of ``epoch`` (default: the newest) as a DataFrame (see the module docstring)."""
    df = _frame(spark, layout, layout.epoch if epoch is None else epoch, operator)
    return df.drop("operator")


def register_views(spark: Any, layout: DataDirLayout, epoch: int | None = None) -> dict[str, Any]:
    """A temporary view per operator found in the state (``SELECT ... FROM <operator>``), at one epoch."""
    at = layout.epoch if epoch is None else epoch
    ops = sorted(_frame(spark, layout, at, None).select("operator").distinct().toPandas()["operator"])
    views = {}
    for op in ops:
        df = state_frame(spark, layout, op, at)
        df.createOrReplaceTempView(op)
        views[op] = df
    return views
