"""An order flow over an effect for the fault harness: ``orders/<k>.place(amount)`` charges a card through the
``charge`` effect (a fake card service in this module's memory, deduplicating by idempotency key, as a real one
does) and sets an expiry timer; the continuation ``on_charged`` marks the order paid or declined and counts its
runs; ``expire`` fires an hour later and cancels an order still charging."""

from __future__ import annotations

from charon import Application, Context, Operator
from charon.testing import Snapshot

orders = Operator("orders")

#: the fake card service: idempotency key -> amount charged, and how often it was called
CHARGED: dict[str, int] = {}
CALLS: list[str] = []


@orders.function(public=True)
async def place(ctx: Context, amount: int) -> str:
    if (ctx.get({}) or {}).get("state") in ("charging", "paid"):
        return ""
    ctx.put({"state": "charging", "amount": amount, "runs": 0})
    ctx.send_after(3000.0, orders, ctx.key, expire)
    return ctx.effect("charge", amount, then=on_charged, carry=[amount], timeout=5.0, attempts=4)


@orders.function
async def on_charged(ctx: Context, result: dict, amount: int) -> None:
    order = ctx.get({}) or {}
    runs = order.get("runs", 0) + 1
    state = "paid" if result["ok"] else "declined"
    ctx.put({"state": state, "amount": amount, "runs": runs, "fx_runs": order.get("fx_runs", 0) + 1})


@orders.function
async def expire(ctx: Context) -> None:
    order = ctx.get({}) or {}
    if order.get("state") == "charging":
        ctx.put({**order, "state": "expired"})


@orders.function(public=True)
async def status(ctx: Context) -> object:
    return ctx.get()


app = Application("fxharness", [orders])


@app.effect_handler("charge")
async def charge(idempotency_key: str, amount: int) -> dict:
    CALLS.append(idempotency_key)
    if amount % 7 == 0:
        raise ValueError("card declined")
    CHARGED.setdefault(idempotency_key, amount)  # a retried charge is applied once
    return {"charged": amount}


def workload(rng):  # type: ignore[no-untyped-def]
    for i in range(40):
        yield ("orders", f"o{rng.randint(0, 9)}", "place", rng.randint(1, 100)) if i % 4 else (
            "orders", f"o{rng.randint(0, 9)}", "status")


def continuation_once(snap: Snapshot) -> None:
    """A continuation runs at most once per effect (an order is placed at most once before it settles)."""
    for key, order in snap.entities("orders").items():
        assert isinstance(order, dict)
        assert order.get("fx_runs", 0) <= 1, f"{key}: the continuation ran {order['fx_runs']} times"
