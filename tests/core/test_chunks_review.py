"""Adversarial review of epochs in chunks (charon.core.epoch EPOCH_CHUNK): chunk boundaries with transactions
deferred by the previous epoch, timers fired at the epoch's start, requests refused by validation inside later
chunks, the rest of an epoch taken by the exchange at a later chunk or round (as the Spark rest task does, with
``PartitionUnit.decided`` after it), a deferred finalize, live coroutines or journal replay.

Each undeferred epoch is checked against the serial oracle (:func:`charon.testing.check_epoch`: replies, state,
timers, the atom of events); every variant of one seed and chunk size must give the same replies, places,
commit paths, timers and state.
"""

from __future__ import annotations

import os
import random

import pytest
from epochcmp import assert_same_outcome

from charon import Application, Context, Operator, Request, serde
from charon.config import SparkConfig
from charon.core import partition
from charon.core.epoch import EpochCoordinator, RestJob, run_rest
from charon.core.partition import PartitionUnit
from charon.runtime.node.inprocess import LocalExchange
from charon.runtime.spark.exchange import SparkExchange
from charon.state.durable import DurableState
from charon.state.store import MemoryStore
from charon.testing import check_epoch

pytestmark = pytest.mark.usefixtures("fresh_means_empty")  # see conftest.py

acct = Operator("acct")
KEYS = ["a", "b", "c", "d", "e", "f"]


@acct.function
async def arm(ctx: Context, seconds: float, to: str) -> int:
    """Add one, register a timer that pings ``to`` after ``seconds``, emit it."""
    n = ctx.get(default=0) + 1
    ctx.put(n)
    ctx.send_after(seconds, acct, to, ping, ctx.key)
    ctx.emit("armed", [ctx.key, n])
    return n


@acct.function
async def ping(ctx: Context, origin: str) -> int:
    n = ctx.get(default=0) + 10
    ctx.put(n)
    ctx.emit("pings", [origin, ctx.key, n])
    return n


@acct.function
async def move(ctx: Context, to: str) -> int:
    """Read-modify-write two entities (a conflict whenever another transaction touches either)."""
    n = ctx.get(default=0)
    ctx.put(n + 1)
    ctx.emit("moves", [ctx.key, n])
    return await ctx.call(acct, to, ping, ctx.key)


@acct.function
async def hop(ctx: Context, hops: int) -> int:
    """The next entity is chosen by the value read: a re-run may step outside its dry run's set (deferrals)."""
    v = ctx.get(default=0)
    nxt = KEYS[v % len(KEYS)]
    r = await ctx.call(acct, nxt, "hop", hops - 1) if hops and nxt != ctx.key else v
    ctx.put(v + 1)
    return r


@acct.function
async def check(ctx: Context, limit: int) -> int:
    """Aborts on a state-dependent condition (after a write)."""
    v = ctx.get(default=0)
    ctx.put(v + 1)
    if v % 7 > limit:
        raise ValueError(f"{ctx.key}: {v}")
    return v


app = Application("chunks_review", [acct])


def _request(rng: random.Random, name: str, t: float, keys: list[str]) -> Request:
    k, to = rng.choice(keys), rng.choice(keys)
    x = rng.random()
    if x < 0.12:  # refused by validation (never runs), at any place of the epoch
        op, fn, args = rng.choice([("acct", "nope", []), ("nope", "ping", ["x"]), ("acct", "ping", [1, 2]),
                                   ("acct", "move", "notalist")])
        return Request(name, op, k, fn, serde.encode(args), t)
    if x < 0.3:
        fn, args = "arm", [rng.choice([0.0, 0.5, 1.0, 2.0]), to]
    elif x < 0.55:
        fn, args = "move", [to]
    elif x < 0.8:
        fn, args = "hop", [rng.randint(0, 3)]
    elif x < 0.9:
        fn, args = "check", [rng.randint(2, 6)]
    else:
        fn, args = "ping", ["req"]
    return Request(name, "acct", k, fn, serde.encode(args), t)


def workload(seed: int) -> list[tuple[float, list[Request]]]:
    """Ten epochs and a drain; every other seed contended (three entities, bigger epochs: many deferrals)."""
    rng = random.Random(seed)
    keys, most = (KEYS[:3], 30) if seed % 2 else (KEYS, 14)
    epochs, t = [], 1000.0
    for e in range(10):
        t += rng.choice([0.0, 0.5, 1.0, 2.0])
        epochs.append((t, [_request(rng, f"r{e}.{i}", t, keys) for i in range(rng.randint(0, most))]))
    return epochs + [(t + 5.0 + i, []) for i in range(4)]  # drain: deferred transactions, late timers


class LateRest(LocalExchange):
    """Declines the rest of an epoch at some (chunk, round)s, then takes it as the Spark rest task does: the
    prior's finalize first, the rest over every unit, then ``decided`` (the scratch shrunk to what the
    finalize writes)."""

    def __init__(self, units: list[PartitionUnit], seed: int) -> None:
        super().__init__(units)
        self.rng = random.Random(seed)
        self.taken: list[tuple[int, int]] = []

    def rest(self, job: RestJob):  # noqa: ANN201
        if self.rng.random() < 0.7:
            return None
        events: list = []
        if job.prior is not None:
            for u in self.units:
                events.extend(u.finalize_prior(job.prior).events)
        out = run_rest(app, LocalExchange(self.units), job)
        for u in self.units:
            u.decided(out.apply, out.reset)
        out.prior_events = events
        self.taken.append((job.chunk, job.n))
        return out


def run(seed: int, chunk: int, parts: int, exchange: str, defer: bool, check: bool):
    stores = [MemoryStore() for _ in range(parts)]
    units = [PartitionUnit(p, parts, app, s) for p, s in enumerate(stores)]
    ex = LateRest(units, seed) if exchange == "late" else LocalExchange(units)
    atoms: list[tuple[int, list]] = []
    coord = EpochCoordinator(app, ex, on_finalized=lambda r: atoms.append((r.epoch, list(r.events))), chunk=chunk)
    coord.next_due = float("inf")

    def snap() -> dict[bytes, bytes]:
        return dict(sorted((k, v) for s in stores for k, v in s.data.items()))

    results = []
    prior = None
    for e, (now, reqs) in enumerate(workload(seed)):
        before = snap()
        res = coord.run_epoch(e, [(0, r) for r in reqs], now, prior=prior, defer=defer)
        if res.finalize is None:
            atoms.append((e, list(res.events)))
            if check:
                check_epoch(app, before, snap(), res, partitions=parts)
        results.append(res)
        prior = res if res.finalize is not None else None
    if prior is not None:
        coord.finalize(prior)
    assert not coord.deferred, "deferred transactions never finished"
    return results, atoms, snap(), getattr(ex, "taken", None)


@pytest.mark.parametrize("seed", range(30))
def test_chunked_epochs_equal_serial_on_every_path(seed: int, monkeypatch) -> None:
    rng = random.Random(seed * 31 + 5)
    chunk = rng.choice([1, 2, 3, 5, 8])
    parts = rng.choice([1, 2, 3])
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", rng.random() < 0.5)
    base, atoms, state, _ = run(seed, chunk, parts, "local", False, True)
    assert any(r.timers for r in base), "timers fire"
    assert any(len(r.order) > chunk for r in base), "epochs of several chunks"
    assert chunk == 1 or sum(r.stats.get("conflicts", 0) for r in base) > 0, "conflicts within chunks"
    for exchange, defer in (("late", False), ("local", True), ("late", True)):
        got, got_atoms, got_state, taken = run(seed, chunk, parts, exchange, defer, not defer)
        for g, w in zip(got, base, strict=True):
            assert_same_outcome(g, w)
            assert [t.id for t in g.timers] == [t.id for t in w.timers]
        assert sorted(got_atoms) == sorted(atoms), (exchange, defer)
        assert got_state == state, (exchange, defer)


# -- the Spark task path (pickled rounds, the rest task declining at chunk 0) ----------------------------------
class PickledLate(SparkExchange):
    """The Spark exchange with its jobs run here; the rest task is declined until ``from_chunk``/``from_round``."""

    from_chunk = 1
    from_round = 0

    def run_job(self, payloads):  # noqa: ANN001, ANN201
        return list(self.fn(payloads))

    def rest(self, job: RestJob):  # noqa: ANN201
        if (job.chunk, job.n) < (self.from_chunk, self.from_round):
            return None
        return super().rest(job)


@pytest.mark.parametrize("seed", range(4))
def test_pickled_rest_task_taken_at_a_later_chunk_equals_in_process(seed: int, tmp_path, monkeypatch) -> None:
    """Through pickled Spark rounds: the rest task declined at chunk 0 (driver rounds, the driver's call-graph
    cache) and taken at a later chunk or round (carry, cache and ``decided`` scratch shipped back)."""
    rng = random.Random(seed * 17 + 3)
    chunk, parts = rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", rng.random() < 0.5)
    want, _, state, _ = run(seed, chunk, parts, "local", False, False)
    cfg = SparkConfig(data_dir=str(tmp_path), partitions=parts, local_dir=os.path.join(tmp_path, "local"),
                      single_task_rest=True, single_task_fallback=rng.random() < 0.5)
    durable = DurableState(os.path.join(cfg.checkpoint_dir, "state"))
    for pid in range(parts):
        durable.write_base(pid, -1, [])
    ex = PickledLate(None, f"{__name__}:app", cfg)
    ex.from_chunk, ex.from_round = rng.choice([(1, 0), (1, 1), (2, 0), (0, 1)])
    coord = EpochCoordinator(app, ex, chunk=chunk)
    coord.next_due = float("inf")
    for e, (now, reqs) in enumerate(workload(seed)):
        got = coord.run_epoch(e, [(0, r) for r in reqs], now)
        assert_same_outcome(got, want[e])
        assert [t.id for t in got.timers] == [t.id for t in want[e].timers]
    got_state: dict[bytes, bytes] = {}
    for pid in range(parts):
        got_state.update(durable.load(pid, len(want) - 1)[0])
    assert dict(sorted(got_state.items())) == state
