"""The in-process service loop runs an epoch's finalize after the replies' waiters (off their latency): whoever
reads committed state first (a waiter at once, another thread, inspect) still sees every replied transaction's
writes; timers, output streams and epoch records are as with the finalize inside the epoch."""

from __future__ import annotations

import asyncio
import threading

from charon import Application, Context, Operator, Request, serde
from charon.runtime.inprocess import InProcessRuntime

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
