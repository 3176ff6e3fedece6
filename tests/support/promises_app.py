"""A test application of durable promises: an order waits for an approval from outside (or another entity)."""

from __future__ import annotations

from typing import Any

from charon import Application, Context, Operator

orders = Operator("orders")


@orders.function(public=True)
async def place(ctx: Context, timeout: float = 3600.0) -> str:
    pid = ctx.promise(then=decided, carry=[ctx.key], timeout=timeout)
    ctx.put({"promise": pid, "runs": 0, "outcome": None})
    return pid


@orders.function
async def decided(ctx: Context, outcome: dict[str, Any], key: str) -> None:
    st = ctx.get()
    assert key == ctx.key
    ctx.put({**st, "runs": st["runs"] + 1, "outcome": outcome})


@orders.function(public=True)
async def approve(ctx: Context, pid: str, value: Any = None) -> dict[str, Any]:
    """Resolve another order's promise from this transaction."""
    ctx.put({"approved": pid})
    return await ctx.resolve_promise(pid, value)


@orders.function(public=True)
async def doomed(ctx: Context) -> str:
    ctx.promise(then=decided, carry=[ctx.key])
    raise RuntimeError("this transaction aborts: its promise never exists")


app = Application("approvals", [orders])
