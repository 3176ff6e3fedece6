"""An application with admission limits, for the Spark differential test (executors import it by name)."""

from charon import Application, Context, Limit, Operator

lim = Operator("lim")


@lim.function(public=True, limit=Limit(concurrency=2, rate=20.0, burst=3, per="key", priority="arg:1", queue=6))
async def take(ctx: Context, n: int, prio: int) -> int:
    v = ctx.get(default=0) + n
    ctx.put(v)
    return v


app = Application("admit", [lim])
