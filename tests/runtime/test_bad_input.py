"""Bad input gets a typed error for that request only; the epoch and the runtime carry on."""

from __future__ import annotations

import asyncio

import pytest

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.apps import ycsb
from charon.client_errors import raise_for_reply
from charon.errors import (
    BadArguments,
    CallGraphLimitExceeded,
    IllegalAwait,
    SerializationError,
    TransactionAborted,
    UnknownFunction,
    UnknownOperator,
)

svc = Operator("svc")


@svc.function
async def bad_return(ctx: Context) -> object:
    ctx.put(1)
    return object()  # not serializable


@svc.function
async def forever(ctx: Context, n: int) -> int:
    ctx.put(n)
    return await ctx.call(svc, ctx.key, forever, n + 1)


@svc.function
async def sleeps(ctx: Context) -> None:
    ctx.put(1)
    await asyncio.sleep(0)


@svc.function
async def calls_unknown(ctx: Context) -> None:
    ctx.put(1)
    await ctx.call("nope", "k", "f")


@svc.function
async def raises(ctx: Context) -> None:
    ctx.put(1)
    raise KeyError("missing thing")


@svc.function
async def typed(ctx: Context, n: int, name: str = "x") -> str:
    ctx.put(n)
    return f"{name}{n}"


app = Application("bad", [svc, ycsb.account])


def _req(i, op, key, fn, args):
    return Request(f"b{i}", op, key, fn, args if isinstance(args, bytes) else serde.encode(args))


CASES = [
    (("nope", "k", "f", []), UnknownOperator),
    (("svc", "k", "nope", []), UnknownFunction),
    (("svc", "k", "typed", []), BadArguments),
    (("svc", "k", "typed", [1, "a", 3]), BadArguments),
    (("svc", "k", "typed", ["one"]), BadArguments),
    (("svc", "k", "typed", b"\xc1garbage"), SerializationError),
    (("svc", "k1", "bad_return", []), SerializationError),
    (("svc", "k2", "forever", [0]), CallGraphLimitExceeded),
    (("svc", "k3", "sleeps", []), IllegalAwait),
    (("svc", "k4", "calls_unknown", []), UnknownOperator),
    (("svc", "k5", "raises", []), TransactionAborted),
]


def test_each_bad_request_gets_its_typed_error_and_others_commit():
    rt = InProcessRuntime(app, partitions=3)
    rt.load("account", {"a": 100, "b": 0})
    reqs = [_req(i, *args) for i, (args, _) in enumerate(CASES)]
    reqs.append(_req(99, "account", "a", "transfer", ["b", 5]))
    reqs.append(_req(100, "svc", "ok", "typed", [7, "n"]))
    result = rt.run_epoch(reqs)
    by_id = {r.request_id: r for r in result.replies.values()}
    for i, (_, exc) in enumerate(CASES):
        with pytest.raises(exc):
            raise_for_reply(by_id[f"b{i}"])
    assert by_id["b7"].error_type == "CallGraphLimitExceeded"
    assert by_id["b8"].error_type == "IllegalAwait"
    assert by_id["b9"].error_type == "UnknownOperator"
    assert raise_for_reply(by_id["b100"]) == "n7"
    assert by_id["b99"].ok and rt.read_state("account", "b") == 5
    # nothing of the failed requests was applied
    assert by_id["b10"].error_type == "KeyError"
    for k in ("k", "k1", "k2", "k3", "k4", "k5"):
        assert rt.read_state("svc", k) is None
    # the runtime carries on
    r2 = rt.run_epoch([_req(200, "account", "b", "transfer", ["a", 5])])
    assert r2.replies[min(r2.replies)].ok and rt.read_state("account", "a") == 100


def test_validation_before_the_log():
    with pytest.raises(UnknownFunction):
        app.validate("svc", "missing", [])
    with pytest.raises(BadArguments):
        app.validate("svc", "typed", [True])
    assert app.validate("svc", "typed", [1]).name == "typed"
