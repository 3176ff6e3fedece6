"""Functions that attack the watchdog's soundness (issue 31): each one is what an ordinary application may do around
its time budget (test_watchdog_soundness, test_watchdog_torture, the repros of ../shared/repros)."""

from __future__ import annotations

import logging
import time

from charon import Application, Context, Operator

acc = Operator("acc")

log = logging.getLogger("soundness.app")


class QuietHandler(logging.Handler):
    """A handler whose emit does no I/O (as a memory or queue handler): its lock is what an interrupt could leak."""

    def emit(self, record: logging.LogRecord) -> None:
        pass


handler = QuietHandler()
log.addHandler(handler)
log.setLevel(logging.INFO)
log.propagate = False


def burn(seconds: float) -> None:
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        pass


class SlowMessage(Exception):
    """An exception whose message is costly to build (a big payload with Python reprs)."""

    def __str__(self) -> str:
        burn(1.0)
        return "slow message"


def _nested(n: int) -> None:
    if n == 0:
        raise ValueError("card declined")
    _nested(n - 1)


@acc.function(public=True)
async def inc(ctx: Context, n: int = 1) -> int:
    v = ctx.get(default=0) + n
    ctx.put(v)
    return v


@acc.function(public=True)
async def slow_str_boom(ctx: Context) -> None:
    raise SlowMessage()


@acc.function(public=True)
async def work_then_raise(ctx: Context, seconds: float) -> None:
    burn(seconds)
    _nested(20)


@acc.function(public=True)
async def caught(ctx: Context, kind: str, seconds: float) -> str:
    """Catches the interrupt the way application code does; the outcome must be the verdict anyway."""
    outcome = "full"
    if kind == "bare":
        try:
            burn(seconds)
        except:  # noqa: E722 - the mistake under test
            outcome = "partial"
    elif kind == "base":
        try:
            burn(seconds)
        except BaseException:  # noqa: BLE001 - the mistake under test
            outcome = "partial"
    else:  # a finally that keeps working after the interrupt
        try:
            burn(seconds)
        finally:
            burn(0.05)
    ctx.put(outcome)
    return outcome


@acc.function(public=True)
async def chatty(ctx: Context, lines: int) -> int:
    """Logs ``lines`` lines through a handler with a lock (a few microseconds each), unless it is interrupted."""
    for n in range(lines):
        log.info("step %d", n)
    ctx.put(lines)
    return lines


@acc.function(public=True)
async def spin(ctx: Context) -> None:
    ctx.put(-1)
    while True:
        pass


@acc.function(public=True)
async def slow(ctx: Context, seconds: float, n: int) -> int:
    burn(seconds)
    ctx.put(n)
    return n


@acc.function(public=True)
async def noop(ctx: Context) -> int:
    return 0


@acc.function(public=True)
async def hog(ctx: Context, steps: int, seconds: float) -> int:
    """Each step below the budget, the transaction far past it."""
    for i in range(steps):
        burn(seconds)
        await ctx.call(acc, f"other{i % 2}", noop)
    return steps


@acc.function(public=True)
async def quick(ctx: Context) -> str:
    return "quick"


app = Application("soundness", [acc])
