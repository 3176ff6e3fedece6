"""The carried finalize (the next epoch runs the previous epoch's pending finalize in its first round) under
concurrency: readers in other threads, pause/resume and rescale at the boundary while a finalize is carried.

Invariants: money is conserved in every committed snapshot a reader sees (never half an epoch's writes); a
reader never fails; every replied transfer's write is visible after its reply; nothing replied is lost."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from charon import Application, Context, InProcessRuntime, Operator, serde
from charon.apps import ycsb

N = 30
BALANCE = 1_000


async def _load(rt: InProcessRuntime, clients: int, per_client: int, seed: int) -> list:
    async def client(c: int) -> list:
        rng = random.Random(seed * 1000 + c)
        out = []
        for _ in range(per_client):
            a, b = rng.randrange(N), rng.randrange(N)
            out.append(await rt.submit("account", ycsb.key(a), "transfer", [ycsb.key(b), rng.choice([1, 7])]))
        return out

    return [r for rs in await asyncio.gather(*(client(c) for c in range(clients))) for r in rs]


def _reader(rt: InProcessRuntime, stop: threading.Event, seen: list, errors: list) -> None:
    while not stop.is_set():
        try:
            seen.append(sum(rt.entities("account").values()))
        except Exception as exc:  # noqa: BLE001 - recorded and asserted on
            errors.append(repr(exc))
        time.sleep(0.01)  # a reader holds the epochs back while it reads: leave them room to carry finalizes


async def _readers_run(seed: int) -> int:
    """One run of transfers with two reader threads; asserts every read saw a whole epoch; returns how many epochs
    carried their predecessor's finalize."""
    rt = InProcessRuntime(ycsb.app, partitions=3, warmup_txns=0)
    rt.load("account", ycsb.initial_state(N, BALANCE))
    stop = threading.Event()
    seen: list[int] = []
    errors: list[str] = []
    readers = [threading.Thread(target=_reader, args=(rt, stop, seen, errors)) for _ in range(2)]
    async with rt:
        for t in readers:
            t.start()
        try:
            replies = await _load(rt, clients=40, per_client=15, seed=seed)
        finally:
            stop.set()
            for t in readers:
                t.join()
    assert errors == [], errors[:3]
    assert seen and set(seen) == {N * BALANCE}, sorted(set(seen))[:5]
    assert all(r.ok for r in replies)
    assert sum(rt.entities("account").values()) == N * BALANCE
    return sum(1 for s in rt.epoch_stats if s.get("finalize_carried"))


async def test_readers_in_other_threads_see_whole_epochs_while_finalizes_are_carried() -> None:
    """Whether an epoch carries its predecessor's finalize depends on timing (a quiet machine may finish each
    finalize before the next epoch needs it): runs repeat, each with a fresh runtime and seed, until one did; every
    run must show whole epochs only."""
    carried_runs = []
    for seed in range(1, 6):
        carried_runs.append(await _readers_run(seed))
        if carried_runs[-1] > 0:
            break
    assert carried_runs[-1] > 0, f"no epoch carried a finalize in {len(carried_runs)} runs"


async def test_pause_resume_and_rescale_at_boundaries_lose_no_reply() -> None:
    rt = InProcessRuntime(ycsb.app, partitions=2, warmup_txns=0)
    rt.load("account", ycsb.initial_state(N, BALANCE))
    async with rt:
        load = asyncio.create_task(_load(rt, clients=30, per_client=20, seed=2))
        for parts in (3, 1, 4):
            await asyncio.sleep(0.02)
            rt.pause()
            snapshot = sum(rt.entities("account").values())  # at the boundary: every finalize ran
            assert snapshot == N * BALANCE
            rt.resume()
            await asyncio.sleep(0.02)
            await rt.rescale(parts)
        replies = await load
    assert len(replies) == 600 and all(r.ok for r in replies)
    # each transfer's effect is in the state: replay them serially from the initial state
    assert sum(rt.entities("account").values()) == N * BALANCE
    assert rt.partitions == 4


async def _deposits_read_at_once() -> tuple[list, int]:
    """One run: 30 clients each deposit into their own account and, at once after each reply, read the balance
    in a worker thread, beside transfer load. Returns the stale reads and the epochs that carried a finalize."""
    rt = InProcessRuntime(ycsb.app, partitions=3, warmup_txns=0)
    stale: list = []

    async def client(c: int) -> None:
        total = 0
        for i in range(25):
            rep = await rt.submit("account", f"d{c}", "deposit", [i + 1])
            assert rep.ok, rep
            total += i + 1
            got = await asyncio.to_thread(rt.read_state, "account", f"d{c}", 0)
            if got != total:
                stale.append((c, i, got, total))

    rt.load("account", ycsb.initial_state(N, BALANCE))
    async with rt:  # transfers keep the queue busy, so epochs carry their predecessor's finalize
        await asyncio.gather(_load(rt, clients=20, per_client=30, seed=3), *(client(c) for c in range(30)))
    return stale, sum(1 for s in rt.epoch_stats if s.get("finalize_carried"))


async def test_a_reply_read_at_once_in_another_thread_sees_its_write() -> None:
    """A balance read in another thread at once after the reply (which may run while the next epoch carries the
    finalize) sees at least the client's own deposits.

    Whether an epoch carries its predecessor's finalize depends on timing (the readers themselves finalize
    whatever is pending when they get there first): the run is repeated, each time with a fresh runtime, until
    some epoch did (a slow machine needed a second run); every run must be free of stale reads."""
    carried_runs = []
    for _ in range(5):
        stale, carried = await _deposits_read_at_once()
        assert stale == []
        carried_runs.append(carried)
        if carried > 0:
            break
    assert carried_runs[-1] > 0, f"no epoch carried a finalize in {len(carried_runs)} runs"


@pytest.mark.parametrize("mode", ["strict", "compatible"])
async def test_code_update_and_inspect_at_boundaries_under_load(mode) -> None:
    """Code updates (the same code as a new version) and inspects between epochs that carry finalizes: every
    reply is ok, inspect sees whole epochs, money is conserved."""
    rt = InProcessRuntime(ycsb.app, partitions=3, warmup_txns=0)
    rt.load("account", ycsb.initial_state(N, BALANCE))
    async with rt:
        load = asyncio.create_task(_load(rt, clients=30, per_client=20, seed=4))
        for v in range(2, 5):
            await asyncio.sleep(0.01)
            _, rows = await rt.inspect("account")
            assert len(rows) == N
            assert sum(map(serde.decode, rows.values())) == N * BALANCE
            out = await rt.update_code("charon.apps.ycsb:app", f"v{v}", mode=mode)
            assert out, out
        replies = await load
    assert len(replies) == 600 and all(r.ok for r in replies)
    assert sum(rt.entities("account").values()) == N * BALANCE
    assert rt.version_at(rt.epoch - 1) == "v4"


tm = Operator("tm")


@tm.function
async def arm(ctx: Context, n: int) -> str:
    """Register a timer adding ``n`` to the counter entity ``ctx.key`` at once (due now)."""
    return ctx.send_after(0.0, tm, ctx.key, "fire", n)


@tm.function
async def fire(ctx: Context, n: int) -> int:
    """The timer: add ``n``."""
    ctx.put(ctx.get(default=0) + n)
    return 0


timer_app = Application("carried_timers", [tm])


async def test_timers_registered_while_finalizes_are_carried_fire_exactly_once() -> None:
    """Timers due at once, registered by epochs whose finalize is carried (their index entries reach the store
    only in the next epoch's first round): each fires exactly once."""
    rt = InProcessRuntime(timer_app, partitions=3, warmup_txns=0)
    want: dict[str, int] = {}

    async def client(c: int) -> None:
        for i in range(20):
            rep = await rt.submit("tm", f"t{c % 7}", "arm", [i + 1])
            assert rep.ok, rep
            want[f"t{c % 7}"] = want.get(f"t{c % 7}", 0) + i + 1

    async with rt:
        await asyncio.gather(*(client(c) for c in range(25)))
        for _ in range(400):  # the timers are due: they fire within a few epochs
            if not rt.pending_timers():
                break
            await asyncio.sleep(0.01)
    assert sum(1 for s in rt.epoch_stats if s.get("finalize_carried")) > 0
    assert rt.pending_timers() == []
    assert rt.entities("tm") == want


async def test_multi_key_reads_in_other_threads_are_one_cut() -> None:
    """Readers in other threads calling ``entities()`` back to back (no pause) while epochs of transfers run:
    every sum they see is the conserved total, never part of an epoch's writes."""
    rt = InProcessRuntime(ycsb.app, partitions=3, warmup_txns=0)
    rt.load("account", ycsb.initial_state(N, BALANCE))
    stop = threading.Event()
    seen: list[int] = []
    errors: list[str] = []

    def hammer() -> None:
        while not stop.is_set():
            try:
                seen.append(sum(rt.entities("account").values()))
            except Exception as exc:  # noqa: BLE001 - recorded and asserted on
                errors.append(repr(exc))

    readers = [threading.Thread(target=hammer) for _ in range(3)]
    async with rt:
        for t in readers:
            t.start()
        try:
            replies = await _load(rt, clients=50, per_client=20, seed=3)
        finally:
            stop.set()
            for t in readers:
                t.join()
    assert errors == [], errors[:3]
    assert len(seen) > 10 and set(seen) == {N * BALANCE}, sorted(set(seen))[:5]
    assert all(r.ok for r in replies)
