"""A saga on a workflow (issue 34 item 4; first built over bare effects for issue 23 item 3): order -> reserve
stock -> charge the card through an external service -> ship through an external service; a failed charge
releases the stock; a failed shipment releases the stock and refunds the card.

The saga is the workflow ``saga`` (:class:`charon.Workflow`) with three steps, each one transaction: ``reserve``
takes the stock (its undo: a ``release`` call) and awaits the ``charge`` effect; ``charged`` records the refund as
an undo effect and awaits the ``ship`` effect, or compensates; ``shipped`` ends the workflow ``done`` or
compensates. ``w.compensate()`` runs the undos newest first (the release in the compensating transaction, the
refund an effect it awaits), then ends the workflow ``compensated``: a saga completes or compensates, never both,
never neither. Each effect is requested iff its step commits, applied at most once per idempotency key by the
service, and delivered to the next step exactly once.

The handlers call ``<CHARON_SAGA_SERVICE_URL>/apply`` with ``{"key": idempotency key, "op", ...}``: an answer 402
is a decline (a final answer, not retried), a 5xx or a timeout is retried by the executor.

Clients invoke ``orders.place`` (and ``stock.fill`` to set up): both ``@op.function(public=True)``; ``place``
starts the order's workflow (id: the order's key) in its own transaction, iff it commits. The workflow's own
functions and the stock helpers (``reserve``, ``release``) are internal: only the saga's steps run them, never a
client (a forged delivery would ship an unpaid order). Its progress: ``GET /workflows/saga/{order}``.
"""

from __future__ import annotations

import os
from typing import Any

from charon import Application, Context, Operator, Workflow
from charon.core.workflows import WorkflowHandle

__all__ = ["app", "orders", "saga", "stock"]

ORDERS, STOCK = "orders", "stock"
orders = Operator(ORDERS)
stock = Operator(STOCK)
saga = Workflow("saga")


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
@orders.function(public=True)
async def place(ctx: Context, customer: str, item: str, qty: int, amount: int, decline_charge: bool = False,
                fail_ship: bool = False) -> str:
    """Start the order's saga (a workflow whose id is the order's key), iff this transaction commits."""
    if ctx.get() is not None:
        return str(ctx.get()["workflow"])  # placed already
    order = {"order": ctx.key, "customer": customer, "item": item, "qty": qty, "amount": amount,
             "decline_charge": decline_charge, "fail_ship": fail_ship}
    wid = saga.start(ctx, order, id=ctx.key)
    ctx.put({**order, "workflow": wid})
    return wid


# -- the saga's steps -----------------------------------------------------------------------------------------
@saga.step(first=True)
async def take_stock(ctx: Context, w: WorkflowHandle, outcome: dict[str, Any]) -> Any:
    o = w.state["order"] = outcome["value"]
    if not await ctx.call(stock, o["item"], reserve, o["qty"]):
        return w.done("rejected")
    w.undo(stock, o["item"], release, o["qty"])
    return w.effect("charge", o["customer"], o["amount"], o["decline_charge"], then=charged, timeout=5.0,
                    attempts=20)


@saga.step
async def charged(ctx: Context, w: WorkflowHandle, result: dict[str, Any]) -> Any:
    o = w.state["order"]
    if not result["ok"] or result["value"]["declined"]:
        w.state["why"] = "charge failed"
        return w.compensate()
    w.undo_effect("refund", o["customer"], o["amount"], o["order"], timeout=5.0, attempts=1000)
    return w.effect("ship", o["order"], o["item"], o["qty"], o["fail_ship"], then=shipped, timeout=5.0,
                    attempts=20)


@saga.step
async def shipped(ctx: Context, w: WorkflowHandle, result: dict[str, Any]) -> Any:
    if not result["ok"] or result["value"]["declined"]:
        w.state["why"] = "shipment failed"
        return w.compensate()
    return w.done("completed")


app = Application("saga", [orders, stock], workflows=[saga])


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
