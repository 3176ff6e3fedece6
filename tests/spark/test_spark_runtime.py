"""The Spark runtime on real PySpark (local[2]): differential against the in-process runtime, residency."""

from __future__ import annotations

import os

import pytest

from charon import serde
from charon.apps import ycsb
from charon.config import SparkConfig
from charon.messages import Request
from charon.runtime.spark.runtime import SparkRuntime
from charon.testing import replay_in_process

pytestmark = pytest.mark.spark


def _requests(n_accounts: int, count: int, seed: int, prefix: str) -> list[Request]:
    return [
        Request(f"{prefix}{i}", op, k, f, serde.encode(a))
        for i, (op, k, f, a) in enumerate(
            ycsb.workload(n_accounts, count, zipf=0.99, seed=seed, max_amount=400)
        )
    ]


def test_spark_equals_in_process_on_ycsb_zipf(spark, tmp_path):
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=4, max_batch=250, compact_every=5,
                      truncate_log=False)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg, spark=spark)
    n = 10_000
    rt.load("account", ycsb.initial_state(n, balance=500))
    initial = rt.snapshot()
    assert len(initial) == n
    reqs = _requests(n, 6000, seed=5, prefix="d")
    rt.input_log.append_many(reqs[:3000])
    rt.start()
    try:
        rt.input_log.append_many(reqs[3000:])
        rt.wait_idle(900)
    finally:
        rt.stop()
    assert rt.last_epoch >= 20, "at least 20 epochs"
    state = rt.snapshot()
    replies = rt.replies()
    assert len(replies) == len(reqs) == len({r.request_id for r in replies}), "one reply per request"
    assert sum(serde.decode(v) for v in state.values()) == 500 * n, "money is conserved"
    assert any(not r.ok for r in replies), "some transfers aborted (NotEnoughCredit)"
    fallback = sum(s.get("fast", 0) + s.get("slow_rounds", 0) for s in rt.epoch_stats)
    assert fallback > 0
    ip, results = replay_in_process(ycsb.app, rt, initial)
    assert ip.snapshot() == state, "Spark and in-process runtimes reach byte-identical state"
    by_id = {r.request_id: r for res in results for r in res.replies.values()}
    assert all(by_id[r.request_id] == r for r in replies), "and identical replies (TIDs, epochs, values)"
    # consistent state inspection through the executors' resident stores
    some = sorted(ycsb.initial_state(n))[:3]
    for k in some:
        assert rt.read_state("account", k) == ip.read_state("account", k)


def _bulk_load(spark, rt: SparkRuntime, n: int) -> None:
    def rows(it):
        for r in it:
            yield ("account", ycsb.key(r.id), "", serde.encode(1_000_000))

    df = spark.range(n, numPartitions=4).rdd.mapPartitions(rows).toDF(
        "operator string, key string, item string, value binary"
    )
    assert rt.load_dataframe(df) == n


def test_no_full_state_copy_per_epoch(spark, tmp_path):
    """The same workload over 10k and 1M accounts moves about the same bytes per epoch."""
    per_size = {}
    for n in (10_000, 1_000_000):
        cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path / str(n)), partitions=4, max_batch=500)
        rt = SparkRuntime("charon.apps.ycsb:app", cfg, spark=spark)
        _bulk_load(spark, rt, n)
        reqs = [
            Request(f"s{i}", op, k, f, serde.encode(a))
            for i, (op, k, f, a) in enumerate(ycsb.workload(10_000, 2500, zipf=0.0, seed=9))
        ]
        rt.input_log.append_many(reqs)
        rt.start()
        try:
            rt.wait_idle(900)
        finally:
            rt.stop()
        # skip the first epoch: it restores the executors' stores from the bulk-loaded base
        steady = [s for s in rt.epoch_stats if s["size"] > 0][1:]
        assert len(steady) >= 3
        moved = sum(s["spark_bytes_out"] + s["spark_bytes_in"] for s in steady) / len(steady)
        delta = sum(s["delta"] for s in steady) / len(steady)
        per_size[n] = (moved, delta)
        local = cfg.local_dir or ""
        assert not local or os.path.isdir(local)
    (m_small, d_small), (m_big, d_big) = per_size[10_000], per_size[1_000_000]
    assert m_big < 2 * m_small and m_small < 2 * m_big, per_size
    assert d_big < 2 * d_small and d_small < 2 * d_big, per_size
