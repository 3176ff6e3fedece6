"""A ledger for the durable-engine tests: every payment tag is counted at both ends, so a double execution
(count 2) or a lost acknowledged one (count 0) is visible in the state."""

from charon import Application, Context, Operator

acct = Operator("acct")


@acct.function(public=True)
async def pay(ctx: Context, to: str, tag: str) -> list:
    """Count ``tag`` here and at ``to``; returns [this tag's count here, payments seen here]."""
    n = ctx.get_item(tag, 0) + 1
    ctx.put_item(tag, n)
    total = ctx.get(default=0) + 1
    ctx.put(total)
    await ctx.call(acct, to, receive, tag)
    return [n, total]


@acct.function(public=True)
async def receive(ctx: Context, tag: str) -> None:
    """Count ``tag`` as received."""
    ctx.put_item("in:" + tag, ctx.get_item("in:" + tag, 0) + 1)


@acct.function(public=True)
async def fail(ctx: Context, tag: str) -> None:
    """Write, then abort: nothing of it may survive."""
    ctx.put_item(tag, 99)
    raise ValueError(f"refused {tag}")


app = Application("ledger", [acct])
