"""An application whose functions abort in every way the error model names (tests/contract/test_contract_errors.py):
an application exception at the root and in a callee, an unknown function, an unserializable return value, the
call-graph depth limit and an illegal await inside the call graph."""

import asyncio

from charon import Application, Context, Operator

bank = Operator("bank")


class InsufficientFunds(Exception):
    """The application's own error."""


@bank.function(public=True)
async def withdraw(ctx: Context, amount: int) -> int:
    balance = ctx.get(default=0)
    ctx.put(balance - amount)
    if balance < amount:
        raise InsufficientFunds(f"{ctx.key} has {balance}, needs {amount}")
    return balance - amount


@bank.function(public=True)
async def pay(ctx: Context, to: str, amount: int) -> int:
    """A nested abort: the callee raises, the whole transaction aborts."""
    ctx.put(ctx.get(default=0) + amount)
    return await ctx.call(bank, to, withdraw, amount)


@bank.function(public=True)
async def calls_unknown(ctx: Context) -> None:
    ctx.put(1)
    await ctx.call("bank", ctx.key, "nosuch")


@bank.function(public=True)
async def bad_return(ctx: Context) -> object:
    ctx.put(1)
    return {1, 2}  # a set: not msgpack-serializable


@bank.function(public=True)
async def deep(ctx: Context, n: int) -> int:
    ctx.put(n)
    return await ctx.call(bank, ctx.key, deep, n + 1)


@bank.function(public=True)
async def sleeps(ctx: Context) -> None:
    ctx.put(1)
    await asyncio.sleep(0)


@bank.function(public=True)
async def balance(ctx: Context) -> int:
    return ctx.get(default=0)


app = Application("errors", [bank])
