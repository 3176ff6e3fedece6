"""Adaptive epochs (EpochSizer), the collector tuning and the warm-up of a started in-process runtime."""

from __future__ import annotations

import asyncio
import gc

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.runtime.node.inprocess import GC_THRESHOLD, EpochSizer


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


def _feed(s: EpochSizer, span: float, arrived: int, epochs: int) -> None:
    """``epochs`` epochs, each ``span`` seconds after the previous one, with ``arrived`` requests each."""
    for _ in range(epochs):
        s._last -= span  # as if ``span`` seconds passed since the last observation
        s.observe(1, 0.0002, arrived)


def test_sizer_starts_at_once_while_the_engine_is_mostly_idle():
    s = EpochSizer(max_wait_s=0.001)
    _feed(s, 0.001, 1, 200)  # 1,000 requests/s, one per epoch: one-request epochs keep it busy ~20%
    assert 800 < s.rate < 1200
    assert s.wait_s(1) == 0.0  # waiting would only add latency
    _feed(s, 0.0001, 10, 200)  # 100,000/s: batching pays, it waits (boundedly)
    assert s.rate > 10_000  # (real time passes between the calls too)
    assert 0 < s.wait_s(1) <= 0.001
    many_short = EpochSizer(max_wait_s=0.001)  # many short epochs do not inflate the rate (weighted by time)
    for _ in range(100):
        _feed(many_short, 0.00005, 0, 9)
        _feed(many_short, 0.00055, 1, 1)
    assert many_short.rate < 2000
    assert many_short.wait_s(1) == 0.0


def test_idle_runtime_answers_without_a_batching_window():
    rt = InProcessRuntime(ycsb.app, partitions=4, epoch_max_ms=5.0)
    rt.load("account", ycsb.initial_state(100))

    async def run() -> None:
        async with rt:
            for i in range(200):  # one request at a time, spaced: the engine is idle at each arrival
                rep = await rt.submit("account", ycsb.key(i % 100), "transfer", [ycsb.key((i + 1) % 100), 1])
                assert rep.ok
                await asyncio.sleep(0.002)

    asyncio.run(run())
    waits = [e["wait_ms"] for e in rt.epoch_stats if "wait_ms" in e]
    assert len(waits) >= 190
    assert sum(1 for w in waits if w > 0) <= 5  # the first few, before the rate is known
    assert sum(rt.entities("account").values()) == 100 * ycsb.INITIAL_BALANCE


def test_sizer_tells_costly_transactions_from_a_costly_epoch():
    # Deathstar-like: 50 us per epoch, 200 us per request, 2,000 requests/s, epochs of 1-4 requests. Batching
    # would save little (the fixed cost is small), so no epoch waits; a fit that charged everything beyond
    # 20 us per request to the epoch saw a ~700 us fixed cost and waited its whole window at every epoch.
    s = EpochSizer(max_wait_s=0.001)
    for i in range(200):
        size = 1 + i % 4
        s._last -= size / 2000  # the time those requests took to arrive
        s.observe(size, 50e-6 + 200e-6 * size, size)
    assert abs(s.per_txn_s - 200e-6) < 5e-6 and abs(s.fixed_s - 50e-6) < 5e-6
    assert 1500 < s.rate < 2500
    assert s.wait_s(1) == 0.0
    # the same costs at 10,000 requests/s (busy): it waits, boundedly, for the few requests that amortize F
    for i in range(200):
        size = 1 + i % 4
        s._last -= size / 10_000
        s.observe(size, 50e-6 + 200e-6 * size, size)
    assert 0 < s.wait_s(1) <= 0.001
