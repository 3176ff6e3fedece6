"""An application whose transactions the call-graph-cached fallback treats in each of its ways (a write where the dry
run only read, a value invalid elsewhere, a blocked transaction): shared by the fallback's tests and the inspector's
(a transaction it defers)."""

from __future__ import annotations

import itertools

from charon import Application, Context, Operator
from charon.core.routing import partition_of

acct = Operator("acct")
P = 2


@acct.function(public=True)
async def setall(ctx: Context, v: int, other: str) -> int:
    ctx.put(v)
    await ctx.call(acct, other, "setv", v * 2)
    return 0


@acct.function(public=True)
async def setv(ctx: Context, v: int) -> int:
    ctx.put(v)
    return 0


@acct.function(public=True)
async def getv(ctx: Context) -> int:
    return ctx.get(default=0)


@acct.function(public=True)
async def write_if_big(ctx: Context, other: str) -> int:
    """Writes its own entity only when the state says so: the dry run may only read it."""
    x = ctx.get(default=0)
    v = await ctx.call(acct, other, "getv")
    if x > 3:
        ctx.put(x * 100 + v)
    return 0


@acct.function(public=True)
async def copy_from(ctx: Context, other: str) -> int:
    """Stores what another entity returns (invalid where that value changed, valid here)."""
    v = await ctx.call(acct, other, "getv")
    ctx.put(v)
    return v


@acct.function(public=True)
async def bump_remote(ctx: Context, other: str) -> int:
    """Reads its own entity and writes another one with the value read plus one."""
    x = ctx.get(default=0)
    await ctx.call(acct, other, "setv", x + 1)
    return x


app = Application("fastleak", [acct])


def keys_at(*parts: int) -> list[str]:
    """Distinct keys, the i-th owned by partition parts[i] (of ``P``)."""
    out: list[str] = []
    for want in parts:
        out.append(next(k for k in (f"k{i}" for i in itertools.count())
                        if k not in out and partition_of("acct", k, P) == want))
    return out
