"""Adaptive epochs (EpochSizer), the collector tuning and the warm-up of a started in-process runtime."""

from __future__ import annotations

import asyncio
import gc

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.runtime.inprocess import GC_THRESHOLD, EpochSizer


def test_sizer_limits_conflicting_backlogs_and_waits_boundedly():
    s = EpochSizer(max_wait_s=0.002, max_batch=4000, min_batch=100)
    assert s.limit() == 4000
    for _ in range(50):  # every epoch half conflicts: the limit shrinks, never below min_batch
        s.observe(s.limit(), 0.01, 1000, conflicts=s.limit() // 2)
    assert s.limit() == 100
    for _ in range(100):  # no conflicts: it grows back, never above max_batch
        s.observe(s.limit(), 0.01, 1000, conflicts=0)
    assert s.limit() == 4000
    for _ in range(20):  # a slow trickle of tiny epochs: waits, at most max_wait_s
        s.observe(1, 0.0005, 1)
    assert 0 < s.wait_s(1) <= 0.002
    assert s.wait_s(int(s.target()) + 1) == 0.0  # enough waiting to amortize the fixed cost: no wait


def test_started_runtime_tunes_gc_and_keeps_money_under_a_burst():
    rt = InProcessRuntime(ycsb.app, partitions=4, epoch_max_txns=500)
    rt.load("account", ycsb.initial_state(200))
    reqs = list(ycsb.workload(200, 3000, seed=3))

    async def run() -> list:
        async with rt:
            return await asyncio.gather(*(rt.submit(*r[:3], r[3]) for r in reqs))

    replies = asyncio.run(run())
    assert gc.get_threshold()[0] >= GC_THRESHOLD
    assert all(r.ok or r.error_type == "NotEnoughCredit" for r in replies)
    assert sum(rt.entities("account").values()) == 200 * ycsb.INITIAL_BALANCE
    sizes = [e["size"] for e in rt.epoch_stats]
    assert max(sizes) <= 500 and sum(sizes) >= 3000  # the cap holds; deferred ones ran again
    # the warm-up ran on a scratch runtime: this runtime's epochs start at 0 and hold only real requests
    assert rt.epoch_stats[0]["epoch"] == 0
    assert rt.entities("__warmup") == {}  # the built-in warm-up application ran elsewhere
