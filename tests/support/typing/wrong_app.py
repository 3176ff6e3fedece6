"""A deliberately wrong application: each line marked WRONG is a mistake mypy and pyright must report (the exact
errors are asserted by tests/package/test_user_typing.py, which checks this file as a user's module)."""

from __future__ import annotations

from ledger import account, balance, deposit, pay_later, transfer

from charon import Application, Context, Operator

audit = Operator("audit")


@audit.function
async def on_outcome(ctx: Context, outcome: int) -> None:
    ctx.put(outcome)


@audit.function
async def check(ctx: Context, to: str) -> str:
    await ctx.call(account, to, deposit, "ten")  # WRONG: an argument of the wrong type
    name: str = await ctx.call(account, to, balance)  # WRONG: the awaited value is an int
    ctx.send(account, to, transfer, to)  # WRONG: too few arguments
    ctx.send_after(5.0, account, to, deposit, 1, "note", 3)  # WRONG: a timer with too many arguments
    a, b = await ctx.gather(ctx.call(account, to, balance), ctx.call(account, to, deposit, 1))
    a.upper()  # WRONG: an int has no upper()
    ctx.send(account, to, pay_later, to, "1", 2.0)  # WRONG: amount is an int (decorated with a timeout)
    ctx.effect("charge", to, then=on_outcome)  # WRONG: a continuation's first parameter takes the outcome dict
    untyped = await ctx.call(account, to, "deposit", "ten")  # by name: not checked (an Any)
    return name + str(b) + str(untyped)  # fine for a checker (untyped is Any)


app = Application("audit", [audit])
