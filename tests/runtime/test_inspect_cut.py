"""A page of the live state (``Engine.inspect`` at the latest epoch: the bulk routes, ``GET /admin/state``, the
promise and workflow lists) is read as of one epoch boundary, also while the engine thread commits epochs that
insert keys into the sorted stores the page iterates.

Before, the page was read on the event loop without the epoch lock: its rows could hold writes of the epoch
being committed while the page named the one before, and a commit splitting one of the sorted store's sublists
mid-iteration could make a page skip entities (a bulk cancel then reported a pass over every promise and left
one pending). Each page is checked against the epochs the replies name: it holds exactly the entities of its
key range committed up to its epoch."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest

from charon import Application, Context, InProcessRuntime, Operator

things = Operator("things")


@things.function(public=True)
async def add(ctx: Context, n: int) -> int:
    ctx.put(n)
    return n


app = Application("inspect_cut", [things])
OLD = 2000  # preloaded entities (committed before any page)
NEW = 3000  # written while the pages are read, between the old keys, in a shuffled order
LIMIT = 400


def _key(i: int) -> str:
    return f"k{i:06d}"


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "volatile"])
async def test_each_page_is_one_boundary_while_epochs_insert_keys(tmp_path: Path, durable: bool) -> None:
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the engine thread and the loop switch as often as they can
    try:
        data = str(tmp_path / "data") if durable else None  # durable: each epoch commits in the engine thread
        async with InProcessRuntime(app, partitions=2, data_dir=data, fsync=False) as rt:
            rt.load("things", {_key(2 * i): i for i in range(OLD)})
            engine = rt.engine()
            order = list(range(NEW))
            random.Random(7).shuffle(order)
            committed: dict[str, int] = {}  # new key -> the epoch its reply names

            async def write(i: int) -> None:
                rep = await rt.submit("things", _key(2 * i + 1), "add", [i])
                assert rep.ok, rep
                committed[_key(2 * i + 1)] = rep.epoch

            async def writer() -> None:
                for n in range(0, NEW, 100):
                    await asyncio.gather(*(write(i) for i in order[n:n + 100]))

            task = asyncio.create_task(writer())
            pages: list[tuple[int, str | None, list[str], bool]] = []  # (epoch, after, keys, more)
            after: str | None = None
            while not task.done() or after is not None:
                page = await engine.inspect("things", None, None, LIMIT + 1, after=after)
                got = sorted({k.split(b"\0", 2)[1].decode() for k in page.rows})
                more = len(got) > LIMIT
                got = got[:LIMIT]
                pages.append((page.epoch, after, got, more))
                after = got[-1] if more else None
                await asyncio.sleep(0)  # the writer's requests go on meanwhile
            await task
    finally:
        sys.setswitchinterval(old_interval)
    assert len(committed) == NEW and len({p[0] for p in pages}) > 3, "the pages spanned several epochs"
    old = {_key(2 * i) for i in range(OLD)}
    for n, (epoch, after, keys, more) in enumerate(pages):
        at_cut = old | {k for k, e in committed.items() if e <= epoch}
        lo = after or ""
        hi = keys[-1] if more else "\U0010ffff"
        expect = sorted(k for k in at_cut if lo < k <= hi)
        assert keys == expect, (
            f"page {n} (epoch {epoch}, after {after!r}): {len(set(expect) - set(keys))} entities of its cut missing, "
            f"{sorted(set(keys) - set(expect))[:5]} not committed by epoch {epoch}")
