# bank.py
from charon import Application, Context, Operator

account = Operator("account")


class NotEnoughCredit(Exception):
    pass


@account.function(public=True)
async def transfer(ctx: Context, to: str, amount: int) -> int:
    if amount <= 0:
        raise ValueError("amount must be positive")
    balance = ctx.get(default=0)
    if balance < amount:
        raise NotEnoughCredit(f"{ctx.key} has {balance}")  # aborts the whole transaction
    ctx.put(balance - amount)
    await ctx.call(account, to, deposit, amount)  # synchronous call: waits for the reply
    return balance - amount  # the reply to the client


@account.function(public=True)
async def deposit(ctx: Context, amount: int) -> None:
    ctx.put(ctx.get(default=0) + amount)


app = Application("bank", [account])
