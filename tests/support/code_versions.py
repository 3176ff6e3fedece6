"""Two versions of one application, for the code-update tests: v1 keeps a balance as an int, v2 as
``{"balance": int, "currency": str}`` (its ``migrate`` converts an entity); every function reports its version."""

from __future__ import annotations

from charon import Application, Context, Operator

account_v1 = Operator("account")


@account_v1.function(public=True)
async def deposit(ctx: Context, amount: int) -> list:
    """v1: an int balance."""
    value = ctx.get(default=0)
    if not isinstance(value, int):
        raise TypeError(f"v1 saw migrated state {value!r}")
    ctx.put(value + amount)
    return ["v1", value + amount]


v1 = Application("bank", [account_v1])

account_v2 = Operator("account")


@account_v2.function(public=True)  # type: ignore[no-redef]
async def deposit(ctx: Context, amount: int) -> list:  # noqa: F811
    """v2: a record with a currency (requires the migration)."""
    value = ctx.get()
    if not isinstance(value, dict):
        raise TypeError(f"v2 saw unmigrated state {value!r}")
    value = {**value, "balance": value["balance"] + amount}
    ctx.put(value)
    return ["v2", value["balance"]]


@account_v2.function(public=True)
async def migrate(ctx: Context, currency: str) -> None:
    """Convert an int balance to a record (idempotent)."""
    value = ctx.get(default=0)
    if isinstance(value, int):
        ctx.put({"balance": value, "currency": currency})


v2 = Application("bank", [account_v2])


# -- compatible versions (same state format): each function reports its version and its callee's ------------
def _compatible(label: str) -> Application:
    op = Operator("acct")

    @op.function(public=True)
    async def deposit(ctx: Context, amount: int) -> str:
        ctx.put(ctx.get(default=0) + amount)
        return label

    @op.function(public=True)
    async def route(ctx: Context, base: str) -> list:
        """The callee depends on the state read, so contended runs defer some transactions."""
        v = ctx.get(default=0)
        callee = await ctx.call(op, f"{base}{v % 3}", "deposit", 1)
        ctx.put(v + 1)
        return [label, callee]

    @op.function(public=True)
    async def transfer(ctx: Context, to: str, amount: int) -> list:
        ctx.put(ctx.get(default=0) - amount)
        callee = await ctx.call(op, to, "deposit", amount)
        return [label, callee]

    app = Application("compat", [op])
    app.version = label  # type: ignore[attr-defined]  # the label the runtime reports before any update
    return app


c1 = _compatible("c1")
c2 = _compatible("c2")
