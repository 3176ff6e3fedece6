"""A saga over durable effects (issue 23 item 3): order -> reserve stock -> charge the card through an external
service -> ship through an external service; a failed charge releases the stock; a failed shipment releases the
stock and refunds the card.

Each step is one transaction; the external calls are effects (``ctx.effect``), so each is requested iff its step
commits, applied at most once per idempotency key by the service, and continued exactly once. :class:`Saga` makes
compensation explicit: a step that succeeded records its undo (a call inside the application, or an effect
to the outside world) in the order's state; :meth:`Saga.compensate` runs the recorded undos in reverse order
(calls at once, in the compensating transaction; effects requested by it, continued by ``then``) and forgets
them, so a saga completes or compensates, never both, never neither.

The handlers call ``<CHARON_SAGA_SERVICE_URL>/apply`` with ``{"key": idempotency key, "op", ...}``: an answer 402
is a decline (a final answer, not retried), a 5xx or a timeout is retried by the executor.

Clients invoke ``orders.place`` (and ``stock.fill`` to set up): both ``@op.function(public=True)``. The effect
continuations (``on_charged``, ``on_shipped``, ``on_compensated``) and the stock helpers (``reserve``,
``release``) are internal: only the saga's own steps run them, never a client (a forged ``on_charged`` would ship
an unpaid order).
"""

from __future__ import annotations

import os
from typing import Any

from charon import Application, Context, Operator

__all__ = ["Saga", "app", "orders", "stock"]

ORDERS, STOCK = "orders", "stock"
orders = Operator(ORDERS)
stock = Operator(STOCK)


class Saga:
    """The explicit compensation list of one saga, kept in its entity's item ``saga`` (see the module docstring).

    ``undo`` entries: ``{"call": [operator, key, function, args]}`` (run inside the compensating transaction) or
    ``{"effect": [handler, args]}`` (requested by it; its result resumes ``then``)."""

    ITEM = "saga"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def steps(self) -> list[dict[str, Any]]:
        steps: list[dict[str, Any]] = self.ctx.get_item(self.ITEM, [])
        return steps

    def done(self, step: str, *, call: list[Any] | None = None, effect: list[Any] | None = None) -> None:
        """Record that ``step`` succeeded and how to undo it (one of ``call`` or ``effect``)."""
        if (call is None) == (effect is None):
            raise ValueError("a step is undone by one call or one effect")
        undo = {"call": call} if call is not None else {"effect": effect}
        self.ctx.put_item(self.ITEM, [*self.steps(), {"step": step, **undo}])

    def finish(self) -> None:
        """The saga completed: nothing is left to undo."""
        self.ctx.delete_item(self.ITEM)

    async def compensate(self, *, then: str, carry: list[Any] | None = None) -> int:
        """Undo every recorded step, newest first; returns how many undo effects were requested (each resumes
        ``then(result, *carry)``)."""
        pending = 0
        for s in reversed(self.steps()):
            if "call" in s:
                op, key, fn, args = s["call"]
                await self.ctx.call(op, key, fn, *args)
            else:
                handler, args = s["effect"]
                self.ctx.effect(handler, *args, then=then, carry=carry or [], timeout=5.0, attempts=1000)
                pending += 1
        self.ctx.delete_item(self.ITEM)
        return pending


# -- stock ----------------------------------------------------------------------------------------------------
@stock.function
async def reserve(ctx: Context, qty: int) -> bool:
    have = ctx.get(0)
    if have < qty:
        return False
    ctx.put(have - qty)
    return True


@stock.function
async def release(ctx: Context, qty: int) -> int:
    ctx.put(ctx.get(0) + qty)
    return int(ctx.get(0))


@stock.function(public=True)
async def fill(ctx: Context, qty: int) -> None:
    ctx.put(qty)


# -- orders ---------------------------------------------------------------------------------------------------
def _set(ctx: Context, **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {**ctx.get({}), **changes}
    ctx.put(doc)
    return doc


@orders.function(public=True)
async def place(ctx: Context, customer: str, item: str, qty: int, amount: int, decline_charge: bool = False,
                fail_ship: bool = False) -> str:
    """Start the saga: reserve the stock (same transaction), then charge the card (an effect)."""
    if ctx.get() is not None:
        return str(ctx.get()["state"])  # placed already
    doc = {"customer": customer, "item": item, "qty": qty, "amount": amount, "fail_ship": fail_ship,
           "state": "reserving", "continued": 0}
    if not await ctx.call(stock, item, reserve, qty):
        ctx.put({**doc, "state": "rejected"})
        return "rejected"
    ctx.put({**doc, "state": "charging"})
    saga = Saga(ctx)
    saga.done("reserve", call=[STOCK, item, "release", [qty]])
    ctx.effect("charge", customer, amount, decline_charge, then=on_charged, timeout=5.0, attempts=20)
    return "charging"


@orders.function
async def on_charged(ctx: Context, result: dict) -> None:
    doc = ctx.get()
    doc["continued"] += 1
    ctx.put(doc)
    if result["ok"] and not result["value"]["declined"]:
        Saga(ctx).done("charge", effect=["refund", [doc["customer"], doc["amount"], ctx.key]])
        _set(ctx, state="shipping")
        ctx.effect("ship", ctx.key, doc["item"], doc["qty"], doc["fail_ship"], then=on_shipped, timeout=5.0,
                   attempts=20)
        return
    pending = await Saga(ctx).compensate(then="on_compensated")
    _set(ctx, state="compensating" if pending else "compensated", why="charge failed")


@orders.function
async def on_shipped(ctx: Context, result: dict) -> None:
    doc = _set(ctx, continued=ctx.get()["continued"] + 1)
    if result["ok"] and not result["value"]["declined"]:
        Saga(ctx).finish()
        _set(ctx, state="completed")
        return
    pending = await Saga(ctx).compensate(then="on_compensated")
    _set(ctx, state="compensating" if pending else "compensated", why="shipment failed", qty=doc["qty"])


@orders.function
async def on_compensated(ctx: Context, result: dict) -> None:
    doc = _set(ctx, continued=ctx.get()["continued"] + 1)
    _set(ctx, state="compensated" if result["ok"] else "compensation_failed",
         refund=result.get("value") if result["ok"] else result, why=doc.get("why", ""))


app = Application("saga", [orders, stock])


async def _apply(key: str, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(os.environ["CHARON_SAGA_SERVICE_URL"] + "/apply", json={"key": key, **body})
    if resp.status_code == 402:
        return {"declined": True}
    resp.raise_for_status()
    return {"declined": False}


@app.effect_handler("charge")
async def charge(key: str, customer: str, amount: int, decline: bool) -> dict[str, Any]:
    return await _apply(key, {"op": "charge", "customer": customer, "amount": amount, "decline": decline})


@app.effect_handler("ship")
async def ship(key: str, order: str, item: str, qty: int, fail: bool) -> dict[str, Any]:
    return await _apply(key, {"op": "ship", "order": order, "item": item, "qty": qty, "decline": fail})


@app.effect_handler("refund")
async def refund(key: str, customer: str, amount: int, order: str) -> dict[str, Any]:
    return await _apply(key, {"op": "refund", "customer": customer, "amount": amount, "order": order})
