"""The contract suite's application (tests/contract): accounts that deposit, transfer (a call), hold money under a
timer, emit their deposits to a stream, fail on purpose, wait on promises and for admission, and a workflow
(``approve``: a deposit, then a durable promise awaited, then a deposit of its value). ``v1`` and ``v2``
differ only in the version their ``deposit`` reports (a compatible state format), so a code update is visible in
every reply."""

from __future__ import annotations

from typing import Any

from charon import Application, Context, Limit, Operator, Workflow


def _version(label: str) -> Application:
    acct = Operator("acct")

    @acct.function(public=True)
    async def deposit(ctx: Context, amount: int) -> list:
        """Add ``amount``, emit ``[key, amount]`` on ``deposits``; returns ``[version, balance]``."""
        b = ctx.get(default=0) + amount
        ctx.put(b)
        ctx.emit("deposits", [ctx.key, amount])
        return [label, b]

    @acct.function(public=True)
    async def transfer(ctx: Context, to: str, amount: int) -> int:
        """Move ``amount`` to ``to`` (aborts with ValueError when the balance is short); returns the balance."""
        b = ctx.get(default=0)
        if amount <= 0 or b < amount or to == ctx.key:
            raise ValueError(f"cannot transfer {amount} of {b}")
        ctx.put(b - amount)
        await ctx.call(acct, to, "deposit", amount)
        return b - amount

    @acct.function(public=True)
    async def hold(ctx: Context, tag: str, amount: int, seconds: float) -> str:
        """Take ``amount`` into a hold released by a timer after ``seconds``; returns the timer id."""
        b = ctx.get(default=0)
        if amount <= 0 or b < amount:
            raise ValueError(f"cannot hold {amount} of {b}")
        timer = ctx.send_after(seconds, acct, ctx.key, "release", tag, amount)
        ctx.put(b - amount)
        ctx.put_item("hold:" + tag, amount)
        return timer

    @acct.function(public=True)
    async def release(ctx: Context, tag: str, amount: int) -> int:
        """The hold's timer: give ``amount`` back and count this tag's firings in an item."""
        n = ctx.get_item("fired:" + tag, 0) + 1
        ctx.put_item("fired:" + tag, n)
        ctx.delete_item("hold:" + tag)
        ctx.put(ctx.get(default=0) + amount)
        return n

    @acct.function(public=True)
    async def wait(ctx: Context, timeout: float) -> str:
        """Wait on a durable promise (bulk cancels); its continuation counts its runs in an item."""
        return ctx.promise(then=woken, carry=[], timeout=timeout)

    @acct.function
    async def woken(ctx: Context, outcome: dict[str, Any]) -> None:
        ctx.put_item("woken", [*ctx.get_item("woken", []), outcome.get("error_type")])

    @acct.function(public=True, limit=Limit(rate=0.001, burst=1, per="key"))
    async def queued(ctx: Context, n: int) -> int:
        """At most one per key and ~17 minutes: the others wait for admission (bulk cancels)."""
        ctx.put_item("queued", ctx.get_item("queued", 0) + n)
        return n

    approve = Workflow("approve", version=label, backoff=0.2)

    @approve.step(first=True)
    async def ask(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
        """Deposit the input's ``amount`` into its ``acct``, then await an approver's promise."""
        order = outcome["value"]
        w.state.update(order, ran=[f"{label}:ask"])
        await ctx.call(acct, order["acct"], "deposit", order["amount"])
        return w.promise(then=approved, timeout=600.0)

    @approve.step
    async def approved(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
        """Deposit the promise's value (a number) too; done with the versions that ran each step."""
        if not outcome["ok"]:
            return w.fail(outcome.get("error_type", "rejected"))
        await ctx.call(acct, w.state["acct"], "deposit", outcome["value"])
        return w.done([*w.state["ran"], f"{label}:approved"])

    app = Application("contract", [acct], workflows=[approve])
    app.version = label  # type: ignore[attr-defined]  # the label the runtime reports before any update
    return app


v1 = _version("v1")
v2 = _version("v2")
