"""A deferred finalize (``run_epoch(defer=...)``, the Spark runtime's ``pipeline_finalize``) with timers and
output streams: every epoch gives the same replies, fires the same timers and gets the same atom of events as
without deferral, each atom is handed over exactly once and in epoch order before the next epoch's record, and
the state ends the same; also when the rest of an epoch and its fallback run through ``rest``/``fallback``
(the one-task paths, here in this process)."""

from __future__ import annotations

import random

import pytest

from charon import Application, Context, Operator, Request, serde
from charon.core.epoch import EpochCoordinator, EpochResult, FallbackJob, RestJob, run_fallback, run_rest
from charon.core.partition import PartitionUnit
from charon.runtime.node.inprocess import LocalExchange
from charon.state.store import MemoryStore

acct = Operator("acct")


@acct.function
async def arm(ctx: Context, seconds: float, to: str) -> int:
    """Add one, register a timer that pings ``to`` after ``seconds``, emit what was done."""
    n = ctx.get(default=0) + 1
    ctx.put(n)
    ctx.send_after(seconds, acct, to, ping, ctx.key)
    ctx.emit("armed", [ctx.key, n])
    return n


@acct.function
async def ping(ctx: Context, origin: str) -> int:
    """Count a ping (from a timer or a request) and emit it."""
    n = ctx.get(default=0) + 10
    ctx.put(n)
    ctx.emit("pings", [origin, ctx.key, n])
    return n


@acct.function
async def move(ctx: Context, to: str) -> int:
    """Read-modify-write two entities (conflicts), emitting from both."""
    n = ctx.get(default=0)
    ctx.put(n + 1)
    ctx.emit("moves", [ctx.key, n])
    return await ctx.call(acct, to, ping, ctx.key)


app = Application("pipelined", [acct])
KEYS = ["a", "b", "c", "d", "e"]


class OneTask(LocalExchange):
    """The one-task paths in this process: the rest of an epoch and its fallback run where the units are."""

    def rest(self, job: RestJob):
        events: list = []
        for u in self.units:
            if job.prior is not None:
                events.extend(u.finalize_prior(job.prior).events)
        out = run_rest(app, LocalExchange(self.units), job)
        out.prior_events = events
        return out

    def fallback(self, job: FallbackJob):
        return run_fallback(app, LocalExchange(self.units), job)


class OneTaskFallback(LocalExchange):
    """Rounds one by one, the fallback (every wave) at once."""

    def fallback(self, job: FallbackJob):
        return run_fallback(app, LocalExchange(self.units), job)


def workload(seed: int) -> list[tuple[float, list[Request]]]:
    rng = random.Random(seed)
    epochs, t = [], 1000.0
    for e in range(12):
        t += rng.choice([0.0, 0.5, 1.0, 2.0])
        reqs = []
        for i in range(rng.randint(0, 6)):
            k, to = rng.choice(KEYS), rng.choice(KEYS)
            fn, args = rng.choice([("arm", [rng.choice([0.0, 0.5, 1.0, 3.0]), to]), ("ping", ["req"]),
                                   ("move", [to])])
            reqs.append(Request(f"r{e}.{i}", "acct", k, fn, serde.encode(args), t))
        epochs.append((t, reqs))
    return epochs


def run(seed: int, defer: bool, exchange_cls: type = LocalExchange, parts: int = 3):
    stores = [MemoryStore() for _ in range(parts)]
    ex = exchange_cls([PartitionUnit(p, parts, app, s) for p, s in enumerate(stores)])
    handed: list[tuple[int, list]] = []  # (epoch, atom) in the order the runtime would append them
    coord = EpochCoordinator(app, ex, on_finalized=lambda r: handed.append((r.epoch, list(r.events))))
    coord.next_due = float("inf")
    results: list[EpochResult] = []
    prior = None
    for e, (now, reqs) in enumerate(workload(seed)):
        res = coord.run_epoch(e, [(0, r) for r in reqs], now, prior=prior, defer=defer)
        results.append(res)
        if res.finalize is None:
            handed.append((e, list(res.events)))
        prior = res if res.finalize is not None else None
    if prior is not None:
        coord.finalize(prior)
    state = {k: v for s in stores for k, v in s.data.items()}
    replies = [[(r.request_id, r.ok, r.value) for r in sorted(res.replies.values(), key=lambda r: r.position)]
               for res in results]
    return handed, [[t.id for t in res.timers] for res in results], replies, state, results


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("exchange_cls", [LocalExchange, OneTask, OneTaskFallback])
def test_deferred_finalize_keeps_timers_events_and_state(seed: int, exchange_cls: type) -> None:
    base = run(seed, False)
    got = run(seed, True, exchange_cls)
    atoms, fired, replies, state, results = got
    assert all(r.stats.get("finalize_deferred") for r in results), "every epoch deferred its finalize"
    assert [e for e, _ in atoms] == list(range(len(results))), "each atom handed over once, in epoch order"
    assert atoms == base[0], "the same atoms (events in the same order) as without deferral"
    assert fired == base[1], "the same timers fire in the same epochs"
    assert replies == base[2]
    assert state == base[3]
    assert any(fired), "the workload fires timers"
    assert any(ev for _, ev in atoms), "the workload emits events"


def test_a_timer_registered_in_a_deferred_epoch_fires_in_the_next_one() -> None:
    """The next epoch must collect although the exact next due time of the deferred one is not known yet."""
    parts = 2
    ex = LocalExchange([PartitionUnit(p, parts, app, MemoryStore()) for p in range(parts)])
    atoms: list[tuple[int, list]] = []
    coord = EpochCoordinator(app, ex, on_finalized=lambda r: atoms.append((r.epoch, r.events)))
    coord.next_due = float("inf")
    r0 = coord.run_epoch(0, [(0, Request("x", "acct", "a", "arm", serde.encode([0.5, "b"]), 10.0))], 10.0, defer=True)
    assert r0.finalize is not None and coord.next_due == 10.5, "the registered due time bounds the next due"
    r1 = coord.run_epoch(1, [], 11.0, prior=r0, defer=True)
    assert [t.function for t in r1.timers] == ["ping"], "fired from the finalized state of epoch 0"
    assert atoms == [(0, [(1, "armed", serde.encode(["a", 1]))])]
    coord.finalize(r1)
    assert atoms[-1][0] == 1 and [s for _, s, _ in atoms[-1][1]] == ["pings"]


@pytest.mark.parametrize("exchange_cls", [LocalExchange, OneTask])
@pytest.mark.parametrize("has_work", [True, False])
def test_a_deferred_epoch_is_finalized_before_the_next_epochs_first_reply(exchange_cls: type, has_work: bool) -> None:
    """A runtime records the deferred epoch in ``on_finalized`` and cuts the replies stream there (the Spark
    driver's ``mark_epoch``): no reply of the next epoch may come before it, not even a request refused by
    validation (those used to go out before the round carrying the finalize, splitting the next epoch's replies
    over two micro-batches of ``charon_replies``)."""
    parts = 2
    ex = exchange_cls([PartitionUnit(p, parts, app, MemoryStore()) for p in range(parts)])
    seen: list[tuple[str, int]] = []
    coord = EpochCoordinator(app, ex, on_replies=lambda rs: seen.extend(("reply", r.epoch) for r in rs),
                             on_finalized=lambda r: seen.append(("finalized", r.epoch)))
    coord.next_due = float("inf")  # no collect round: the finalize rides in the next epoch's first round
    r0 = coord.run_epoch(0, [(0, Request("x", "acct", "a", "move", serde.encode(["b"]), 1.0))], 1.0, defer=True)
    assert r0.finalize is not None
    reqs = [Request("bad", "acct", "a", "nope", serde.encode([]), 1.0)]
    if has_work:
        reqs.append(Request("y", "acct", "b", "ping", serde.encode(["c"]), 1.0))
    r1 = coord.run_epoch(1, [(0, r) for r in reqs], 1.0, prior=r0)
    assert r1.replies and all(r.epoch == 1 for r in r1.replies.values())
    assert seen.index(("finalized", 0)) < seen.index(("reply", 1)), seen
