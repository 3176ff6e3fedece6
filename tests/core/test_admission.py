"""Admission control at sequencing (issue 34 item 3): concurrency never above N per epoch, rates within 5% over a
window, priorities first, a bounded queue answered RateLimited, run-time changes through the log, and the same
decisions when the epochs are replayed from a record."""

from __future__ import annotations

import random

import pytest

from charon import Application, Context, InProcessRuntime, Limit, Operator, Request, serde
from charon.core.admission import LIMITS_OPERATOR, Admission

acct = Operator("acct")


@acct.function(limit=Limit(concurrency=3, per="key", queue=100_000))
async def hit(ctx: Context, n: int) -> int:
    ctx.put(ctx.get(default=0) + n)
    return int(ctx.get())


@acct.function(limit=Limit(rate=20.0, burst=5, queue=100_000))
async def paced(ctx: Context, tenant: str, prio: int) -> int:
    return prio


@acct.function(limit=Limit(concurrency=2, per="arg:0", priority="arg:1", queue=3))
async def ranked(ctx: Context, tenant: str, prio: int) -> int:
    return prio


@acct.function
async def free(ctx: Context) -> int:
    return 1


def app() -> Application:
    return Application("adm", [acct])


def req(i: int, fn: str, key: str, *args: object) -> Request:
    return Request(f"r{i}", "acct", key, fn, serde.encode(list(args)))


def workload(seed: int, epochs: int) -> list[tuple[float, list[Request]]]:
    """Seeded: per epoch, a burst of `hit` on 4 keys, `paced` at ~3x its rate, and unlimited calls."""
    rng = random.Random(seed)
    out, t, i = [], 1000.0, 0
    for _ in range(epochs):
        t += rng.uniform(0.01, 0.2)
        batch = []
        for _ in range(rng.randint(0, 12)):
            i += 1
            kind = rng.random()
            if kind < 0.5:
                batch.append(req(i, "hit", f"k{rng.randrange(4)}", 1))
            elif kind < 0.85:
                batch.append(req(i, "paced", "p", "t", 0))
            else:
                batch.append(req(i, "free", f"f{i}"))
        out.append((t, batch))
    return out


def run(rt: InProcessRuntime, epochs: list[tuple[float, list[Request]]]) -> list:
    return [rt.run_epoch(batch, now=t) for t, batch in epochs]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_concurrency_and_rate_hold_on_a_seeded_workload(seed: int) -> None:
    rt = InProcessRuntime(app(), partitions=2)
    epochs = workload(seed, 600)
    results = run(rt, epochs)
    tail = []
    while rt.coordinator.deferred:  # drain what waits, with time moving on
        t = epochs[-1][0] + 0.1 * (len(tail) + 1)
        tail.append((t, []))
        results.append(rt.run_epoch([], now=t))
    paced_at: list[float] = []
    for res in results:
        per_key: dict[str, int] = {}
        for tid, rep in res.replies.items():
            r = res.requests[tid]
            assert rep.ok, rep
            if r.function == "hit":
                per_key[r.key] = per_key.get(r.key, 0) + 1
            if r.function == "paced":
                paced_at.append(res.time)
        assert max(per_key.values(), default=0) <= 3
    sent = sum(1 for _, b in epochs for r in b if r.function == "paced")
    assert len(paced_at) == sent  # every one ran in the end, none refused
    # the rate over a window while requests wait (saturated): within 5% of 20/s (burst 5 on top at most)
    t0, t1 = paced_at[0], paced_at[-1]
    window = [t for t in paced_at if t0 + 5 <= t <= t1 - 5]
    rate = len(window) / (t1 - t0 - 10)
    assert abs(rate - 20.0) <= 0.05 * 20.0, rate
    assert len(paced_at) <= 5 + 20.0 * (t1 - t0) + 1  # never above the bucket's bound


def test_priorities_first_then_log_order_and_a_bounded_queue() -> None:
    rt = InProcessRuntime(app(), partitions=2)
    batch = [req(i, "ranked", f"x{i}", "t1", p) for i, p in enumerate([0, 5, 1, 5, 0, 9, 0])]
    first = rt.run_epoch(batch, now=10.0)
    ran = sorted((first.requests[t].request_id for t, r in first.replies.items() if r.ok))
    assert ran == ["r1", "r5"]  # priorities 9 and the first 5 (log order breaks the tie)
    refused = {first.requests[t].request_id: r for t, r in first.replies.items() if not r.ok}
    assert set(refused) == {"r4", "r6"}  # queue 3: r3 (5), r2 (1), r0 (0) wait; the later 0s are refused
    assert all(r.error_type == "RateLimited" for r in refused.values())
    assert serde.decode(refused["r4"].value)["retry_after"] >= 1.0
    second = rt.run_epoch([], now=10.1)
    assert sorted(second.requests[t].request_id for t in second.replies) == ["r2", "r3"]
    third = rt.run_epoch([], now=10.2)
    assert [third.requests[t].request_id for t in third.replies] == ["r0"]
    assert not rt.coordinator.deferred


def test_a_limit_changed_through_the_log_applies_at_its_epoch_and_shows_the_waiting() -> None:
    rt = InProcessRuntime(app(), partitions=2)
    change = Request("c1", LIMITS_OPERATOR, "acct/free", "set", serde.encode([{"concurrency": 1}]))
    res = rt.run_epoch([change] + [req(i, "free", "k") for i in range(4)], now=5.0)
    done = {res.requests[t].request_id: r for t, r in res.replies.items()}
    assert done["c1"].ok and serde.decode(done["c1"].value)["limits"]["acct/free"]["source"] == "admin"
    assert sum(1 for rid, r in done.items() if rid != "c1") == 1  # one free call now, three wait
    show = rt.run_epoch([Request("s1", LIMITS_OPERATOR, "", "show", serde.encode([]))], now=5.1)
    doc = serde.decode(next(iter(show.replies.values())).value)
    assert doc["held"] == 3 and doc["waiting"]["acct/free"] == {"": 3}  # as the epoch starts (one then runs)
    assert len(rt.coordinator.deferred) == 2
    bad = rt.run_epoch([Request("c2", LIMITS_OPERATOR, "acct/free", "set", serde.encode([{"rate": -1}]))], now=5.2)
    assert next(iter(bad.replies.values())).error_type == "BadArguments"
    rt.run_epoch([Request("c3", LIMITS_OPERATOR, "acct/free", "clear", serde.encode([]))], now=5.3)
    assert not rt.coordinator.deferred  # cleared: the code declares none, the last one ran


def test_replay_from_a_record_takes_the_same_decisions() -> None:
    epochs = workload(7, 200)
    straight = InProcessRuntime(app(), partitions=2)
    want = [(r.epoch, sorted((t, rep.ok, rep.error_type) for t, rep in r.replies.items()))
            for r in run(straight, epochs)]
    first = InProcessRuntime(app(), partitions=2)
    run(first, epochs[:90])
    c = first.coordinator
    state = (list(c.sequencer.counters), list(c.deferred), c.sequencer.time, c.admission.snapshot())
    assert c.admission.held and state[3]
    again = InProcessRuntime(app(), partitions=2)
    again.load("acct", {})  # the state at the record (acct's values) copied over, as a restore does
    for src, dst in zip(first._stores, again._stores, strict=True):
        dst.data.update(src.data)
    again.epoch = first.epoch
    c2 = again.coordinator
    c2.sequencer.counters, c2.deferred, c2.sequencer.time = state[0], state[1], state[2]
    c2.admission.restore(state[3])
    got = [(r.epoch, sorted((t, rep.ok, rep.error_type) for t, rep in r.replies.items()))
           for r in run(again, epochs[90:])]
    assert got == want[90:]


def test_limit_declarations_are_checked() -> None:
    for bad in ({}, {"concurrency": 0}, {"rate": 0.0}, {"burst": 2}, {"rate": 1.0, "per": "nope"},
                {"concurrency": 1, "priority": "x"}):
        with pytest.raises(ValueError):
            Limit(**bad)  # type: ignore[arg-type]
    a = app()
    with pytest.raises(ValueError):
        a.limit("acct/", Limit(concurrency=1))
    a.limit("acct", Limit(rate=100.0))
    assert set(a.limits) == {"acct", "acct/hit", "acct/paced", "acct/ranked"}
    adm = Admission()
    adm.restore(b"")
    assert adm.snapshot() == b""
