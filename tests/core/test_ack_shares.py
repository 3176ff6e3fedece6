"""Ack shares: exact completion of deep and wide call graphs."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.core import shares

tree = Operator("tree")


@tree.function
async def fan(ctx: Context, depth: int, width: int) -> int:
    ctx.put(ctx.get(default=0) + 1)
    if depth > 0:
        for i in range(width):
            ctx.send(tree, f"{ctx.key}.{i}", fan, depth - 1, width)
    return depth


@tree.function
async def chain(ctx: Context, depth: int) -> int:
    ctx.put(depth)
    if depth == 0:
        return 0
    return 1 + await ctx.call(tree, f"c{depth - 1}", chain, depth - 1)


@tree.function
async def mixed(ctx: Context, depth: int) -> int:
    """Sync calls whose callees send asynchronously: shares travel back with replies."""
    ctx.put(ctx.get(default=0) + 1)
    if depth == 0:
        return 1
    ctx.send(tree, f"{ctx.key}/a", mixed, depth - 1)
    got = await ctx.call(tree, f"{ctx.key}/s", mixed, depth - 1)
    ctx.send(tree, f"{ctx.key}/b", mixed, depth - 1)
    return got + 1


app = Application("trees", [tree])


def test_three_way_fan_out_ten_levels_completes_exactly():
    rt = InProcessRuntime(app, partitions=4)
    result = rt.run_epoch([Request("t", "tree", "root", "fan", serde.encode([9, 3]))])
    assert result.replies[1].ok
    nodes = rt.entities("tree")
    assert len(nodes) == sum(3**i for i in range(10))  # 10 levels: every invocation ran exactly once
    assert set(nodes.values()) == {1}


def test_deep_sync_chain_and_mixed_graph():
    rt = InProcessRuntime(app, partitions=3)
    r = rt.run_epoch([
        Request("c", "tree", "c60", "chain", serde.encode([60])),
        Request("m", "tree", "m", "mixed", serde.encode([7])),
    ])
    assert serde.decode(r.replies[1].value) == 60
    assert serde.decode(r.replies[2].value) == 8
    assert len([k for k in rt.entities("tree") if k.startswith("m")]) == 3**8 // 2 + 1 or True
    # Count: mixed(d) touches 1 + 3·mixed(d-1) entities.
    count = 1
    for _ in range(7):
        count = 1 + 3 * count
    assert len([k for k in rt.entities("tree") if k.startswith("m")]) == count


def test_shares_are_exact_fractions():
    """Shares that are not powers of two (3-way, 5-way splits) still sum to exactly one."""
    parts = [Fraction(1, 3)] * 2 + [Fraction(1, 3) / 5] * 5
    assert sum(parts) == 1
    rt = InProcessRuntime(app, partitions=2)
    r = rt.run_epoch([Request("w", "tree", "w", "fan", serde.encode([2, 5]))])
    assert r.replies[1].ok and len(rt.entities("tree")) == 1 + 5 + 25


@tree.function
async def gather_tree(ctx: Context, depth: int, width: int) -> int:
    """Synchronous fan-out with ctx.gather: children run concurrently; returns the subtree size."""
    ctx.put(depth)
    if depth == 0:
        return 1
    sizes = await ctx.gather(*(ctx.call(tree, f"{ctx.key}.{i}", gather_tree, depth - 1, width) for i in range(width)))
    return 1 + sum(sizes)


def test_gathered_calls_complete_in_depth_rounds_not_size_rounds():
    rt = InProcessRuntime(app, partitions=4)
    r = rt.run_epoch([Request("g", "tree", "g", "gather_tree", serde.encode([5, 3]))])
    assert serde.decode(r.replies[1].value) == sum(3**i for i in range(6))
    # each level costs a call round and a reply round: far fewer than one round trip per call
    assert r.stats["dry_rounds"] <= 2 * 5 + 2


# -- the share arithmetic itself (charon.core.shares): exact for any fan-out, never a zero part ----------
def _frac(s: shares.Share) -> Fraction:
    return Fraction(s[0], 1 << s[1])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=70), min_size=1, max_size=30), st.randoms())
def test_split_and_add_are_exact_and_complete_only_at_one(fanouts, rnd):
    """Random split trees: parts are non-zero, parts + rest equal the share, the sum is one only at the end."""
    live = [shares.ONE]
    done: list[shares.Share] = []
    for k in fanouts:  # one invocation splits its share among k callees and keeps the rest (as in _suspend)
        s = live.pop(rnd.randrange(len(live)))
        part, rest = shares.split(s, k)
        assert part[0] > 0 and _frac(part) * k + _frac(rest) == _frac(s)
        assert (rest == shares.ZERO) == (k & (k - 1) == 0)
        live += [part] * k
        if rest[0]:
            done.append(rest)
    total = shares.ZERO
    order = live + done
    rnd.shuffle(order)
    for i, s in enumerate(order):
        total = shares.add(total, s)
        assert shares.is_one(total) == (i == len(order) - 1)  # never early: every part is > 0
    assert _frac(total) == 1
