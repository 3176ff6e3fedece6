"""An order flow whose continuations and helpers are internal (issue 31 item 7): ``order.place`` (public)
reserves the item (``item.reserve``, internal) and asks the customer's account to pay (``customer.check``,
internal), which answers with ``order.on_checked`` (internal): only a paid order is confirmed. ``customer.refund``
(internal) gives money back. A forged ``on_checked`` or a direct ``refund`` must not be possible over HTTP."""

from __future__ import annotations

from charon import Application, Context, Operator

order = Operator("order")
customer = Operator("customer")
item = Operator("item")


@item.function(public=True)
async def restock(ctx: Context, qty: int) -> int:
    ctx.put(ctx.get(0) + qty)
    return int(ctx.get())


@item.function
async def reserve(ctx: Context, qty: int) -> bool:
    have = ctx.get(0)
    if have < qty:
        return False
    ctx.put(have - qty)
    return True


@customer.function(public=True)
async def deposit(ctx: Context, amount: int) -> int:
    ctx.put(ctx.get(0) + amount)
    return int(ctx.get())


@customer.function
async def check(ctx: Context, order_id: str, amount: int) -> None:
    paid = ctx.get(0) >= amount
    if paid:
        ctx.put(ctx.get(0) - amount)
    ctx.send(order, order_id, on_checked, paid)


@customer.function
async def refund(ctx: Context, amount: int) -> int:
    ctx.put(ctx.get(0) + amount)
    return int(ctx.get())


@order.function(public=True)
async def place(ctx: Context, who: str, sku: str, price: int) -> str:
    if not await ctx.call(item, sku, reserve, 1):
        ctx.put({"state": "rejected"})
        return "rejected"
    ctx.put({"state": "checking", "who": who, "price": price})
    ctx.send(customer, who, check, ctx.key, price)
    return "checking"


@order.function
async def on_checked(ctx: Context, paid: bool) -> str:
    doc = ctx.get({"state": "unknown"})
    doc["state"] = "confirmed" if paid else "unpaid"
    ctx.put(doc)
    return str(doc["state"])


@order.function(public=True)
async def status(ctx: Context) -> str:
    return str(ctx.get({"state": "none"})["state"])


app = Application("exposure", [order, customer, item])

hidden = Operator("hidden")


@hidden.function
async def helper(ctx: Context) -> int:
    return 1


#: an application without a public function (``charon run`` warns)
no_public = Application("nopublic", [hidden])
