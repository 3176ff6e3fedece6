"""Rescaling the in-process engine (charon.runtime.node.inprocess.InProcessRuntime.rescale): key groups move to
their partition under the new count at an epoch boundary; nothing is lost or duplicated, timers move with
their owner, the oracle agrees epoch by epoch, and a durable node keeps (and survives a crash in) the move."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from charon import InProcessRuntime, Request, serde
from charon.apps.holds import app
from charon.core import timers
from charon.core.routing import partition_of
from charon.runtime.node.inprocess_engine import InProcessEngine
from charon.testing import check_epoch

KEYS = [f"k{i}" for i in range(40)]
T0 = 1_000.0


def placed_right(rt: InProcessRuntime) -> bool:
    """Every item (timer index entries included) is in the partition its entity maps to."""
    return all(partition_of(*timers.placed_by(k, v), rt.partitions) == pid
               for pid, s in enumerate(rt.stores) for k, v in s.items())


def money(rt: InProcessRuntime) -> int:
    held = sum(h[1] for k in KEYS for n, h in rt.read_items("acct", k).items() if n.startswith("hold:"))
    return sum(rt.entities("acct").values()) + held


def batch(rng: random.Random, e: int, now: float) -> list[Request]:
    out = []
    for i in range(30):
        k = rng.choice(KEYS)
        if rng.random() < 0.8:
            args = [rng.choice(KEYS), rng.randint(1, 30)]
            out.append(Request(f"e{e}-{i}", "acct", k, "transfer", serde.encode(args), now))
        else:
            args = [f"g{e}-{i}", rng.randint(1, 20), rng.choice([0.5, 1.5, 3.0])]
            out.append(Request(f"e{e}-{i}", "acct", k, "hold", serde.encode(args), now))
    return out


def test_rescale_between_epochs_matches_the_oracle_2_4_3() -> None:
    rng = random.Random(5)
    rt = InProcessRuntime(app, partitions=2)
    rt.load("acct", {k: 100 for k in KEYS})
    total = money(rt)
    fired = 0
    for e in range(24):
        if e in (8, 16):
            pause = asyncio.run(rt.rescale(4 if e == 8 else 3))
            assert pause >= 0 and placed_right(rt) and money(rt) == total
        now = T0 + e
        before = rt.snapshot()
        r = rt.run_epoch(batch(rng, e, now), now=now)
        check_epoch(app, before, rt.snapshot(), r, partitions=rt.partitions)
        fired += len(r.timers)
        assert money(rt) == total
    assert rt.partitions == 3 and [p["to"] for p in rt.rescale_pauses] == [4, 3]
    while rt.pending_timers():
        now += 10
        fired += len(rt.run_epoch([], now=now).timers)
    assert fired > 20 and money(rt) == sum(rt.entities("acct").values()) == total


async def _load(rt: InProcessRuntime, seconds: float, seed: int, replies: dict) -> None:
    """One client: transfers and short holds until ``seconds`` have passed; every reply recorded."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    i = 0
    while loop.time() < end:
        i += 1
        rid = f"c{seed}-{i}"
        k = rng.choice(KEYS)
        if rng.random() < 0.85:
            rep = await rt.submit("acct", k, "transfer", [rng.choice(KEYS), rng.randint(1, 30)], request_id=rid)
        else:
            rep = await rt.submit("acct", k, "hold", [rid, rng.randint(1, 20), 0.2], request_id=rid)
        assert rid not in replies
        replies[rid] = rep


async def test_durable_rescale_under_load_2_4_3(tmp_path: Path) -> None:
    """Clients keep submitting while the node goes 2 -> 4 -> 3 partitions: every request is answered once,
    money is conserved, timers registered before a move fire after it, and the directory reopens at 3."""
    rt = InProcessRuntime(app, partitions=2, data_dir=str(tmp_path), checkpoint_s=0.05)
    rt.load("acct", {k: 100 for k in KEYS})
    replies: dict = {}
    async with rt:
        clients = [asyncio.create_task(_load(rt, 3.0, s, replies)) for s in range(6)]
        await asyncio.sleep(0.8)
        p4 = await rt.rescale(4)
        assert rt.partitions == 4
        await asyncio.sleep(0.8)
        p3 = await rt.rescale(3)
        assert rt.partitions == 3
        await asyncio.gather(*clients)
        while rt.pending_timers():
            await asyncio.sleep(0.05)
    assert p4 > 0 and p3 > 0
    assert len(replies) > 100
    tids = [r.tid for r in replies.values()]
    assert len(set(tids)) == len(tids), "one transaction per request"
    assert all(r.request_id == rid for rid, r in replies.items())
    assert sum(r.ok for r in replies.values()) > len(replies) // 2
    assert placed_right(rt) and money(rt) == sum(rt.entities("acct").values()) == 100 * len(KEYS)
    epochs = {p["epoch"] for p in rt.rescale_pauses}
    assert len(epochs) == 2 and min(epochs) > 0, "both moves happened under load, between epochs"
    snap = rt.snapshot()
    rt.close()
    again = InProcessRuntime(app, data_dir=str(tmp_path))  # no count given: the recorded layout is kept
    try:
        assert again.partitions == 3 and again.snapshot() == snap and again.rescale_pauses == []
        for rid, rep in list(replies.items())[:50]:
            assert again.get_reply(rid) == rep
    finally:
        again.close()
    two = InProcessRuntime(app, partitions=2, data_dir=str(tmp_path))  # another count: rescaled at open
    try:
        assert two.partitions == 2 and two.snapshot() == snap and placed_right(two)
    finally:
        two.close()


def test_charon_run_without_a_count_keeps_a_rescaled_layout(tmp_path: Path) -> None:
    """``charon run`` without --partitions (or CHARON_PARTITIONS) reopens a rescaled directory at its recorded
    count, not at the default 4 (a restart must not undo an operator's rescale)."""
    from charon.runtime.factory import EngineSpec, make_engine

    rt = InProcessRuntime(app, partitions=2, data_dir=str(tmp_path))
    rt.load("acct", {k: 100 for k in KEYS})
    asyncio.run(rt.rescale(3))
    rt.close()
    again = make_engine(EngineSpec("inprocess", "charon.apps.holds:app", data_dir=str(tmp_path)))
    assert isinstance(again, InProcessEngine)
    try:
        assert again.partitions == 3 and again.rt.rescale_pauses == [] and placed_right(again.rt)
    finally:
        again.close()
    fresh = make_engine(EngineSpec("inprocess", "charon.apps.holds:app", data_dir=str(tmp_path / "new")))
    try:
        assert fresh.partitions == 4
    finally:
        fresh.close()


_CRASH = """
import sys
from charon import Request, serde
from charon.apps.holds import app
from charon.runtime.node.inprocess import InProcessRuntime
rt = InProcessRuntime(app, partitions=int(sys.argv[2]), data_dir=sys.argv[1])
if rt.epoch == 0:
    rt.load("acct", {f"k{i}": 100 for i in range(40)})
    for e in range(3):
        rt.run_epoch([Request(f"e{e}-{i}", "acct", f"k{i}", "hold", serde.encode([f"x{e}", 5, 100.0]), 1000.0)
                      for i in range(40)], now=1000.0 + e)
print(rt.partitions, rt.state_digest())
rt.close()
"""


@pytest.mark.parametrize("crash", [True, False])
def test_a_crash_inside_the_move_keeps_the_old_layout(tmp_path: Path, crash: bool) -> None:
    """SIGKILL after the new layout's state is written but before it is committed: the directory reopens
    with the old layout and the same state (the half-written one is removed); without a crash it moves."""
    d = str(tmp_path / "node")
    p = subprocess.run([sys.executable, "-c", _CRASH, d, "2"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    parts, digest = p.stdout.split()
    env = {**os.environ, "CHARON_CRASH_AT": "node:relayout:2"} if crash else dict(os.environ)
    p = subprocess.run([sys.executable, "-c", _CRASH, d, "5"], capture_output=True, text=True, timeout=120, env=env)
    if crash:
        assert p.returncode == -signal.SIGKILL, p.stderr
        assert len([n for n in os.listdir(d) if n.startswith("state")]) == 2
    else:
        assert p.returncode == 0 and p.stdout.split() == ["5", digest], p.stderr
    rt = InProcessRuntime(app, partitions=5 if not crash else 2, data_dir=d)
    try:
        assert rt.partitions == (5 if not crash else 2) and rt.state_digest() == digest
        assert [n for n in os.listdir(d) if n.startswith("state")] != [] and placed_right(rt)
        assert len([n for n in os.listdir(d) if n.startswith("state")]) == 1
        assert len(rt.pending_timers()) == 120
    finally:
        rt.close()
