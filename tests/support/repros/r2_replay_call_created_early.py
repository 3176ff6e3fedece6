"""Journal replay switches to live mode when ctx.call() *returns* the last journaled reply, not when it
is awaited. Code between creating a call and awaiting it (a send, a read, a write) is re-executed live on
replay: sends are emitted twice, and extra reads are appended to the journal, shifting later replays.
Live-coroutine resume (the in-process default) is correct; journal replay (any Spark round that lands in
another worker) is not, so the outcome depends on scheduling."""
import sys
from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.core import partition
from charon.testing import check_epoch

acct = Operator("acct")

@acct.function(public=True)
async def getv(ctx: Context) -> int:
    return ctx.get(default=0)

@acct.function(public=True)
async def add(ctx: Context, n: int) -> int:
    ctx.put(ctx.get(default=0) + n)
    return 0

@acct.function(public=True)
async def early_send(ctx: Context) -> int:
    c = ctx.call(acct, "B", getv)          # call created ...
    ctx.send(acct, "C", add, 10)           # ... an async call in between ...
    return await c                         # ... awaited here

@acct.function(public=True)
async def early_read(ctx: Context) -> list:
    c1 = ctx.call(acct, "B", getv)
    a = ctx.get_item("a", 0)               # read between creating and awaiting the call
    v1 = await c1
    b = ctx.get_item("b", 0)
    v2 = await ctx.call(acct, "B", getv)
    return [a, b, v1, v2]

app = Application("early", [acct])

for live in (True, False):
    partition.KEEP_LIVE_COROUTINES = live
    for parts in (1, 2):
        rt = InProcessRuntime(app, partitions=parts)
        rt.load_items("acct", "A2", {"a": 1, "b": 2})
        before = rt.snapshot()
        res = rt.run_epoch([Request("s", "acct", "A", "early_send", serde.encode([]), ts=1.0),
                            Request("r", "acct", "A2", "early_read", serde.encode([]), ts=2.0)])
        vals = {t: serde.decode(r.value) if r.ok else r.error_type for t, r in res.replies.items()}
        try:
            check_epoch(app, before, rt.snapshot(), res); verdict = "oracle OK"
        except AssertionError as e:
            verdict = f"ORACLE MISMATCH: {e}"
        print(f"live={live} partitions={parts}: C={rt.read_state('acct', 'C')} replies={vals} -> {verdict}")
