"""How many Spark jobs an epoch costs (the Spark exchange's task function run here, no Spark): a big epoch's
rest stays one job of one task up to ``rest_max_bytes``, with the same outcome as round by round; and the
task function tunes the worker's collector (``gc_threshold``)."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest

from charon import InProcessRuntime, Request, serde
from charon.apps import ycsb
from charon.config import SparkConfig
from charon.core.epoch import EpochCoordinator
from charon.core.routing import partition_of, split_store_key
from charon.runtime.spark.exchange import SparkExchange
from charon.state.durable import DurableState
from charon.testing import check_epoch

PARTS = 4
ACCOUNTS = 2_000


class CountingExchange(SparkExchange):
    """Runs each job's payloads through the task function in this process and counts jobs and tasks."""

    def run_job(self, payloads):
        self.jobs += 1
        self.tasks += self.tasks_for(payloads) if payloads[0][0] >= 0 else 1
        return list(self.fn(payloads))


def _requests(n: int, seed: int) -> list[tuple[int, Request]]:
    rng = random.Random(seed)
    return [(0, Request(f"r{seed}-{i}", "account", ycsb.key(rng.randrange(ACCOUNTS)), "transfer",
                        serde.encode([ycsb.key(rng.randrange(ACCOUNTS)), rng.randint(1, 10)]))) for i in range(n)]


def _run(tmp_path, epochs: int = 1, chunk: int | None = None, **settings,
         ) -> tuple[CountingExchange, dict, dict, object]:
    """Run ``epochs`` epochs of 3,000 transfers (each finalize but the last deferred into the next epoch's
    rest); return the exchange, the state before, the durable state after, and the last epoch's result."""
    cfg = SparkConfig(data_dir=str(tmp_path), partitions=PARTS, local_dir=str(tmp_path / "local"),
                      master="local[2]", gc_threshold=0, **settings)
    ref = InProcessRuntime(ycsb.app, partitions=PARTS)
    ref.load("account", ycsb.initial_state(ACCOUNTS))
    before = ref.snapshot()
    by_pid: dict[int, list] = {}
    for k, v in before.items():
        op, key, _ = split_store_key(k)
        by_pid.setdefault(partition_of(op, key, PARTS), []).append((k, v))
    durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
    for pid in range(PARTS):
        durable.write_base(pid, -1, sorted(by_pid.get(pid, [])))
    ex = CountingExchange(None, "charon.apps.ycsb:app", cfg)
    ex.slots = 2
    ex.jobs = ex.tasks = 0
    coord = EpochCoordinator(ycsb.app, ex, sequencers=1, chunk=chunk)
    coord.next_due = math.inf  # a fresh checkpoint: no timer to collect first (as the runtime's epoch 0)
    prior = None
    for e in range(epochs):
        result = coord.run_epoch(e, _requests(3_000, e + 1), prior=prior, defer=e < epochs - 1)
        prior = result if result.finalize is not None else None
    after: dict[bytes, bytes] = {}
    for pid in range(PARTS):
        after.update(durable.load(pid, epochs - 1)[0])
    return ex, before, dict(sorted(after.items())), result


@pytest.mark.parametrize("chunk", [0, None])
def test_a_big_epoch_is_one_job_of_one_task_and_equals_round_by_round(tmp_path, chunk: int | None) -> None:
    """Whole (chunk 0) or in chunks (the default): one job for the epoch's rest, equal to round by round."""
    one, before, after_one, res_one = _run(tmp_path / "one", chunk=chunk)
    # 3,000 transfers on 2,000 accounts: payloads far over task_min_bytes, conflicts for the fallback (fewer
    # within chunks: Aria counts them among a chunk's transactions)
    assert res_one.stats["conflicts"] > (300 if chunk == 0 else 30)
    assert (one.jobs, one.tasks) == (2, 2)  # the epoch's rest, then its finalize (not deferred here)
    many, _, after_many, res_many = _run(tmp_path / "many", chunk=chunk, rest_max_bytes=1)
    assert many.jobs >= 4  # rounds (per chunk), the fallback, the finalize
    if chunk == 0:
        assert many.tasks > many.jobs  # a whole epoch's rounds carry enough for two tasks each
    check_epoch(ycsb.app, before, after_one, res_one)
    assert after_one == after_many
    assert {t: (r.ok, r.value, r.position) for t, r in res_one.replies.items()} == \
        {t: (r.ok, r.value, r.position) for t, r in res_many.replies.items()}


@pytest.mark.parametrize("threshold", [0, 50_000])
def test_the_task_function_tunes_the_workers_collector_once(tmp_path, threshold: int) -> None:
    """In a fresh process (the tuning is per process): gc_threshold > 0 freezes what is alive and raises the
    young generation's threshold; 0 leaves CPython's defaults."""
    code = f"""
import gc, os, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import test_spark_epoch_jobs as t
from charon.runtime.spark.tasks import tune_worker_gc
before = gc.get_freeze_count()
tune_worker_gc({threshold})
tune_worker_gc({threshold})
print(gc.get_threshold()[0], gc.get_freeze_count() > before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    got = out.stdout.split()
    if threshold:
        assert got == [str(threshold), "True"]
    else:
        assert got == ["700", "False"]


def test_a_deferred_finalize_in_threads_writes_what_one_thread_writes(tmp_path) -> None:
    """The previous epoch's partitions finalized in threads inside the next epoch's rest task: the same state
    and the same replies as one partition after the other, and as the in-process runtime."""
    threaded, before, after_threaded, res_threaded = _run(tmp_path / "threads", epochs=3, finalize_threads=4)
    serial, _, after_serial, res_serial = _run(tmp_path / "serial", epochs=3, finalize_threads=1)
    assert threaded.jobs == serial.jobs == 4  # three rests (two carrying a finalize), the last finalize
    assert after_threaded == after_serial
    assert {t: (r.ok, r.value) for t, r in res_threaded.replies.items()} == \
        {t: (r.ok, r.value) for t, r in res_serial.replies.items()}
    ref = InProcessRuntime(ycsb.app, partitions=PARTS)
    ref.load("account", ycsb.initial_state(ACCOUNTS))
    for e in range(3):
        ref.run_epoch([r for _, r in _requests(3_000, e + 1)])
    assert after_threaded == ref.snapshot()
