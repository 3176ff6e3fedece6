"""An application that emits events, for the output-stream tests (in-process, durable, Spark)."""

from charon import Application, Context, Operator

acct = Operator("acct")


@acct.function(public=True)
async def transfer(ctx: Context, to: str, amount: int, tag: str) -> int:
    """Move ``amount`` to ``to`` (another account) and emit the payment; aborts (no event) when the balance is
    too low."""
    bal = ctx.get(default=0)
    ctx.emit("payments", {"tag": tag, "from": ctx.key, "to": to, "amount": amount})
    await ctx.call(acct, to, credit, amount, tag)
    if bal < amount:
        raise ValueError(f"insufficient funds for {tag}")
    ctx.put(bal - amount)
    return bal - amount


@acct.function(public=True)
async def credit(ctx: Context, amount: int, tag: str) -> int:
    """Add ``amount`` and emit the credit."""
    bal = ctx.get(default=0) + amount
    ctx.put(bal)
    ctx.emit("credits", [tag, ctx.key, amount])
    return bal


app = Application("streams", [acct])
