"""The fallback's per-entity lock queues (``charon.core.epoch._Queues``) against the serial oracle.

Generated epochs over a few hot entities, with call targets read from the state (so re-runs leave their dry
run's set, like TPC-C's order ids from a district counter), state-dependent aborts, async sends and gathers.
Every epoch must equal the serial execution of its outcomes in their reported order
(:func:`charon.testing.check_epoch`), and the seeds together must reach each path of the queues: cached
replays committing in chains, re-runs committed outside their known set, re-queues, deferrals and aborts.
"""

from __future__ import annotations

import random

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.testing import check_epoch

cell = Operator("cell")
KEYS = [f"k{i}" for i in range(6)]


class Refused(Exception):
    """A state-dependent abort."""


@cell.function
async def getv(ctx: Context) -> int:
    return ctx.get(default=0)


@cell.function
async def add(ctx: Context, d: int) -> int:
    v = ctx.get(default=0) + d
    if v % 11 == 7:
        raise Refused(f"{ctx.key} would hold {v}")
    ctx.put(v)
    return v


@cell.function
async def append(ctx: Context, v: int) -> int:
    """A counter picks the slot written (NewOrder's order id): the target depends on the state."""
    n = ctx.get(default=0)
    ctx.put(n + 1)
    await ctx.call(cell, f"slot{n % 5}", "add", v)
    return n


@cell.function
async def chase(ctx: Context, hops: int) -> int:
    """Follow the value to another key (a state-dependent call target), adding one there."""
    v = ctx.get(default=0)
    nxt = KEYS[v % len(KEYS)]
    if hops > 0 and nxt != ctx.key:
        return await ctx.call(cell, nxt, "chase", hops - 1)
    ctx.put(v + 1)
    return v


@cell.function
async def move(ctx: Context, dst: str, amount: int) -> int:
    """Transfer: aborts on an insufficient balance (an outcome that depends on what was read)."""
    v = ctx.get(default=0)
    if v < amount:
        raise Refused(f"{ctx.key} has {v} < {amount}")
    ctx.put(v - amount)
    if dst != ctx.key:
        await ctx.call(cell, dst, "add", amount)
    return v - amount


@cell.function
async def total(ctx: Context, keys: list) -> int:
    """Read several entities at once and store the sum; sends a bump to a key chosen by that sum."""
    vals = await ctx.gather(*(ctx.call(cell, k, "getv") for k in keys if k != ctx.key))
    s = sum(vals)
    ctx.put(s % 50)
    ctx.send(cell, KEYS[s % len(KEYS)], "add", 1)
    return s


app = Application("lockq", [cell])


def _request(rng: random.Random, n: int) -> Request:
    k = rng.choice(KEYS)
    kind = rng.random()
    if kind < 0.25:
        fn, args = "append", [rng.randint(1, 9)]
        k = rng.choice(["c0", "c1"])
    elif kind < 0.45:
        fn, args = "chase", [rng.randint(0, 3)]
    elif kind < 0.7:
        fn, args = "move", [rng.choice(KEYS), rng.randint(0, 6)]
    elif kind < 0.85:
        fn, args = "total", [rng.sample(KEYS, rng.randint(1, 3))]
    else:
        fn, args = "add", [rng.randint(1, 5)]
    return Request(f"r{n}", "cell", k, fn, serde.encode(args), ts=float(n))


def run_seed(seed: int, totals: dict[str, float]) -> None:
    """A few contended epochs (and what they defer), each checked against the oracle."""
    rng = random.Random(seed)
    rt = InProcessRuntime(app, partitions=rng.choice([1, 2, 3, 4]))
    rt.load("cell", {k: rng.randint(0, 9) for k in KEYS})
    n = 0
    results = []
    for _ in range(3):
        reqs = []
        for _ in range(rng.randint(2, 30)):
            n += 1
            reqs.append(_request(rng, n))
        before = rt.snapshot()
        res = rt.run_epoch(reqs)
        check_epoch(app, before, rt.snapshot(), res)
        results.append(res)
    while rt.coordinator.deferred:
        before = rt.snapshot()
        res = rt.run_epoch([])
        check_epoch(app, before, rt.snapshot(), res)
        results.append(res)
    for res in results:
        for k in ("fast", "outside", "requeued", "deferred", "conflicts"):
            totals[k] = totals.get(k, 0) + res.stats.get(k, 0)
        totals["slow_aborts"] = totals.get("slow_aborts", 0) + sum(1 for t in res.slow if not res.replies[t].ok)
        totals["slow_commits"] = totals.get("slow_commits", 0) + sum(1 for t in res.slow if res.replies[t].ok)


def test_lock_queues_match_the_serial_oracle() -> None:
    """400 generated seeds (~10 s of CPU here): every epoch serial, every queue path reached."""
    totals: dict[str, float] = {}
    for seed in range(400):
        try:
            run_seed(seed, totals)
        except AssertionError as exc:
            raise AssertionError(
                f"seed {seed}: {exc}\nreproduce: .venv/bin/python -c "
                f"'from tests.test_lock_queues import run_seed; run_seed({seed}, {{}})'") from exc
    for k in ("fast", "outside", "requeued", "deferred", "slow_aborts", "slow_commits"):
        assert totals[k] > 0, (k, totals)
