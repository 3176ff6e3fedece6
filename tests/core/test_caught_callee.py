"""A callee's exception aborts the whole transaction, even if its caller catches it (engine and oracle agree).

The engine never resumes a caller whose callee raised; the oracle runs the caller's handler only to notice
it, aborts all the same and warns with ``CaughtCalleeError``. The client's error names where it was raised.
"""

from __future__ import annotations

import warnings

import pytest

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.core import partition
from charon.testing import CaughtCalleeError, check_epoch, serial_execute

op = Operator("a")


class Nope(Exception):
    pass


class Other(Exception):
    pass


@op.function
async def risky(ctx: Context) -> int:
    ctx.put(5)
    raise Nope("no")


@op.function
async def careful(ctx: Context) -> str:
    ctx.put(1)
    try:
        await ctx.call(op, "other", risky)
    except Nope:
        ctx.put(2)
        return "caught"
    return "not raised"


@op.function
async def converts(ctx: Context) -> str:
    try:
        await ctx.call(op, "other", risky)
    except Nope as exc:
        raise Other("converted") from exc
    return "not raised"


@op.function
async def middle(ctx: Context) -> str:
    return await ctx.call(op, "m", careful)  # careful catches risky's error two levels down


@op.function
async def plain(ctx: Context) -> int:
    ctx.put(1)
    await ctx.call(op, "other", risky)
    return 0


@op.function
async def sends(ctx: Context) -> int:
    ctx.put(1)
    ctx.send(op, "other", risky)
    return 0


@op.function
async def root_raises(ctx: Context) -> int:
    raise Nope("at the root")


@op.function
async def bump(ctx: Context) -> int:
    v = ctx.get(default=0) + 1
    ctx.put(v)
    return v


@op.function
async def unawaited_and_twice(ctx: Context) -> list:
    ctx.call(op, "never", bump)
    c = ctx.call(op, "twice", bump)
    return [await c, await c, await ctx.gather(c, c)]


@op.function
async def awaited_twice(ctx: Context) -> list:
    c = ctx.call(op, "twice", bump)
    return [await c, await c, await ctx.gather(c, c)]


app = Application("catch", [op])


def _run(fn: str, partitions: int) -> tuple:
    rt = InProcessRuntime(app, partitions=partitions)
    before = rt.snapshot()
    result = rt.run_epoch([Request("q", "a", "me", fn, serde.encode([]), ts=1.0)])
    return rt, before, result


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("live", [False, True], ids=["replay", "live"])
@pytest.mark.parametrize("fn", ["careful", "converts", "middle"])
def test_caught_callee_error_aborts_in_engine_and_oracle(monkeypatch, fn, live, partitions):
    """Repro r5: the caller catching (or converting) its callee's exception still aborts, with that error."""
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    rt, before, result = _run(fn, partitions)
    (reply,) = result.replies.values()
    assert not reply.ok and reply.error_type == "Nope"
    assert reply.error_message.startswith("no [raised by a.risky on key 'other'")
    assert "callers cannot catch it" in reply.error_message
    assert rt.snapshot() == before
    with pytest.warns(CaughtCalleeError, match=r"a\.(careful|converts) on key '(me|m)' caught a callee's exception"):
        check_epoch(app, before, rt.snapshot(), result)


@pytest.mark.parametrize("fn", ["plain", "sends"])
def test_uncaught_callee_error_names_its_origin_without_a_warning(fn):
    rt, before, result = _run(fn, 2)
    (reply,) = result.replies.values()
    assert (reply.ok, reply.error_type) == (False, "Nope")
    assert "raised by a.risky on key 'other'" in reply.error_message
    with warnings.catch_warnings():
        warnings.simplefilter("error", CaughtCalleeError)
        check_epoch(app, before, rt.snapshot(), result)
        ok, (etype, message) = serial_execute(app, dict(before), 1, result.requests[1])
    assert (ok, etype, message) == (False, "Nope", reply.error_message)


def test_root_error_message_is_unchanged():
    rt, before, result = _run("root_raises", 1)
    (reply,) = result.replies.values()
    assert (reply.ok, reply.error_type, reply.error_message) == (False, "Nope", "at the root")
    check_epoch(app, before, rt.snapshot(), result)


@pytest.mark.parametrize("live", [False, True], ids=["replay", "live"])
def test_never_awaited_call_aborts_and_a_call_runs_once(monkeypatch, live):
    """Engine and oracle: a call never awaited aborts the transaction with UnawaitedCall naming the function
    and the call; awaiting one call again returns its value."""
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    rt, before, result = _run("unawaited_and_twice", 2)
    (reply,) = result.replies.values()
    assert not reply.ok and reply.error_type == "UnawaitedCall", reply
    assert "a.unawaited_and_twice on key 'me'" in reply.error_message
    assert "call number 1, ctx.call(a, 'never', bump)" in reply.error_message
    assert rt.read_state("a", "never") is None and rt.read_state("a", "twice") is None
    check_epoch(app, before, rt.snapshot(), result)
    state: dict = {}
    assert serial_execute(app, state, 1, result.requests[1]) == (False, ("UnawaitedCall", reply.error_message))
    assert state == {}
    rt, before, result = _run("awaited_twice", 2)
    (reply,) = result.replies.values()
    assert serde.decode(reply.value) == [1, 1, [1, 1]]
    assert rt.read_state("a", "twice") == 1
    check_epoch(app, before, rt.snapshot(), result)
