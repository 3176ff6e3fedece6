"""The TPC-C initial population generated in parallel with Spark and bulk-loaded as the first snapshot.

:func:`charon.apps.tpcc.populate` draws everything from one sequential random stream, so no task can start
in the middle of it without replaying everything before it. This module splits the same population into
independent *units*, each with its own deterministically seeded generator:

- ``("item", lo, hi)``: items ``lo..hi`` (chunks of :data:`CHUNK`)
- ``("warehouse", w)``: the warehouse row
- ``("stock", w, lo, hi)``: stock rows of warehouse ``w`` for items ``lo..hi``
- ``("district", w, d)``: the district, its customers, history, last-name index, orders, order lines and
  new-order rows

Each unit reuses :mod:`charon.apps.tpcc`'s building blocks (``last_name``, ``nurand``, the string generator,
the run-time constant for C_LAST) and produces rows with the same layout, key set and distributions as
``tpcc.populate``. The population is a pure function of ``(W, scale, seed)``: :func:`populate` (the units one
after another, in the driver) and :func:`population_dataframe` (one Spark task per unit) yield exactly the
same records, so every system of a benchmark can load the identical database.

Spark rows are ``(operator, key, item, value)`` with ``value`` msgpack bytes: the entity's main value has item
``""``, a named item ``name`` is stored as ``"\\x01" + name`` (as :meth:`charon.core.context.Context.put_item` does).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

from charon import serde
from charon.apps import tpcc
from charon.apps.tpcc import Record, Scale

SCHEMA = "operator string, key string, item string, value binary"
Row = tuple[str, str, str, bytes]
# The generation units live with the application (one definition of the population).
Unit = tpcc.Unit
CHUNK, units, unit_rng, unit_records, populate = (
    tpcc.CHUNK, tpcc.units, tpcc.unit_rng, tpcc.unit_records, tpcc.populate,
)


def to_rows(records: Iterable[Record]) -> Iterator[Row]:
    """``(operator, key, value, items)`` records as store rows ``(operator, key, item, msgpack value)``."""
    for op, key, value, items in records:
        if value is not None:
            yield op, key, "", serde.encode(value)
        for name, v in (items or {}).items():
            yield op, key, "\x01" + name, serde.encode(v)


def _unit_rows(scale: Scale, seed: int, it: Iterable[Unit]) -> Iterator[Row]:
    for u in it:
        yield from to_rows(unit_records(u, scale, seed))


def population_dataframe(spark: Any, W: int = 1, scale: Scale = Scale(), seed: int = 0) -> Any:
    """A DataFrame ``(operator, key, item, value)`` of the population, one Spark task per unit."""
    us = units(W, scale)
    # the district units are the heavy ones (orders and order lines): schedule them first
    us = [u for u in us if u[0] == "district"] + [u for u in us if u[0] != "district"]
    sc = spark.sparkContext
    rdd = sc.parallelize(us, len(us)).mapPartitions(lambda it: _unit_rows(scale, seed, it))
    return spark.createDataFrame(rdd, SCHEMA)


def load(runtime: Any, W: int = 1, scale: Scale = Scale(), seed: int = 0) -> int:
    """Generate the population in Spark and bulk-load it into a fresh
    :class:`~charon.runtime.spark.runtime.SparkRuntime` as its first snapshot; returns the number of store
    rows written."""
    return runtime.load_dataframe(population_dataframe(runtime.spark, W, scale, seed))


def expected_state(W: int = 1, scale: Scale = Scale(), seed: int = 0) -> dict[bytes, bytes]:
    """The store contents (store key -> msgpack value) the population must produce (for tests)."""
    from charon.core.routing import store_key

    return {store_key(op, key, item): v for op, key, item, v in to_rows(populate(W, scale, seed))}


class Population(Sequence):
    """A TPC-C population as a (lazily built) sequence of records that remembers how it was made.

    Benchmarks hand it to every system: the in-process runtime and PostgreSQL iterate the records; the Spark
    target sees ``warehouses``, ``scale`` and ``seed`` and generates the identical population in parallel.
    """

    def __init__(self, warehouses: int, scale: Scale, seed: int = 0) -> None:
        self.warehouses, self.scale, self.seed = warehouses, scale, seed
        self._records: list[Record] | None = None

    @property
    def records(self) -> list[Record]:
        if self._records is None:
            self._records = list(populate(self.warehouses, self.scale, self.seed))
        return self._records

    def __len__(self) -> int:
        return len(self.records)

    @overload
    def __getitem__(self, i: int) -> Record: ...
    @overload
    def __getitem__(self, i: slice) -> list[Record]: ...
    def __getitem__(self, i: int | slice) -> Record | list[Record]:
        return self.records[i]

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)
