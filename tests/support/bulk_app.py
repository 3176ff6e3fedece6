"""A test application of bulk operations (issue 34 item 5): orders waiting on promises, schedules with public
targets, a rate-limited function whose requests wait for admission, and an effect that fails (parked with
``--park-failed``) until a flag file exists."""

from __future__ import annotations

import os
from typing import Any

from charon import Application, Context, Limit, Operator

orders = Operator("orders")
ticks = Operator("ticks")
lim = Operator("lim")
FLAG = os.environ.get("BULK_APP_FLAG", "")


@orders.function(public=True)
async def place(ctx: Context, timeout: float = 3600.0) -> str:
    pid = ctx.promise(then=decided, carry=[ctx.key], timeout=timeout)
    ctx.put({"promise": pid, "runs": 0, "outcome": None})
    return pid


@orders.function
async def decided(ctx: Context, outcome: dict[str, Any], key: str) -> None:
    st = ctx.get()
    ctx.put({**st, "runs": st["runs"] + 1, "outcome": outcome})


@orders.function(public=True)
async def charge(ctx: Context) -> None:
    ctx.put({"charged": None, "runs": 0})
    ctx.effect("flaky", ctx.key, then=charged, timeout=5.0, attempts=1)


@orders.function
async def charged(ctx: Context, result: dict[str, Any]) -> None:
    st = ctx.get()
    ctx.put({**st, "charged": result, "runs": st["runs"] + 1})


@ticks.function(public=True)
async def count(ctx: Context, firing: dict[str, Any]) -> None:
    ctx.put(ctx.get(default=0) + 1)


@lim.function(public=True, limit=Limit(rate=0.001, burst=1, per="key", queue=1000))
async def take(ctx: Context, n: int) -> int:
    v = ctx.get(default=0) + n
    ctx.put(v)
    return v


app = Application("bulk", [orders, ticks, lim])


@app.effect_handler("flaky")
async def flaky(effect_id: str, key: str) -> str:
    if not (FLAG and os.path.exists(FLAG)):
        raise ConnectionError(f"the service is down for {key}")
    return "charged"
