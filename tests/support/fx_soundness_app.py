"""The application of the effect soundness tests (issue 31 item 6; ../shared/repros r3 and r11): ``orders/<k>.place``
charges a card through an effect whose continuation ``on_charged`` records the outcome and counts its runs;
``orders/<k>.big(size)`` asks for a handler value of ``size`` bytes; ``orders/<k>.noop`` is any other call."""

from __future__ import annotations

import asyncio

from charon import Application, Context, Operator

orders = Operator("orders")


@orders.function(public=True)
async def place(ctx: Context, amount: int) -> str:
    ctx.put({"state": "charging", "amount": amount})
    return ctx.effect("charge", amount, then=on_charged, carry=[amount], timeout=5.0, attempts=3)


@orders.function
async def on_charged(ctx: Context, result: dict, amount: int) -> None:
    runs = (ctx.get({}) or {}).get("runs", 0) + 1
    ctx.put({"state": "paid" if result["ok"] else "declined", "amount": amount, "runs": runs,
             "error_type": result.get("error_type", "")})


@orders.function(public=True)
async def big(ctx: Context, size: int) -> str:
    ctx.put({"state": "waiting"})
    return ctx.effect("bigresult", size, then=on_big, carry=[size], timeout=10.0, attempts=2)


@orders.function
async def on_big(ctx: Context, result: dict, size: int) -> None:
    runs = (ctx.get({}) or {}).get("runs", 0) + 1
    ctx.put({"state": "done", "ok": result["ok"], "runs": runs, "error_type": result.get("error_type", ""),
             "len": len(result["value"]) if result["ok"] else -1})


@orders.function(public=True)
async def noop(ctx: Context) -> int:
    return 0


@orders.function(public=True)
async def peek(ctx: Context) -> object:
    return ctx.get()


app = Application("fxsound", [orders])


@app.effect_handler("charge")
async def charge(idempotency_key: str, amount: int) -> dict:
    await asyncio.sleep(0.3)  # the card service's latency: a squatter has time to go first
    return {"charged": amount}


@app.effect_handler("bigresult")
async def bigresult(idempotency_key: str, size: int) -> str:
    return "x" * size
