"""A test application of workflows: a checkout takes stock, charges a card (an effect), waits for an approval (a
durable promise) and a timer, then ships; a declined card or a rejected approval compensates (gives the stock
back). Each step counts its own runs in ``steps`` (a transaction of its own: counted once iff it committed)."""

from __future__ import annotations

from typing import Any

from charon import Application, Context, Operator, Workflow

stock = Operator("stock")
steps = Operator("steps")
checkout = Workflow("checkout", backoff=0.2)


@stock.function(public=True)
async def put(ctx: Context, n: int) -> int:
    ctx.put((ctx.get() or 0) + n)
    return int(ctx.get())


@stock.function
async def take(ctx: Context, n: int) -> int:
    have = ctx.get() or 0
    if have < n:
        raise ValueError(f"only {have} left")
    ctx.put(have - n)
    return have - n


@stock.function
async def give(ctx: Context, n: int) -> int:
    ctx.put((ctx.get() or 0) + n)
    return int(ctx.get())


@steps.function
async def count(ctx: Context, step: str) -> None:
    st = ctx.get() or {}
    st[step] = st.get(step, 0) + 1
    ctx.put(st)


async def _count(ctx: Context, w: Any, step: str) -> None:
    await ctx.call(steps, w.id, count, step)


@checkout.step(first=True)
async def reserve(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
    order = outcome["value"]
    await _count(ctx, w, "reserve")
    await ctx.call(stock, order["sku"], take, order["qty"])
    w.undo(stock, order["sku"], give, order["qty"])
    w.state.update(order=order)
    return w.effect("charge", order["card"], order["amount"], then=charged)


@checkout.step
async def charged(ctx: Context, w: Any, result: dict[str, Any]) -> Any:
    await _count(ctx, w, "charged")
    if not result["ok"] or not result["value"]["ok"]:
        return w.compensate()
    w.state["charge"] = result["value"]["charge"]
    if w.state["order"].get("approval"):
        return w.promise(then=approved, timeout=3600)
    return w.sleep(0.2, then=ship)


@checkout.step
async def approved(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
    await _count(ctx, w, "approved")
    if not outcome["ok"]:
        return w.compensate()
    return w.sleep(0.2, then=ship)


@checkout.step
async def ship(ctx: Context, w: Any, _: dict[str, Any]) -> Any:
    await _count(ctx, w, "ship")
    flaky = w.state["order"].get("flaky")
    if flaky == "always" or (flaky and w.attempt == 1):
        raise RuntimeError("the shipping step aborts")  # its transaction aborts: the next attempt runs
    return w.done({"shipped": w.state["order"]["sku"], "charge": w.state["charge"]})


@steps.function(public=True)
async def begin(ctx: Context, order: dict[str, Any]) -> str:
    """Start a checkout from a transaction (created iff it commits)."""
    wid = checkout.start(ctx, order)
    ctx.put({"wid": wid})
    if order.get("abort"):
        raise RuntimeError("this transaction aborts: its workflow never exists")
    return wid


def charge(key: str, card: str, amount: int) -> dict[str, Any]:
    return {"ok": card != "declined", "charge": f"ch-{key}"}


app = Application("shop", [stock, steps], workflows=[checkout], effects={"charge": charge})
