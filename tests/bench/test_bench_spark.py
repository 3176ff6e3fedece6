"""Benchmark workloads on the Spark runtime (real PySpark, local[2]): the TPC-C population generated in parallel
by Spark, TPC-C consistency after a mixed run (and equality with the in-process runtime), Deathstar capacity."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from charon import serde
from charon.apps import deathstar, tpcc, tpcc_spark, ycsb
from charon.bench.spark import app_ref, bulk_load, load_spec
from charon.config import SparkConfig
from charon.core.routing import split_store_key
from charon.messages import Request
from charon.runtime.spark.runtime import SparkRuntime
from charon.testing import replay_in_process

pytestmark = pytest.mark.spark

SMALL = tpcc.Scale(districts=5, customers=30, items=1000)  # few conflicts: every round is a Spark job


def _runtime(spark: Any, app: str, tmp_path: Any, max_batch: int) -> SparkRuntime:
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=4, max_batch=max_batch,
                      compact_every=3, truncate_log=False)
    return SparkRuntime(app, cfg, spark=spark)


def _readers(state: dict[bytes, bytes]) -> tuple[Callable[..., Any], Callable[[str, str], dict[str, Any]]]:
    values: dict[tuple[str, str], Any] = {}
    items: dict[tuple[str, str], dict[str, Any]] = {}
    for k, v in state.items():
        op, key, item = split_store_key(k)
        if item == "":
            values[(op, key)] = serde.decode(v)
        else:
            items.setdefault((op, key), {})[item[1:]] = serde.decode(v)
    return (lambda op, key, default=None: values.get((op, key), default)), (lambda op, key: items.get((op, key), {}))


def _run(rt: SparkRuntime, reqs: list[tuple[str, str, str, list]], prefix: str) -> dict[str, Any]:
    """Run requests to completion (half appended before the query starts, half after); replies by id."""
    recs = [Request(f"{prefix}{i}", op, k, f, serde.encode(a)) for i, (op, k, f, a) in enumerate(reqs)]
    half = len(recs) // 2
    rt.input_log.append_many(recs[:half])
    rt.start()
    try:
        rt.input_log.append_many(recs[half:])
        rt.wait_idle(300)
    finally:
        rt.stop()
    replies = {r.request_id: r for r in rt.replies()}
    assert len(replies) == len(recs) == len(rt.replies()), "exactly one reply per request"
    return replies


def test_spark_generated_tpcc_population_is_the_units_union(spark):
    scale = tpcc.Scale(districts=2, customers=25, items=tpcc_spark.CHUNK + 7)
    us = tpcc_spark.units(2, scale)
    assert Counter(u[0] for u in us) == {"item": 2, "warehouse": 2, "stock": 4, "district": 4}
    df = tpcc_spark.population_dataframe(spark, 2, scale, seed=3)
    assert df.rdd.getNumPartitions() == len(us), "one Spark task per unit"
    got = sorted(tuple(r) for r in df.collect())
    want = sorted(tpcc_spark.to_rows(tpcc_spark.populate(2, scale, seed=3)))
    assert [(a, b, c, bytes(d)) for a, b, c, d in got] == want
    assert len({(a, b, c) for a, b, c, _ in want}) == len(want), "no store key twice"
    assert want != sorted(tpcc_spark.to_rows(tpcc_spark.populate(2, scale, seed=4))), "the seed matters"

    # one definition of the population: tpcc.populate yields exactly what the Spark tasks generate
    ref = list(tpcc.populate(2, scale, seed=3))
    mine = list(tpcc_spark.populate(2, scale, seed=3))
    assert sorted(tpcc_spark.to_rows(ref)) == want
    for recs in (mine,):
        by = {(op, key): (value, items) for op, key, value, items in recs}
        lines = Counter(key.rsplit(":", 1)[0] for op, key, _, _ in recs if op == "order_line")
        assert all(lines[k] == v["ol_cnt"] for (op, k), (v, _) in by.items() if op == "order"), "O_OL_CNT lines"
        assert len(by[("customer_index", "2:2")][1]) == scale.customers
        assert by[("district", "1:2")][0]["next_o_id"] == scale.customers + 1
        assert by[("warehouse", "2")][0]["ytd"] == 3_000_000 * scale.districts
    state = tpcc_spark.expected_state(2, scale, seed=3)
    assert tpcc.check(*_readers(state)) == [], "the generated population is TPC-C consistent"


def test_tpcc_on_spark_keeps_consistency_and_equals_in_process(spark, tmp_path):
    rt = _runtime(spark, "charon.apps.tpcc:app", tmp_path, max_batch=8)
    loaded = tpcc_spark.load(rt, 1, SMALL, seed=1)
    initial = rt.snapshot()
    assert initial == tpcc_spark.expected_state(1, SMALL, seed=1), "bulk load = the generated population"
    assert loaded == len(initial)

    rng = random.Random(5)
    reqs = [tpcc.next_request(rng, 1, SMALL) for _ in range(14)]
    reqs += [tpcc.new_order_request(rng, 1, SMALL, rollback=True), tpcc.payment_request(random.Random(2), 1, SMALL)]
    replies = _run(rt, reqs, "t")
    assert rt.last_epoch >= 1, "several epochs"

    state = rt.snapshot()
    read_state, read_items = _readers(state)
    assert tpcc.check(read_state, read_items) == [], "TPC-C consistency conditions 1-4"
    by_req = [replies[f"t{i}"] for i in range(len(reqs))]
    new_orders = [r for q, r in zip(reqs, by_req, strict=True) if q[2] == "new_order"]
    assert any(r.error_type == "UnknownItem" for r in new_orders), "the rolled-back NewOrder aborted"
    committed_no = sum(r.ok for r in new_orders)
    assert committed_no >= 3
    next_ids = sum(read_state("district", f"1:{d}")["next_o_id"] for d in range(1, SMALL.districts + 1))
    assert next_ids == SMALL.districts * (SMALL.customers + 1) + committed_no, "one order id per committed NewOrder"
    paid = sum(q[3][4] for q, r in zip(reqs, by_req, strict=True) if q[2] == "payment" and r.ok)
    assert paid > 0 and read_state("warehouse", "1")["ytd"] == 3_000_000 * SMALL.districts + paid

    ip, results = replay_in_process(tpcc.app, rt, initial)
    assert ip.snapshot() == state, "Spark and in-process runtimes reach byte-identical state"
    by_id = {r.request_id: r for res in results for r in res.replies.values()}
    assert all(by_id[rid] == r for rid, r in replies.items()), "and identical replies"


def test_deathstar_reservations_on_spark_never_exceed_capacity(spark, tmp_path):
    assert app_ref(deathstar.app) == "charon.apps.deathstar:app"
    assert load_spec(ycsb.app, [("account", ycsb.key(i), 7, None) for i in range(3)]).kind == "ycsb"
    hotels, flights, users, cap = 4, 4, 40, 3
    records = list(deathstar.populate(hotels, flights, users, cap, movies=5, movie_users=5))
    spec = load_spec(deathstar.app, records)
    assert spec.kind == "rows"
    rt = _runtime(spark, "charon.apps.deathstar:app", tmp_path, max_batch=25)
    assert bulk_load(rt, spec) == len(spec.rows)
    initial = rt.snapshot()
    assert len(initial) == len(spec.rows)

    rng = random.Random(9)
    reqs = [deathstar.reserve_request(rng, hotels, flights, users) for _ in range(60)]
    reqs += [deathstar.next_request(rng, hotels, flights, users) for _ in range(10)]
    replies = _run(rt, reqs, "r")
    state = rt.snapshot()
    read_state, _ = _readers(state)
    assert deathstar.check(read_state, hotels, flights, users, movies=5, movie_users=5) == []
    booked = [len(read_state("hotel", f"h{h:03d}")["reservations"]) for h in range(hotels)]
    assert max(booked) == cap, "some hotel was filled to capacity, and not beyond"
    ok = [r for q, r in zip(reqs, (replies[f"r{i}"] for i in range(len(reqs))), strict=True) if q[2] == "reserve"]
    assert sum(booked) == sum(r.ok for r in ok) <= hotels * cap
    assert any(r.error_type == "SoldOut" for r in ok), "requests beyond capacity were refused"
    ip, _ = replay_in_process(deathstar.app, rt, initial)
    assert ip.snapshot() == state
