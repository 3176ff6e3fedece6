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
``""``, a named item ``name`` is stored as ``"\\x01" + name`` (as :meth:`charon.context.Context.put_item` does).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

from charon import serde
from charon.apps import tpcc
from charon.apps.tpcc import Record, Scale

CHUNK = 2_500  # items (and stock rows) per unit: part of the population's definition (it seeds the units)
SCHEMA = "operator string, key string, item string, value binary"
Row = tuple[str, str, str, bytes]
Unit = tuple  # ("item", lo, hi) | ("warehouse", w) | ("stock", w, lo, hi) | ("district", w, d)


def units(W: int, scale: Scale) -> list[Unit]:
    """The generation units of a population, in canonical order (the order :func:`populate` yields)."""
    out: list[Unit] = []
    chunks = [(lo, min(lo + CHUNK - 1, scale.items)) for lo in range(1, scale.items + 1, CHUNK)]
    out += [("item", lo, hi) for lo, hi in chunks]
    for w in range(1, W + 1):
        out.append(("warehouse", w))
        out += [("stock", w, lo, hi) for lo, hi in chunks]
        out += [("district", w, d) for d in range(1, scale.districts + 1)]
    return out


def unit_rng(seed: int, unit: Unit) -> random.Random:
    """The unit's own generator (string seeds are hashed with SHA-512: stable across processes)."""
    return random.Random("tpcc:" + ":".join(str(x) for x in (seed, *unit)))


def _items(rng: random.Random, lo: int, hi: int) -> Iterator[Record]:
    for i in range(lo, hi + 1):
        data = tpcc._astring(rng, 26, 50)
        if rng.random() < 0.1:
            data = data[:10] + "ORIGINAL" + data[18:]
        yield "item", str(i), {"name": tpcc._astring(rng, 14, 24), "price": rng.randint(100, 10000),
                               "data": data}, None


def _warehouse(rng: random.Random, w: int, scale: Scale) -> Iterator[Record]:
    yield "warehouse", str(w), {"ytd": 3_000_000 * scale.districts}, {
        "info": {"name": f"W{w}", "tax": rng.randint(0, 2000) / 10000}}


def _stock(rng: random.Random, w: int, lo: int, hi: int) -> Iterator[Record]:
    for i in range(lo, hi + 1):
        yield "stock", f"{w}:{i}", {
            "quantity": rng.randint(10, 100), "ytd": 0, "order_cnt": 0, "remote_cnt": 0,
            "dist": tpcc._astring(rng, 24, 24), "data": tpcc._astring(rng, 26, 50),
        }, None


def _district(rng: random.Random, w: int, d: int, scale: Scale) -> Iterator[Record]:
    """One district exactly as ``tpcc.populate`` builds it (same rows, same order of draws)."""
    C, n_items, n_orders = scale.customers, scale.items, scale.initial_orders
    yield "district", f"{w}:{d}", {"tax": rng.randint(0, 2000) / 10000, "next_o_id": n_orders + 1}, \
        {"ytd": 3_000_000}
    index: dict[str, int] = {}
    for c in range(1, C + 1):
        last = tpcc.last_name(c - 1 if c <= 1000 else tpcc.nurand(rng, 255, 0, 999, tpcc._C_LAST))
        first = tpcc._astring(rng, 8, 16)
        index[f"{last}:{first}:{c:06d}"] = c
        yield "customer", f"{w}:{d}:{c}", {
            "balance": -1000, "ytd_payment": 1000, "payment_cnt": 1, "delivery_cnt": 0,
            "data": tpcc._astring(rng, 30, 60),
        }, {"info": {"first": first, "middle": "OE", "last": last,
                     "credit": "BC" if rng.random() < 0.1 else "GC",
                     "discount": rng.randint(0, 5000) / 10000}}
        yield "history", f"{w}:{d}:{c}", 1, {"00000001": {"w_id": w, "d_id": d, "amount": 1000,
                                                          "date": 0.0, "data": "initial"}}
    yield "customer_index", f"{w}:{d}", None, index
    perm = list(range(1, C + 1))
    rng.shuffle(perm)
    first_new = n_orders - (n_orders * 3) // 10 + 1  # 2101 of 3000
    for o in range(1, n_orders + 1):
        ol_cnt = rng.randint(5, 15)
        delivered = o < first_new
        yield "order", f"{w}:{d}:{o}", {"c_id": perm[(o - 1) % C], "ol_cnt": ol_cnt, "all_local": True,
                                        "entry_d": 0.0,
                                        "carrier_id": rng.randint(1, 10) if delivered else None}, None
        for n in range(1, ol_cnt + 1):
            yield "order_line", f"{w}:{d}:{o}:{n}", {
                "i_id": rng.randint(1, n_items), "supply_w_id": w, "quantity": 5,
                "amount": 0 if delivered else rng.randint(1, 999999),
                "dist_info": tpcc._astring(rng, 24, 24), "delivery_d": 0.0 if delivered else None,
            }, None
        if not delivered:
            yield "new_order", f"{w}:{d}:{o}", 1, None


def unit_records(unit: Unit, scale: Scale, seed: int = 0) -> Iterator[Record]:
    """The records ``(operator, key, value, items)`` of one unit (deterministic in ``unit, scale, seed``)."""
    rng = unit_rng(seed, unit)
    kind = unit[0]
    if kind == "item":
        return _items(rng, unit[1], unit[2])
    if kind == "warehouse":
        return _warehouse(rng, unit[1], scale)
    if kind == "stock":
        return _stock(rng, unit[1], unit[2], unit[3])
    if kind == "district":
        return _district(rng, unit[1], unit[2], scale)
    raise ValueError(f"unknown unit {unit!r}")


def populate(W: int = 1, scale: Scale = Scale(), seed: int = 0) -> Iterator[Record]:
    """The whole population in the driver, unit after unit (same records as :func:`population_dataframe`)."""
    for u in units(W, scale):
        yield from unit_records(u, scale, seed)


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
    """Generate the population in Spark and bulk-load it into a fresh :class:`~charon.spark.runtime.SparkRuntime`
    as its first snapshot; returns the number of store rows written."""
    return runtime.load_dataframe(population_dataframe(runtime.spark, W, scale, seed))


def expected_state(W: int = 1, scale: Scale = Scale(), seed: int = 0) -> dict[bytes, bytes]:
    """The store contents (store key -> msgpack value) the population must produce (for tests)."""
    from charon.routing import store_key

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
