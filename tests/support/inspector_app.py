"""A bank whose transfers the inspector tests look at: a root calling two accounts, and a callee that raises."""

from __future__ import annotations

from charon import Application, Context, Operator

bank = Operator("bank")
account = Operator("account")


class Overdrawn(Exception):
    """The account has less than the amount."""


@account.function(public=True)
async def withdraw(ctx: Context, amount: int) -> int:
    balance = ctx.get(default=0)
    if balance < amount:
        raise Overdrawn(f"account {ctx.key} has {balance}, needs {amount}")  # WITHDRAW-RAISES
    ctx.put(balance - amount)
    return balance - amount


@account.function(public=True)
async def deposit(ctx: Context, amount: int) -> int:
    ctx.put(ctx.get(default=0) + amount)
    return ctx.get()


@account.function(public=True)
async def notify(ctx: Context, note: str) -> None:
    ctx.put_item("last_note", note)


@bank.function(public=True)
async def transfer(ctx: Context, frm: str, to: str, amount: int) -> list[int]:
    """Withdraw from ``frm``, deposit to ``to`` (two calls), tell ``to`` (a send)."""
    left = await ctx.call(account, frm, withdraw, amount)
    now = await ctx.call(account, to, deposit, amount)
    ctx.send(account, to, notify, f"got {amount}")
    return [left, now]


@bank.function(public=True)
async def fail(ctx: Context, why: str) -> None:
    raise ValueError(why)  # ROOT-RAISES


app = Application("inspected_bank", [bank, account])
