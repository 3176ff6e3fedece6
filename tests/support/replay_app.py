"""Functions that create calls before awaiting them, in every pattern replay must get exactly right.

Each scenario is a function of operator ``s`` run on a root key ``k``; it touches only entities named
``k.*`` of operator ``acct`` (so scenarios of one epoch do not conflict). ``SCENARIOS`` lists them with what
must hold afterwards beyond the oracle (a send sent once, a call awaited long after it was created, ...).
"""

from __future__ import annotations

from charon import Application, Context, Operator

acct = Operator("acct")
s = Operator("s")


@acct.function(public=True)
async def getv(ctx: Context) -> int:
    return ctx.get(default=0)


@acct.function(public=True)
async def add(ctx: Context, n: int) -> int:
    v = ctx.get(default=0) + n
    ctx.put(v)
    return v


@acct.function(public=True)
async def early(ctx: Context, k: str) -> int:
    """A callee that itself creates a call, sends, and awaits later (nested suspension)."""
    c = ctx.call(acct, f"{k}.B", add, 1)
    ctx.send(acct, f"{k}.C", add, 10)
    ctx.put(ctx.get(default=0) + 1)
    return await c + ctx.get()


@s.function(public=True)
async def early_send(ctx: Context) -> int:
    k = ctx.key
    c = ctx.call(acct, f"{k}.B", getv)
    ctx.send(acct, f"{k}.C", add, 10)
    return await c


@s.function(public=True)
async def early_read(ctx: Context) -> list:
    k = ctx.key
    c1 = ctx.call(acct, f"{k}.B", getv)
    a = ctx.get_item("a", 0)
    v1 = await c1
    b = ctx.get_item("b", 0)
    v2 = await ctx.call(acct, f"{k}.B", getv)
    return [a, b, v1, v2]


@s.function(public=True)
async def early_write(ctx: Context) -> int:
    k = ctx.key
    c = ctx.call(acct, f"{k}.B", add, 1)
    ctx.put(ctx.get(default=0) + 100)
    v = await c
    ctx.put(ctx.get() + v)
    return ctx.get()


@s.function(public=True)
async def reversed_awaits(ctx: Context) -> list:
    k = ctx.key
    c1 = ctx.call(acct, f"{k}.B", add, 1)
    c2 = ctx.call(acct, f"{k}.D", add, 2)
    v2 = await c2
    ctx.put_item("between", ctx.get_item("a", 0) + v2)
    v1 = await c1
    return [v1, v2, ctx.get_item("between")]


@s.function(public=True)
async def await_twice(ctx: Context) -> list:
    k = ctx.key
    c = ctx.call(acct, f"{k}.B", add, 1)
    v1 = await c
    v2 = await c
    v3 = await ctx.call(acct, f"{k}.D", add, 1)
    v4 = await c
    return [v1, v2, v3, v4]


@s.function(public=True)
async def created_before_suspension(ctx: Context) -> list:
    k = ctx.key
    c1 = ctx.call(acct, f"{k}.B", add, 1)
    v2 = await ctx.call(acct, f"{k}.D", add, 5)
    ctx.send(acct, f"{k}.C", add, 1)
    a = ctx.get_item("a", 0)
    v1 = await c1
    return [v1, v2, a]


@s.function(public=True)
async def never_awaited(ctx: Context) -> list:
    k = ctx.key
    c0 = ctx.call(acct, f"{k}.B", add, 1000)  # created first, awaited only at the end
    r = ctx.random()
    v = await ctx.call(acct, f"{k}.D", add, 1)
    ctx.put(int(r * 1000))
    c2 = ctx.call(acct, f"{k}.C", add, 1000)
    late = await ctx.gather(c2, c0)
    return [v, int(r * 1000), int(ctx.random() * 1000), late]


@s.function(public=True)
async def gather_early(ctx: Context) -> list:
    k = ctx.key
    c1 = ctx.call(acct, f"{k}.B", add, 1)
    c2 = ctx.call(acct, f"{k}.D", add, 2)
    a = ctx.get_item("a", 0)
    ctx.send(acct, f"{k}.C", add, 3)
    vals = await ctx.gather(c1, c2)
    b = ctx.get_item("b", 0)
    more = await ctx.gather(c1, ctx.call(acct, f"{k}.E", add, 3), c2)  # c1, c2 already have values
    twice = ctx.call(acct, f"{k}.F", add, 1)
    dup = await ctx.gather(twice, twice)  # one call, sent once
    return [a, b, vals, more, dup]


@s.function(public=True)
async def random_between(ctx: Context) -> list:
    k = ctx.key
    c = ctx.call(acct, f"{k}.B", getv)
    r = ctx.random()
    ctx.send(acct, f"{k}.C", add, int(r * 100))
    ctx.put(int(r * 1000))
    v = await c
    r2 = ctx.random()
    return [int(r * 1000), int(r2 * 1000), v]


@s.function(public=True)
async def scan_between(ctx: Context) -> list:
    k = ctx.key
    c = ctx.call(acct, f"{k}.B", add, 1)
    first = ctx.scan_items()
    ctx.put_item("z", len(first))
    v = await c
    second = ctx.scan_items()
    return [len(first), len(second), v]


@s.function(public=True)
async def finally_block(ctx: Context) -> list:
    k = ctx.key
    c1 = ctx.call(acct, f"{k}.B", add, 1)
    try:
        v = await c1
        w = await ctx.call(acct, f"{k}.D", add, 1)
    finally:
        ctx.put_item("fin", ctx.get_item("fin", 0) + 1)
        ctx.send(acct, f"{k}.C", add, 1)
    return [v, w, ctx.get_item("fin")]


@s.function(public=True)
async def nested(ctx: Context) -> list:
    k = ctx.key
    c = ctx.call(acct, f"{k}.D", add, 7)
    inner = await ctx.call(acct, f"{k}.N", early, k)
    ctx.put(inner)
    v = await c
    return [inner, v]


app = Application("replay", [acct, s])

#: (function, {entity key suffix: expected value afterwards, checked besides the oracle})
SCENARIOS: dict[str, dict[str, int | None]] = {
    "early_send": {"C": 10},
    "early_read": {},
    "early_write": {"B": 1},
    "reversed_awaits": {"B": 1, "D": 2},
    "await_twice": {"B": 1, "D": 1},
    "created_before_suspension": {"B": 1, "D": 5, "C": 1},
    "never_awaited": {"B": 1000, "C": 1000, "D": 1},
    "gather_early": {"B": 1, "D": 2, "C": 3, "E": 3, "F": 1},
    "random_between": {},
    "scan_between": {"B": 1},
    "finally_block": {"B": 1, "D": 1, "C": 1},
    "nested": {"B": 1, "C": 10, "D": 7, "N": 1},
}


def initial_state() -> dict[tuple[str, str], dict]:
    """Items of every scenario's root entity."""
    return {("s", fn): {"a": 1, "b": 2} for fn in SCENARIOS}
