"""A small, fully typed application: accounts, transfers between them, a fan-out and a timer.

An example of the typed API: every call names the :class:`~charon.Function` it calls, so a type checker
(``mypy --strict``, pyright) checks the arguments against that function's parameters and gives the awaited
value its return type. See ``docs/guides/typing.md``; ``tests/package/test_user_typing.py`` type-checks it.
"""

from __future__ import annotations

from charon import Application, Context, Operator

account = Operator("account")


@account.function(public=True)
async def balance(ctx: Context) -> int:
    """The account's balance (0 for a new account)."""
    value: int = ctx.get(default=0)
    return value


@account.function(public=True)
async def deposit(ctx: Context, amount: int, note: str = "") -> int:
    """Add ``amount`` (may be negative, not below zero); returns the new balance."""
    new = await ctx.call(account, ctx.key, balance) + amount
    if new < 0:
        raise ValueError(f"account {ctx.key} would go below zero ({new})")
    ctx.put(new)
    if note:
        ctx.put_item("last-note", note)
    return new


@account.function(public=True)
async def transfer(ctx: Context, to: str, amount: int) -> int:
    """Move ``amount`` from this account to ``to`` in one transaction; returns this account's new balance."""
    if amount <= 0 or to == ctx.key:
        raise ValueError(f"cannot transfer {amount} to {to}")
    left = await ctx.call(account, ctx.key, deposit, -amount, f"to {to}")
    await ctx.call(account, to, deposit, amount, f"from {ctx.key}")
    return left


@account.function(public=True)
async def total(ctx: Context, others: list[str]) -> int:
    """This account's balance plus ``others``' balances, read concurrently."""
    mine, first = await ctx.gather(ctx.call(account, ctx.key, balance), ctx.call(account, others[0], balance))
    rest = await ctx.gather(*[ctx.call(account, k, balance) for k in others[1:]])
    return mine + first + sum(rest)


@account.function(timeout=5.0, public=True)  # with arguments, the decorator keeps the signature too
async def pay_later(ctx: Context, to: str, amount: int, seconds: float) -> str:
    """Transfer ``amount`` to ``to`` in ``seconds`` (a timer of this account); returns the timer's id."""
    ctx.send(account, to, balance)  # a call whose result is not needed
    return ctx.send_after(seconds, account, ctx.key, transfer, to, amount)


app = Application("ledger", [account])
