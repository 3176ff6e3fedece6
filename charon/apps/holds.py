"""Payment holds that expire: an example of timers (``ctx.send_after`` / ``ctx.cancel_timer``).

``hold`` moves money from an account's balance into a hold and registers a timer that releases it after a
while; ``capture`` cancels that timer and pays the held money to another account. Money is conserved
(balances plus holds), and each release counts its firings in an item, so a timer that fired twice (or a
hold released twice) shows in the state. Used by the timer tests on both runtimes.

The timer targets ``release`` and ``noted`` are internal (only their timers run them: a client calling
``release`` would free a hold early); every other function is public (``@op.function(public=True)``).
"""

from __future__ import annotations

from charon import Application, Context, Operator

acct = Operator("acct")


@acct.function(public=True)
async def deposit(ctx: Context, amount: int) -> int:
    """Add ``amount`` to the balance; returns the new balance."""
    b: int = ctx.get(default=0) + amount
    ctx.put(b)
    return b


@acct.function(public=True)
async def transfer(ctx: Context, to: str, amount: int) -> int:
    """Move ``amount`` to ``to`` (aborts if the balance is short); returns the new balance."""
    b: int = ctx.get(default=0)
    if amount <= 0 or b < amount or to == ctx.key:
        raise ValueError(f"cannot transfer {amount} of {b}")
    ctx.put(b - amount)
    await ctx.call(acct, to, deposit, amount)
    return b - amount


@acct.function(public=True)
async def hold(ctx: Context, tag: str, amount: int, seconds: float) -> str:
    """Hold ``amount`` for ``seconds``, then release it (unless captured); returns the timer id."""
    b = ctx.get(default=0)
    if amount <= 0 or b < amount:
        raise ValueError(f"cannot hold {amount} of {b}")
    if ctx.get_item("hold:" + tag) is not None:
        raise ValueError(f"hold {tag} exists")
    timer = ctx.send_after(seconds, acct, ctx.key, release, tag)
    ctx.put(b - amount)
    ctx.put_item("hold:" + tag, [timer, amount])
    return timer


@acct.function
async def release(ctx: Context, tag: str) -> int:
    """The timer of a hold: give the held amount back; returns how often this tag's timer fired."""
    n: int = ctx.get_item("fired:" + tag, 0) + 1
    ctx.put_item("fired:" + tag, n)
    h = ctx.get_item("hold:" + tag)
    if h is not None:
        ctx.delete_item("hold:" + tag)
        ctx.put(ctx.get(default=0) + h[1])
    return n


@acct.function(public=True)
async def capture(ctx: Context, tag: str, to: str) -> bool:
    """Cancel the hold's timer and pay the held amount to ``to``; False if the hold was released already."""
    h = ctx.get_item("hold:" + tag)
    if h is None or not ctx.cancel_timer(h[0]):
        return False
    ctx.delete_item("hold:" + tag)
    await ctx.call(acct, to, deposit, h[1])
    return True


@acct.function(public=True)
async def remind(ctx: Context, to: str, note: str, at: float) -> str:
    """A timer that calls another entity (``to.noted(note)``) at time ``at``; returns its id."""
    return ctx.send_at(at, acct, to, noted, note)


@acct.function
async def noted(ctx: Context, note: str) -> int:
    """Count ``note``; returns its count."""
    n: int = ctx.get_item("note:" + note, 0) + 1
    ctx.put_item("note:" + note, n)
    return n


@acct.function(public=True)
async def doomed(ctx: Context, seconds: float) -> None:
    """Register a timer, then abort: the timer must never exist."""
    ctx.send_after(seconds, acct, ctx.key, noted, "doomed")
    raise ValueError("aborted after registering a timer")


@acct.function(public=True)
async def pending(ctx: Context) -> list[list[object]]:
    """This account's pending timers: [id, due, function] each."""
    return [[t.id, t.due, t.function] for t in ctx.timers()]


@acct.function(public=True)
async def cancel(ctx: Context, timer: str) -> bool:
    """Cancel one of this account's timers by id."""
    return ctx.cancel_timer(timer)


app = Application("holds", [acct])
