"""User-visible limits do not depend on placement (issue 8, defect 3; ``repros/r4_rounds_limit.py``): the
same call graph gets the same outcome on 1, 2 and 4 partitions, at and just over each limit."""

from __future__ import annotations

import pytest

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.core.context import MAX_DEPTH
from charon.testing import check_epoch

op = Operator("c")


@op.function
async def chain(ctx: Context, n: int) -> int:
    """A synchronous call chain of depth ``n`` (each hop another key, so hops cross partitions)."""
    if n == 0:
        return 0
    return 1 + await ctx.call(op, f"k{n - 1}", chain, n - 1)


@op.function
async def counted_chain(ctx: Context, n: int, tag: str) -> int:
    """Like ``chain`` but reads and increments each entity and returns the sum of what it read."""
    v = ctx.get(default=0)
    ctx.put(v + 1)
    if n == 0:
        return v
    return v + await ctx.call(op, f"k{n - 1}", counted_chain, n - 1, tag)


@op.function
async def spread(ctx: Context, n: int) -> int:
    """Exactly ``n`` invocations in all: half the rest by a synchronous call, the other half by a send."""
    ctx.put(n)
    rest = n - 1
    a, b = rest // 2, rest - rest // 2
    if b:
        ctx.send(op, ctx.key + "b", spread, b)
    return n + (await ctx.call(op, ctx.key + "a", spread, a) if a else 0)


app = Application("limits", [op])
PLACEMENTS = (1, 2, 4)


def _outcome(partitions: int, requests: list[Request], **kw) -> list[tuple]:
    rt = InProcessRuntime(app, partitions=partitions, **kw)
    before = rt.snapshot()
    res = rt.run_epoch(requests)
    check_epoch(app, before, rt.snapshot(), res, **kw)
    assert not res.deferred
    return [(r.ok, serde.decode(r.value) if r.ok else r.error_type) for _, r in sorted(res.replies.items())]


def _req(rid: str, key: str, fn: str, *args) -> Request:
    return Request(rid, "c", key, fn, serde.encode(list(args)), ts=1.0)


@pytest.mark.parametrize("depth,ok", [(120, True), (MAX_DEPTH, True), (MAX_DEPTH + 1, False)])
def test_call_depth_limit_is_the_same_on_every_placement(depth: int, ok: bool) -> None:
    outcomes = {p: _outcome(p, [_req("q", f"k{depth}", "chain", depth)]) for p in PLACEMENTS}
    expected = [(True, depth)] if ok else [(False, "CallGraphLimitExceeded")]
    assert outcomes == {p: expected for p in PLACEMENTS}  # before the fix: 4 partitions aborted depth 120


@pytest.mark.parametrize("n,ok", [(40, True), (41, False)])
def test_invocation_limit_counts_all_partitions(n: int, ok: bool) -> None:
    outcomes = {p: _outcome(p, [_req("s", "root", "spread", n)], max_invocations=40) for p in PLACEMENTS}
    assert [o[0][0] for o in outcomes.values()] == [ok] * len(PLACEMENTS)
    assert all(o == outcomes[1] for o in outcomes.values()), outcomes
    if not ok:
        assert outcomes[1] == [(False, "CallGraphLimitExceeded")]


def test_locked_fallback_runs_a_deep_chain_on_every_placement() -> None:
    """The second chain conflicts and replays with other values, so it reruns in the locked fallback."""
    depth = 150
    for p in PLACEMENTS:
        rt = InProcessRuntime(app, partitions=p)
        before = rt.snapshot()
        res = rt.run_epoch([_req("a", f"k{depth}", "counted_chain", depth, "a"),
                            _req("b", f"k{depth}", "counted_chain", depth, "b")])
        check_epoch(app, before, rt.snapshot(), res)
        assert res.slow == [2], (p, res.lockfree, res.fast, res.slow)
        assert serde.decode(res.replies[2].value) == depth + 1
