"""Two versions of one application, for the code-update tests: v1 keeps a balance as an int, v2 as
``{"balance": int, "currency": str}`` (its ``migrate`` converts an entity); every function reports its version."""

from __future__ import annotations

from charon import Application, Context, Operator

account_v1 = Operator("account")


@account_v1.function
async def deposit(ctx: Context, amount: int) -> list:
    """v1: an int balance."""
    value = ctx.get(default=0)
    if not isinstance(value, int):
        raise TypeError(f"v1 saw migrated state {value!r}")
    ctx.put(value + amount)
    return ["v1", value + amount]


v1 = Application("bank", [account_v1])

account_v2 = Operator("account")


@account_v2.function  # type: ignore[no-redef]
async def deposit(ctx: Context, amount: int) -> list:  # noqa: F811
    """v2: a record with a currency (requires the migration)."""
    value = ctx.get()
    if not isinstance(value, dict):
        raise TypeError(f"v2 saw unmigrated state {value!r}")
    value = {**value, "balance": value["balance"] + amount}
    ctx.put(value)
    return ["v2", value["balance"]]


@account_v2.function
async def migrate(ctx: Context, currency: str) -> None:
    """Convert an int balance to a record (idempotent)."""
    value = ctx.get(default=0)
    if isinstance(value, int):
        ctx.put({"balance": value, "currency": currency})


v2 = Application("bank", [account_v2])
