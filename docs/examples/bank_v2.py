# bank_v2.py: version 2 of bank.py; each account records its currency (an item beside the balance)
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
        raise NotEnoughCredit(f"{ctx.key} has {balance}")
    ctx.put(balance - amount)
    await ctx.call(account, to, deposit, amount)
    return balance - amount


@account.function(public=True)
async def deposit(ctx: Context, amount: int) -> None:
    ctx.put(ctx.get(default=0) + amount)


@account.function(public=True)
async def currency(ctx: Context) -> str:  # new in v2
    return str(ctx.get_item("currency", "EUR"))


@account.function
async def migrate(ctx: Context, default: str) -> None:
    """Runs once on every account, in an epoch of its own, before any client transaction sees v2."""
    ctx.put_item("currency", default)


app = Application("bank", [account])
