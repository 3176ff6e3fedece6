"""Two applications wired by streams (issue 12 item 3): ``shop`` emits orders to pay, ``bank`` charges them
and emits the payments back, which ``shop`` takes as its input (a cycle)."""

from charon import Application, Context, Operator

orders = Operator("orders")


@orders.function(public=True)
async def place(ctx: Context, customer: str, amount: int) -> None:
    """Record an order and ask the bank (through the ``to_pay`` stream) to charge it."""
    ctx.put({"customer": customer, "amount": amount, "paid": 0})
    ctx.emit("to_pay", {"key": customer, "args": [amount, ctx.key]})


@orders.function(public=True)
async def mark_paid(ctx: Context) -> int:
    """Count the bank's confirmation (exactly once: the count must end at 1)."""
    o = ctx.get()
    o["paid"] += 1
    ctx.put(o)
    return o["paid"]


shop = Application("shop", [orders])

accounts = Operator("accounts")


@accounts.function(public=True)
async def charge(ctx: Context, amount: int, order: str) -> int:
    """Charge ``order`` once per delivery (an item counts deliveries) and confirm it on ``paid``."""
    n = ctx.get_item(order, 0) + 1
    ctx.put_item(order, n)
    bal = ctx.get(default=0) - amount
    ctx.put(bal)
    ctx.emit("paid", {"key": order, "args": []})
    return bal


bank = Application("bank", [accounts])
