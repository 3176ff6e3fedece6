"""Live coroutines when rounds hop between worker processes (as Spark tasks do), without Spark itself.

The Spark exchange's task function runs here directly; each round runs in one of two simulated worker
processes picked at random (each with its own table of live coroutines). A transaction reset and re-run
must never resume a coroutine that an earlier run left in the other worker: the result must equal the
in-process runtime's, and TPC-C's consistency conditions must hold.
"""

from __future__ import annotations

import os
import random

import pytest

from charon import InProcessRuntime, Request, serde
from charon.apps import tpcc
from charon.config import SparkConfig
from charon.core import partition
from charon.core.epoch import EpochCoordinator
from charon.core.routing import partition_of, split_store_key
from charon.runtime.spark.exchange import SparkExchange
from charon.state.durable import DurableState

SCALE = tpcc.Scale(districts=2, customers=30, items=200)

# every round a job of its own, as these tests hop rounds between workers (the one-task modes: test_sim)
ROUND_BY_ROUND = {"single_task_rest": False, "single_task_fallback": False}


class HoppingExchange(SparkExchange):
    """Runs each round's tasks in this process, in one of two workers' live-coroutine tables at random."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.tables: list[dict] = [{}, {}]
        self.rng = random.Random(0)

    def run_job(self, payloads):
        table = self.rng.choice(self.tables)
        saved = partition._LIVE
        partition._LIVE = table
        try:
            return list(self.fn(payloads))
        finally:
            partition._LIVE = saved


def _requests(seed: int, n: int) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        op, key, fn, args = tpcc.new_order_request(rng, 1, SCALE) if i % 3 else tpcc.payment_request(rng, 1, SCALE)
        out.append(Request(f"r{i}", op, key, fn, serde.encode(args)))
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_rounds_hopping_between_workers_equal_in_process(tmp_path, seed):
    parts = 3
    cfg = SparkConfig(data_dir=str(tmp_path), partitions=parts, local_dir=str(tmp_path / "local"),
                      **ROUND_BY_ROUND)
    durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
    reference = InProcessRuntime(tpcc.app, partitions=parts)
    tpcc.load(reference, tpcc.populate(1, SCALE, seed=seed))
    initial = reference.snapshot()
    by_pid: dict[int, list] = {}
    for k, v in initial.items():
        op, key, _ = split_store_key(k)
        by_pid.setdefault(partition_of(op, key, parts), []).append((k, v))
    for pid in range(parts):
        durable.write_base(pid, -1, sorted(by_pid.get(pid, [])))
    ex = HoppingExchange(None, "charon.apps.tpcc:app", cfg)
    spark_like = EpochCoordinator(tpcc.app, ex, sequencers=1)
    reqs = _requests(seed, 48)
    rng = random.Random(seed)
    epoch, i = 0, 0
    while i < len(reqs) or spark_like.deferred:
        n = rng.randint(4, 12)
        batch = [(0, r) for r in reqs[i : i + n]]
        i += n
        a = spark_like.run_epoch(epoch, batch)
        b = reference.coordinator.run_epoch(epoch, batch)
        assert a.replies == b.replies
        epoch += 1
    state = {}
    for pid in range(parts):
        data, _ = durable.load(pid, epoch - 1)
        state.update(data)
    assert dict(sorted(state.items())) == reference.snapshot()
    assert tpcc.check(lambda op, k: reference.read_state(op, k), lambda op, k: reference.read_items(op, k)) == []
