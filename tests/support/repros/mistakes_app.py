"""The repros' app of common mistakes (../shared/repros/mistakes_app.py, unchanged): used by tests/core/test_mistakes.py."""
import datetime, random, time
from charon import Application, Context, Operator

acc = Operator("acc")
other = Operator("other")

@acc.function(public=True)
async def rnd(ctx: Context) -> float:
    v = random.random()
    ctx.put(v)
    await ctx.call(other, ctx.key + "-o", noop)
    if v < 0.5:
        ctx.put_item("x", 1)
    return v

@acc.function(public=True)
async def clock(ctx: Context) -> float:
    t = time.time()
    await ctx.call(other, ctx.key + "-o", noop)
    return t

@acc.function(public=True)
async def setiter(ctx: Context, names: list) -> list:
    out = []
    for n in set(names):
        out.append(n)
        await ctx.call(other, n, noop)
    return out

@acc.function(public=True)
async def no_await(ctx: Context) -> str:
    ctx.call(other, "x", bump)          # forgot await
    return "done"

@acc.function(public=True)
async def unknown_fn(ctx: Context) -> None:
    await ctx.call(other, "x", "nosuchfn")

@acc.function(public=True)
async def unknown_op(ctx: Context) -> None:
    await ctx.call("nosuchop", "x", "bump")

@acc.function(public=True)
async def bad_arg(ctx: Context) -> None:
    await ctx.call(other, "x", takes, {1, 2})

@acc.function(public=True)
async def catch_callee(ctx: Context) -> str:
    try:
        await ctx.call(other, "x", boom)
    except ValueError:
        return "caught"
    return "no"

@acc.function(public=True)
async def sleepy(ctx: Context, s: float) -> str:
    time.sleep(s)
    return "slept"

@acc.function(public=True)
async def spin(ctx: Context) -> None:
    while True:
        pass

@acc.function(public=True)
async def big(ctx: Context, mb: int) -> int:
    ctx.put("x" * (mb * 1024 * 1024))
    return mb

@acc.function(public=True)
async def put_set(ctx: Context) -> None:
    ctx.put({1, 2})

@acc.function(public=True)
async def put_dt(ctx: Context) -> None:
    ctx.put(datetime.datetime.now())

class Thing:
    pass

@acc.function(public=True)
async def put_obj(ctx: Context) -> None:
    ctx.put(Thing())

@acc.function(public=True)
async def ret_set(ctx: Context) -> set:
    return {1, 2}

@acc.function(public=True)
async def recurse(ctx: Context, n: int) -> int:
    if n == 0:
        return 0
    return 1 + await ctx.call(acc, ctx.key, recurse, n - 1)

@acc.function(public=True)
async def recurse_other(ctx: Context, n: int) -> int:
    if n == 0:
        return 0
    return 1 + await ctx.call(acc, f"{ctx.key}.{n}", recurse_other, n - 1)

@acc.function(public=True)
async def io_await(ctx: Context) -> None:
    import asyncio
    await asyncio.sleep(0.1)

@acc.function(public=True)
async def read(ctx: Context):
    return ctx.get()

@other.function(public=True)
async def noop(ctx: Context) -> None:
    pass

@other.function(public=True)
async def bump(ctx: Context) -> None:
    ctx.put(ctx.get(default=0) + 1)

@other.function(public=True)
async def takes(ctx: Context, x: list) -> None:
    pass

@other.function(public=True)
async def boom(ctx: Context) -> None:
    raise ValueError("boom")

app = Application("mistakes", [acc, other])
