"""The repros' bank (../shared/repros/bank.py), plus functions that store or return values of a given size and
one that emits an event, for the resource-bound tests (tests/faults/test_bounds.py)."""
from typing import Any

from charon import Application, Context, Operator

account = Operator("account")
kv = Operator("kv")


class NotEnoughCredit(Exception):
    pass


@account.function(public=True)
async def transfer(ctx: Context, to: str, amount: int) -> int:
    balance = ctx.get(default=0)
    if balance < amount:
        raise NotEnoughCredit(f"{ctx.key} has {balance}")
    ctx.put(balance - amount)
    await ctx.call(account, to, deposit, amount)
    return balance - amount


@account.function(public=True)
async def deposit(ctx: Context, amount: int) -> None:
    ctx.put(ctx.get(default=0) + amount)


@account.function(public=True)
async def incr(ctx: Context) -> int:
    # exactly-once probe: every execution adds 1
    n = ctx.get(default=0) + 1
    ctx.put(n)
    return n


@kv.function(public=True)
async def set(ctx: Context, value: Any) -> Any:
    ctx.put(value)
    return value


@kv.function(public=True)
async def put_item(ctx: Context, name: str, value: Any) -> None:
    ctx.put_item(name, value)


@kv.function(public=True)
async def items(ctx: Context) -> list:
    return [[n, v] for n, v in ctx.scan_items()]


@kv.function(public=True)
async def echo(ctx: Context, value: Any) -> Any:
    return value


@kv.function(public=True)
async def big_put(ctx: Context, n: int) -> int:
    ctx.put("x" * n)
    return n


@kv.function(public=True)
async def big_item(ctx: Context, n: int) -> int:
    ctx.put_item("blob", "x" * n)
    return n


@kv.function(public=True)
async def big_return(ctx: Context, n: int) -> str:
    return "x" * n


@kv.function(public=True)
async def big_callee(ctx: Context, n: int) -> int:
    value = await ctx.call(kv, ctx.key + "-callee", big_return, n)
    return len(value)


@kv.function(public=True)
async def emit(ctx: Context, value: Any) -> None:
    ctx.emit("ticks", value)


app = Application("bank", [account, kv])
