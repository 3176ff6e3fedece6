"""Fast (call-graph-cached) fallback round: a lower candidate's write outside its dry-run read/write set
leaks through the partition's fast layer to a higher transaction that then commits."""
from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.core.routing import partition_of
from charon.testing import check_epoch

acct = Operator("acct")

@acct.function(public=True)
async def setall(ctx: Context, v: int, other: str) -> int:   # L
    ctx.put(v)
    await ctx.call(acct, other, "setv", v * 2)
    return 0

@acct.function(public=True)
async def setv(ctx: Context, v: int) -> int:
    ctx.put(v)
    return 0

@acct.function(public=True)
async def getv(ctx: Context) -> int:
    return ctx.get(default=0)

@acct.function(public=True)
async def a_fn(ctx: Context, other: str) -> int:             # A: writes only when the state says so
    x = ctx.get(default=0)
    v = await ctx.call(acct, other, "getv")
    if x > 3:
        ctx.put(x * 100 + v)
    return 0

@acct.function(public=True)
async def b_fn(ctx: Context) -> int:                          # B: a pure read of E
    return ctx.get(default=0)

app = Application("leak", [acct])
P = 2
E, C = "E", "C"
assert partition_of("acct", E, P) != partition_of("acct", C, P), "need E and C on different partitions"

def req(i, key, fn, *args):
    return Request(f"r{i}", "acct", key, fn, serde.encode(list(args)), ts=1.0 + i)

rt = InProcessRuntime(app, partitions=P)
before = rt.snapshot()
res = rt.run_epoch([req(0, E, "setall", 5, C), req(1, E, "a_fn", C), req(2, E, "b_fn")])
print("lockfree", res.lockfree, "fast", res.fast, "slow", res.slow, "deferred", res.deferred)
for tid, r in sorted(res.replies.items()):
    print(" tid", tid, r.ok, serde.decode(r.value) if r.ok else (r.error_type, r.error_message))
try:
    check_epoch(app, before, rt.snapshot(), res)
    print("epoch 0: oracle OK")
except AssertionError as e:
    print("epoch 0: ORACLE MISMATCH:", e)
for r2 in rt.drain():
    print("drained epoch", r2.epoch, {t: serde.decode(r.value) for t, r in r2.replies.items()})
print("final E =", rt.read_state("acct", E), "C =", rt.read_state("acct", C))
