"""A bank with hostile functions beside it, for the isolation tests: an endless loop, a C-level sleep, a loop that
swallows every exception, a callee that spins, and one that spins only when it sees another transaction's write
(so only its fallback rerun overruns)."""

import time

from charon import Application, Context, Operator

acc = Operator("acc")


@acc.function(public=True)
async def deposit(ctx: Context, amount: int) -> int:
    v = ctx.get(default=0) + amount
    ctx.put(v)
    return v


@acc.function(public=True)
async def transfer(ctx: Context, to: str, amount: int) -> int:
    balance = ctx.get(default=0)
    if balance < amount:
        raise ValueError(f"{ctx.key} has {balance}")
    ctx.put(balance - amount)
    await ctx.call(acc, to, deposit, amount)
    return balance - amount


@acc.function(public=True)
async def balance(ctx: Context) -> int:
    return ctx.get(default=0)


@acc.function(public=True)
async def spin(ctx: Context) -> None:
    ctx.put(-1)
    while True:
        pass


@acc.function(public=True)
async def spin_callee(ctx: Context, other: str) -> None:
    ctx.put(-2)
    await ctx.call(acc, other, spin)


@acc.function(timeout=0.5, public=True)
async def sleepy(ctx: Context, seconds: float) -> str:
    time.sleep(seconds)  # blocked in C: cannot be interrupted until it returns
    return "slept"


@acc.function(public=True)
async def spin_if_set(ctx: Context) -> int:
    """Spins only when the entity holds 1 (in an epoch where a lower transaction set it, only its fallback rerun
    sees that)."""
    v = ctx.get(default=0)
    while v == 1:
        pass
    ctx.put(v + 10)
    return v


@acc.function(public=True)
async def set_one(ctx: Context) -> None:
    ctx.put(1)


@acc.function(public=True)
async def blob(ctx: Context, data: str) -> int:
    """Takes a large argument (the paused-flood scenario); keeps nothing."""
    return len(data)


@acc.function(public=True)
async def boom(ctx: Context) -> None:
    raise RuntimeError("boom")


@acc.function(public=True)
async def die(ctx: Context) -> None:
    """Kills the process running it (as a crash in a C extension or an out-of-memory kill would)."""
    import os

    ctx.put(-3)
    os._exit(3)


@acc.function(public=True)
async def caught(ctx: Context, seconds: float) -> str:
    """Works past its budget and catches the interrupt (a bare except): its outcome is the verdict anyway."""
    ctx.put(-3)
    t = time.monotonic()
    try:
        while time.monotonic() - t < seconds:
            pass
    except:  # noqa: E722 - the mistake under test
        return "caught"
    return "finished"


app = Application("hostile", [acc])
