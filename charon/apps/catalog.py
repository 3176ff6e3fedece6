"""A small catalog application exercising per-entity ordered items (prefix and range scans).

Used by the state-layer tests on both runtimes; it is also a compact example of an index kept in items.
"""

from __future__ import annotations

from charon import Application, Context, Operator

shelf = Operator("shelf")


@shelf.function(public=True)
async def stock(ctx: Context, sku: str, qty: int) -> int:
    """Add ``qty`` of ``sku`` (an item of this shelf); returns the new quantity."""
    n: int = ctx.get_item(sku, 0) + qty
    if n < 0:
        raise ValueError(f"not enough {sku}")
    if n == 0:
        ctx.delete_item(sku)
    else:
        ctx.put_item(sku, n)
    ctx.put(ctx.get(default=0) + qty)  # the shelf's total, as its main value
    return n


@shelf.function(public=True)
async def restock_and_list(ctx: Context, skus: list[str], prefix: str) -> list[list[object]]:
    """Stock each sku once, then list the items with ``prefix`` (own writes are visible to the scan)."""
    for s in skus:
        ctx.put_item(s, ctx.get_item(s, 0) + 1)
    return [[k, v] for k, v in ctx.scan_items(prefix)]


@shelf.function(public=True)
async def between(ctx: Context, start: str, stop: str) -> list[list[object]]:
    """Items with names in [start, stop)."""
    return [[k, v] for k, v in ctx.scan_items(start=start, stop=stop)]


@shelf.function(public=True)
async def move(ctx: Context, sku: str, to: str, qty: int) -> int:
    """Move stock to another shelf in one transaction (raises, so nothing moves, when short)."""
    left = await ctx.call(shelf, ctx.key, stock, sku, -qty)
    await ctx.call(shelf, to, stock, sku, qty)
    return left


app = Application("catalog", [shelf])
