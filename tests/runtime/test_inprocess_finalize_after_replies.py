"""The in-process service loop runs an epoch's finalize after the replies' waiters (off their latency): whoever
reads committed state first (a waiter at once, another thread, inspect) still sees every replied transaction's
writes; timers, output streams and epoch records are as with the finalize inside the epoch."""

from __future__ import annotations

import asyncio
import threading

from charon import Application, Context, Operator, Request, serde
from charon.runtime.node.inprocess import InProcessRuntime

acct = Operator("acct")


@acct.function
async def add(ctx: Context, n: int) -> int:
    """Add ``n``, emit the new value."""
    v = ctx.get(default=0) + n
    ctx.put(v)
    ctx.emit("adds", [ctx.key, v])
    return v


@acct.function
async def arm(ctx: Context, seconds: float) -> str:
    """Register a timer adding 100 to this entity after ``seconds``."""
    return ctx.send_after(seconds, acct, ctx.key, add, 100)


_holder: dict = {}


@acct.function
async def peek(ctx: Context) -> int:
    """Misuse on purpose: read through the runtime from inside a transaction."""
    return _holder["rt"].read_state("acct", ctx.key, 0)


app = Application("finalize_after_replies", [acct])


async def test_a_waiter_reads_its_write_at_once_and_epochs_record_their_finalize() -> None:
    rt = InProcessRuntime(app, partitions=4, warmup_txns=0)
    async with rt:
        for i in range(1, 30):
            rep = await rt.submit("acct", f"k{i % 5}", "add", [i])
            assert rep.ok, rep
            # no await in between: the finalize of this reply's epoch may not have run on the loop yet
            if i % 2:
                assert rt.read_state("acct", f"k{i % 5}") == serde.decode(rep.value)
            else:  # or the stream first: the epoch's atom is there
                evs = rt.streams.read("adds", 0, 1000).events
                assert serde.decode(evs[-1].value) == [f"k{i % 5}", serde.decode(rep.value)]
        deferred = [s for s in rt.epoch_stats if s.get("finalize_deferred")]
        assert deferred, "the service loop defers the finalize past the replies"
        assert all("finalize_ms" in s for s in deferred[:-1]), "each epoch's record includes its finalize"
    total = sum(range(1, 30))
    assert sum(rt.entities("acct").values()) == total
    events = [serde.decode(e.value) for e in rt.streams.read("adds", 0, 1000).events]
    last: dict[str, int] = {}
    for key, v in events:
        last[key] = v  # in commit order
    assert len(events) == 29 and last == rt.entities("acct")


async def test_inspect_right_after_a_reply_sees_the_write() -> None:
    rt = InProcessRuntime(app, partitions=2, warmup_txns=0)
    async with rt:
        rep = await rt.submit("acct", "x", "add", [7])
        epoch, rows = await rt.inspect("acct", ["x"])
        assert rep.ok and [serde.decode(v) for v in rows.values()] == [7]
        assert epoch == rt.epoch - 1


def test_a_reader_in_another_thread_runs_the_pending_finalize() -> None:
    rt = InProcessRuntime(app, partitions=3, warmup_txns=0)
    rt._run_logged([Request("r1", "acct", "y", "add", serde.encode([5]))], 1.0, defer=True)
    assert rt._unfinalized is not None
    seen: list = []
    t = threading.Thread(target=lambda: seen.append(rt.read_state("acct", "y")))
    t.start()
    t.join()
    assert seen == [5] and rt._unfinalized is None
    assert [serde.decode(e.value) for e in rt.streams.read("adds", 0, 10).events] == [["y", 5]]
    # the next epoch finalizes nothing twice
    rt._run_logged([Request("r2", "acct", "y", "add", serde.encode([1]))], 2.0, defer=True)
    assert rt.read_state("acct", "y") == 6


async def test_a_timer_registered_in_a_deferred_epoch_fires() -> None:
    rt = InProcessRuntime(app, partitions=2, warmup_txns=0)
    async with rt:
        rep = await rt.submit("acct", "t", "arm", [0.02])
        assert rep.ok, rep
        for _ in range(500):
            if rt.read_state("acct", "t") == 100:
                break
            await asyncio.sleep(0.005)
        assert rt.read_state("acct", "t") == 100
        assert rt.pending_timers() == []


def _carry_batches() -> list[list[Request]]:
    out = []
    for e in range(8):
        b = [Request(f"r{e}-{i}", "acct", f"k{(e * 3 + i) % 4}", "add", serde.encode([i + 1])) for i in range(5)]
        b.append(Request(f"t{e}", "acct", f"k{e % 4}", "arm", serde.encode([0.0])))  # fires in the next epoch
        out.append(b)
    return out


def test_a_carried_finalize_gives_the_state_events_and_timers_of_a_finalize_of_its_own() -> None:
    """The service loop lets the next epoch carry a pending finalize in its first round (a collect round
    when a timer is due): state, replies, atoms and timers equal epochs finalized in a round of their own."""
    alone = InProcessRuntime(app, partitions=3, warmup_txns=0)
    carried = InProcessRuntime(app, partitions=3, warmup_txns=0)
    replies: dict[str, list] = {"alone": [], "carried": []}
    for e, batch in enumerate(_carry_batches()):
        ra = alone.run_epoch(batch, now=float(e + 1))
        rc = carried._run_logged(batch, float(e + 1), defer=True, carry=True)
        assert rc.finalize is not None and carried._unfinalized is rc
        for side, r in (("alone", ra), ("carried", rc)):
            replies[side].append(sorted((x.request_id, x.ok, x.value) for x in r.replies.values()))
    assert replies["alone"] == replies["carried"]
    assert any(len(r) > 6 for r in replies["alone"]), "timers fired as transactions of later epochs"
    stats = carried.epoch_stats
    assert all(s.get("finalize_carried") == 1 for s in stats[:-1]) and "finalize_carried" not in stats[-1]
    assert carried.snapshot() == alone.snapshot()  # runs the last pending finalize
    assert carried.pending_timers() == alone.pending_timers()

    def atoms(rt: InProcessRuntime) -> list:
        return [(ev.offset, ev.epoch, serde.decode(ev.value)) for ev in rt.streams.read("adds", 0, 1000).events]

    assert atoms(carried) == atoms(alone) and len(atoms(alone)) > 40


async def test_the_service_loop_carries_finalizes_under_a_backlog() -> None:
    """Requests arriving while an epoch runs: the next epoch carries the pending finalize; every committed
    add is in the state and the stream once, in commit order."""
    rt = InProcessRuntime(app, partitions=4, warmup_txns=0)
    async with rt:
        waves = []
        for w in range(20):
            waves.append([asyncio.ensure_future(rt.submit("acct", f"k{(w + i) % 7}", "add", [1]))
                          for i in range(10)])
            await asyncio.sleep(0)
        reps = [await f for wave in waves for f in wave]
    assert all(r.ok for r in reps)
    assert any(s.get("finalize_carried") for s in rt.epoch_stats), "some epoch's finalize was carried"
    assert sum(rt.entities("acct").values()) == 200
    events = [serde.decode(e.value) for e in rt.streams.read("adds", 0, 1000).events]
    assert len(events) == 200
    last: dict[str, int] = {}
    for key, v in events:
        assert v == last.get(key, 0) + 1
        last[key] = v
    assert last == rt.entities("acct")


def test_carried_finalizes_equal_finalizes_alone_on_generated_workloads() -> None:
    """Generated workloads (conflicts, the fallback, aborts, deferred transactions, 1/2/4 partitions): epochs
    carrying the previous finalize give the same replies, in the same order, and the same state."""
    import random

    from charon.core import partition
    from charon.testing import workloads as wl

    saved = partition.KEEP_LIVE_COROUTINES
    try:
        for seed in range(60):
            w = wl.random_workload(random.Random(seed), epochs=(2, 5), txns=(1, 10))
            partition.KEEP_LIVE_COROUTINES = w.live
            with wl.engine_abort_rule():
                alone = InProcessRuntime(wl.app, partitions=w.partitions, warmup_txns=0)
                carried = InProcessRuntime(wl.app, partitions=w.partitions, warmup_txns=0)
                wl.load(alone, w)
                wl.load(carried, w)
                e = 0
                while e < len(w.epochs) or alone.coordinator.deferred:
                    reqs = w.requests(e) if e < len(w.epochs) else []
                    ra = alone.run_epoch(reqs, now=float(e + 1))
                    rc = carried._run_logged(reqs, float(e + 1), defer=True, carry=True)
                    assert [(ra.requests[t].request_id, ra.replies[t]) for t in ra.order] == \
                        [(rc.requests[t].request_id, rc.replies[t]) for t in rc.order], (seed, e)
                    assert ra.deferred == rc.deferred
                    e += 1
                    assert e < 40, "deferred transactions never finish"
                assert carried.snapshot() == alone.snapshot(), seed
                assert any(s.get("finalize_carried") for s in carried.epoch_stats)
    finally:
        partition.KEEP_LIVE_COROUTINES = saved


def test_a_function_reading_the_runtime_inside_a_carrying_epoch_does_not_hang() -> None:
    """User code holding the runtime reads state while its epoch carries the previous finalize (whose lock
    that thread holds): the read returns instead of waiting for itself."""
    rt = _holder["rt"] = InProcessRuntime(app, partitions=2, warmup_txns=0)
    rt._run_logged([Request("p1", "acct", "z", "add", serde.encode([3]))], 1.0, defer=True)
    out: list = []
    t = threading.Thread(target=lambda: out.append(
        rt._run_logged([Request("p2", "acct", "z", "peek", serde.encode([]))], 2.0, defer=True, carry=True)))
    t.start()
    t.join(10)
    assert not t.is_alive(), "the carrying epoch deadlocked on its own finalize lock"
    assert [r.ok for r in out[0].replies.values()] == [True]
    assert rt.read_state("acct", "z") == 3 and rt.epoch_stats[0].get("finalize_carried") == 1


def test_a_reader_finalizing_first_leaves_the_carrying_epoch_nothing_to_carry() -> None:
    """A reader in another thread holds the finalize lock and runs the pending finalize while the loop's next
    epoch waits to carry it: that epoch then carries nothing and the lock is free afterwards."""
    import time

    rt = InProcessRuntime(app, partitions=2, warmup_txns=0)
    rt._run_logged([Request("q1", "acct", "w", "add", serde.encode([4]))], 1.0, defer=True)
    out: list = []
    with rt._finish_lock:  # the reader got it first
        t = threading.Thread(target=lambda: out.append(
            rt._run_logged([Request("q2", "acct", "w", "add", serde.encode([1]))], 2.0, defer=True, carry=True)))
        t.start()
        time.sleep(0.1)  # the epoch now waits for the lock
        pending = rt._unfinalized
        assert pending is not None
        rt.coordinator.next_due = rt.coordinator.finalize(pending)  # what the reader's _finish does
        rt._unfinalized = None
    t.join(10)
    assert not t.is_alive() and out, "the carrying epoch never started"
    assert "finalize_carried" not in rt.epoch_stats[0]
    got: list = []
    r = threading.Thread(target=lambda: got.append(rt.read_state("acct", "w")))
    r.start()
    r.join(10)
    assert got == [5], "the finalize lock was left held"
