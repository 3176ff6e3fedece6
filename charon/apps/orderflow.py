"""Order -> payment -> shipping over three applications joined by portals (issue 12 item 6).

* ``payments`` (operator ``wallets``, key = customer) exposes the portals ``charge`` and ``refund``; a charge
  fails (its transaction aborts) when the balance is too low or, with probability ``FRAUD_RATE`` (drawn
  with ``ctx.random()``, so deterministically), as a "fraud check".
* ``shipping`` (operator ``stock``, key = item) exposes ``ship``; it fails when the stock is too low.
  Every shipment is also emitted on its exposed stream ``shipments``.
* ``orders`` (operator ``orders``, key = order id) uses the three portals: ``place`` records the order and
  asks ``payments.charge``; ``on_paid`` asks ``shipping.ship`` (or rejects the order); ``on_shipped``
  completes it, or asks ``payments.refund`` when the stock ran out; ``on_refunded`` cancels it.

Each step is its own transaction in its own application; the portals make the whole flow exactly once.
Clients may invoke only ``orders.place`` and the set-up functions ``wallets.deposit`` and ``stock.restock``
(``@op.function(public=True)``): the portal targets (``charge``, ``refund``, ``ship``) and the continuations
(``on_paid``, ``on_shipped``, ``on_refunded``) are internal, so no client can forge a payment's reply or a refund
(the gateway answers 404 for them, as for a function that does not exist).
Once settled, every order is ``shipped``, ``rejected`` or ``cancelled``, and money and stock are conserved:
``sum(wallets) + sum(amount of shipped orders) == initial money`` and
``sum(stock) + sum(qty of shipped orders) == initial stock`` (:func:`check_conservation`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from charon.core.context import Context
from charon.operator import Application, Operator

__all__ = ["FRAUD_RATE", "check_conservation", "orders_app", "payments_app", "shipping_app"]

FRAUD_RATE = 0.1
FINAL = ("shipped", "rejected", "cancelled")

# -- payments ---------------------------------------------------------------------------------------------
wallets = Operator("wallets")


@wallets.function(public=True)
async def deposit(ctx: Context, amount: int) -> int:
    """Add ``amount`` to the customer's balance."""
    bal = ctx.get(0) + amount
    ctx.put(bal)
    return bal


@wallets.function
async def charge(ctx: Context, amount: int, order: str) -> int:
    """Take ``amount`` for ``order`` (raises, so aborts, on a low balance or a failed fraud check)."""
    if ctx.random() < FRAUD_RATE:
        raise PermissionError(f"fraud check failed for {order}")
    bal = ctx.get(0)
    if bal < amount:
        raise ValueError(f"insufficient funds for {order}: {bal} < {amount}")
    ctx.put(bal - amount)
    ctx.put_item("charged." + order, ctx.get_item("charged." + order, 0) + 1)  # counts executions
    return bal - amount


@wallets.function
async def refund(ctx: Context, amount: int, order: str) -> int:
    """Give ``amount`` back for ``order``."""
    bal = ctx.get(0) + amount
    ctx.put(bal)
    ctx.put_item("refunded." + order, ctx.get_item("refunded." + order, 0) + 1)
    return bal


payments_app = Application("payments", [wallets], portals={"charge": ("wallets", "charge"),
                                                            "refund": ("wallets", "refund")})

# -- shipping ---------------------------------------------------------------------------------------------
stock = Operator("stock")


@stock.function(public=True)
async def restock(ctx: Context, qty: int) -> int:
    """Add ``qty`` units of this item."""
    n = ctx.get(0) + qty
    ctx.put(n)
    return n


@stock.function
async def ship(ctx: Context, qty: int, order: str) -> int:
    """Take ``qty`` units for ``order`` (raises, so aborts, when the stock is too low)."""
    n = ctx.get(0)
    if n < qty:
        raise ValueError(f"out of stock for {order}: {n} < {qty}")
    ctx.put(n - qty)
    ctx.put_item("shipped." + order, ctx.get_item("shipped." + order, 0) + 1)
    ctx.emit("shipments", {"order": order, "item": ctx.key, "qty": qty})
    return n - qty


shipping_app = Application("shipping", [stock], portals={"ship": ("stock", "ship")}, streams=["shipments"])

# -- orders -----------------------------------------------------------------------------------------------
orders = Operator("orders")


@orders.function(public=True)
async def place(ctx: Context, customer: str, item: str, qty: int, price: int) -> str:
    """Record the order and ask payments to charge it (the request commits with the order)."""
    if ctx.get() is not None:
        return ctx.get()["status"]
    ctx.put({"customer": customer, "item": item, "qty": qty, "amount": qty * price, "status": "paying",
             "steps": 0})
    ctx.ask("payments.charge", customer, qty * price, ctx.key, then="on_paid")
    return "paying"


def _step(ctx: Context, status: str) -> dict[str, Any]:
    o = ctx.get()
    o["status"] = status
    o["steps"] += 1  # one per continuation: exactly once means it ends at the number of replies
    ctx.put(o)
    return o


@orders.function
async def on_paid(ctx: Context, reply: dict) -> str:
    """Payment's reply: ship the order, or reject it."""
    if not reply["ok"]:
        _step(ctx, "rejected")
        return "rejected"
    o = _step(ctx, "shipping")
    ctx.ask("shipping.ship", o["item"], o["qty"], ctx.key, then="on_shipped")
    return "shipping"


@orders.function
async def on_shipped(ctx: Context, reply: dict) -> str:
    """Shipping's reply: done, or refund the customer."""
    if reply["ok"]:
        _step(ctx, "shipped")
        return "shipped"
    o = _step(ctx, "refunding")
    ctx.ask("payments.refund", o["customer"], o["amount"], ctx.key, then="on_refunded")
    return "refunding"


@orders.function
async def on_refunded(ctx: Context, reply: dict) -> str:
    """Refund's reply: the order is cancelled."""
    _step(ctx, "cancelled" if reply["ok"] else "refund-failed")
    return "cancelled"


orders_app = Application("orders", [orders], uses=["payments.charge", "payments.refund", "shipping.ship"])


def check_conservation(orders_rt: Any, payments_rt: Any, shipping_rt: Any, money: int, units: int) -> dict:
    """Check a settled deployment: every order final with the right number of steps, every charge,
    refund and shipment executed at most once and only for the right orders, money and stock conserved.
    Returns counts by status; raises AssertionError otherwise."""
    os_ = orders_rt.entities("orders")
    by: dict[str, int] = {}
    for oid, o in os_.items():
        assert o["status"] in FINAL, (oid, o)
        assert o["steps"] == {"shipped": 2, "rejected": 1, "cancelled": 3}[o["status"]], (oid, o)
        by[o["status"]] = by.get(o["status"], 0) + 1
    charged: dict[str, int] = {}
    refunded: dict[str, int] = {}
    for c in payments_rt.entities("wallets"):
        for name, n in payments_rt.read_items("wallets", c).items():
            kind, _, oid = name.partition(".")
            (charged if kind == "charged" else refunded)[oid] = n
    shipped: dict[str, int] = {}
    for i in shipping_rt.entities("stock"):
        for name, n in shipping_rt.read_items("stock", i).items():
            shipped[name.partition(".")[2]] = n
    assert set(charged.values()) <= {1} and set(refunded.values()) <= {1} and set(shipped.values()) <= {1}
    assert set(shipped) == {o for o, v in os_.items() if v["status"] == "shipped"}
    assert set(refunded) == {o for o, v in os_.items() if v["status"] == "cancelled"}
    assert set(charged) == set(shipped) | set(refunded)
    paid = sum(v["amount"] for v in os_.values() if v["status"] == "shipped")
    assert sum(payments_rt.entities("wallets").values()) + paid == money, "money not conserved"
    sent = sum(v["qty"] for v in os_.values() if v["status"] == "shipped")
    assert sum(shipping_rt.entities("stock").values()) + sent == units, "stock not conserved"
    return by


async def demo(n_orders: int = 200, customers: int = 8, items: int = 4, seed: int = 1) -> dict[str, Any]:
    """Run the three applications in-process, place ``n_orders`` random orders, settle, check conservation;
    returns the registry and the orders by final status."""
    import random

    from charon.runtime.deployment import Deployment
    from charon.runtime.node.inprocess import InProcessRuntime

    o, p, s = (InProcessRuntime(a, partitions=2) for a in (orders_app, payments_app, shipping_app))
    rng = random.Random(seed)
    async with o, p, s:
        for c in range(customers):
            await p.invoke("wallets", f"c{c}", "deposit", 200)
        for i in range(items):
            await s.invoke("stock", f"i{i}", "restock", 40)
        async with Deployment([o, p, s]) as dep:
            await asyncio.gather(*(
                o.submit("orders", f"o{k}", "place", [f"c{rng.randrange(customers)}", f"i{rng.randrange(items)}",
                                                      rng.randint(1, 3), rng.randint(1, 9)])
                for k in range(n_orders)))
            await dep.settle()
        by = check_conservation(o, p, s, 200 * customers, 40 * items)
        return {"registry": dep.registry(), "orders": by, "shipments": s.streams.end_offset("shipments")}


if __name__ == "__main__":
    out = asyncio.run(demo())
    print(json.dumps(out["registry"]))
    print("orders by status:", json.dumps(out["orders"], sort_keys=True), "shipments:", out["shipments"])
    print("money and stock conserved; every charge, refund and shipment ran once")
