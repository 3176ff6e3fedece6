"""An ordinary counter beside a function that never returns (tests/faults/test_spark_restart_budget.py)."""
from charon import Application, Context, Operator

acct = Operator("acct")


@acct.function(public=True)
async def add(ctx: Context, n: int) -> int:
    v = ctx.get(default=0) + n
    ctx.put(v)
    return v


@acct.function(public=True)
async def churn(ctx: Context, n: int) -> int:
    x = 0
    while n != -1:  # never ends: pure bytecode, no I/O, no ctx call
        x = (x * 31 + n) % 1_000_003
    return x


app = Application("spin", [acct])
