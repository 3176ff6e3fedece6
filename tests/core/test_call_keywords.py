"""Arguments given by name to ``ctx.call``/``send``/``send_after`` bind to the callee's parameters by position
(calls carry positional arguments): a type checker accepts them (a ``ParamSpec``), so the runtime does too. The
engine (live and replayed) and the serial oracle bind them the same way; a name that cannot bind is BadArguments."""

from __future__ import annotations

import pytest

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.core import partition
from charon.testing import check_epoch, serial_execute

op = Operator("kw")


@op.function
async def record(ctx: Context, a: int, b: int = 2, c: str = "c", /) -> list:  # c positional-only
    return [a, b, c]


@op.function
async def named(ctx: Context, a: int, b: int = 2, c: str = "c") -> list:
    got = [a, b, c]
    ctx.put(got)
    return got


@op.function
async def labelled(ctx: Context, key: str, operator: str = "o", function: str = "f") -> list:
    return [key, operator, function]  # parameters named like ctx.call's own (positional-only) ones


@op.function
async def caller(ctx: Context, how: str) -> object:
    if how == "all-named":
        return await ctx.call(op, "t", named, c="z", a=1)  # b skipped: its default is passed
    if how == "mixed":
        return await ctx.call(op, "t", named, 5, b=7)
    if how == "string-name":
        return await ctx.call(op, "t", "named", 3, c="s")
    if how == "reserved-names":
        return await ctx.call(op, "t", labelled, function="F", key="K")
    if how == "gathered":
        return await ctx.gather(ctx.call(op, "t1", named, a=1), ctx.call(op, "t2", named, 2, c="x"))
    if how == "send":
        ctx.send(op, "s", named, a=9, c="sent")
        return None
    if how == "timer":
        ctx.send_after(0, op, "tm", named, a=4, b=5)
        return None
    if how == "twice":
        return await ctx.call(op, "t", named, 1, a=1)
    if how == "unknown":
        return await ctx.call(op, "t", named, 1, d=1)
    if how == "positional-only":
        return await ctx.call(op, "t", record, 1, c="no")
    if how == "missing":
        return await ctx.call(op, "t", named, b=1)
    if how == "wrong-type":
        return await ctx.call(op, "t", named, a="one")
    raise ValueError(how)


app = Application("keywords", [op])


def _run(how: str) -> tuple:
    rt = InProcessRuntime(app, partitions=2)
    before = rt.snapshot()
    result = rt.run_epoch([Request("q", "kw", "me", "caller", serde.encode([how]), ts=1.0)])
    (reply,) = result.replies.values()
    return rt, before, result, reply


@pytest.mark.parametrize("live", [False, True], ids=["replay", "live"])
@pytest.mark.parametrize(("how", "value"), [
    ("all-named", [1, 2, "z"]), ("mixed", [5, 7, "c"]), ("string-name", [3, 2, "s"]),
    ("gathered", [[1, 2, "c"], [2, 2, "x"]]), ("reserved-names", ["K", "o", "F"]),
])
def test_named_arguments_bind_by_position_in_the_engine_and_the_oracle(monkeypatch, live, how, value) -> None:
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    rt, before, result, reply = _run(how)
    assert reply.ok, reply.error_message
    assert serde.decode(reply.value) == value
    check_epoch(app, before, rt.snapshot(), result)  # the oracle ran it and agrees on the reply and the state


def test_named_arguments_of_a_send_and_a_timer() -> None:
    rt, before, result, reply = _run("send")
    assert reply.ok
    check_epoch(app, before, rt.snapshot(), result)
    assert rt.snapshot()  # the send ran in the same epoch
    assert [9, 2, "sent"] in [serde.decode(v) for v in rt.snapshot().values()]
    rt, before, result, reply = _run("timer")
    assert reply.ok
    check_epoch(app, before, rt.snapshot(), result)
    rt.run_epoch([])  # the timer fires in a later epoch
    assert [4, 5, "c"] in [serde.decode(v) for v in rt.snapshot().values()]


@pytest.mark.parametrize(("how", "message"), [
    ("twice", "two values for argument 'a'"),
    ("unknown", "has no parameter 'd'"),
    ("positional-only", "has no parameter 'c'"),
    ("missing", "missing argument 'a'"),
    ("wrong-type", "argument 'a': expected int"),
])
def test_a_name_that_cannot_bind_is_bad_arguments_everywhere(how, message) -> None:
    rt, before, result, reply = _run(how)
    assert (reply.ok, reply.error_type) == (False, "BadArguments")
    assert message in reply.error_message, reply.error_message
    assert rt.snapshot() == before
    ok, (etype, oracle_message) = serial_execute(app, dict(before), 1, result.requests[1])
    assert (ok, etype, oracle_message) == (False, "BadArguments", reply.error_message)
