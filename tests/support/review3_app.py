"""An application whose one function interprets a plan: the engine's hot paths (early-created calls awaited
late, gather, re-entrant calls, sends, ctx.random()/now() in decisions, unencodable puts, bad call targets,
aborts in callees), for the differential tests in test_engine_differential.py."""

from __future__ import annotations

from charon import Application, Context, Operator

a = Operator("a")
b = Operator("b")


class Boom(Exception):
    """An application error (aborts the transaction)."""


def _body(op: Operator) -> None:
    async def node(ctx: Context, plan: list) -> int:
        total = 0
        early = []  # calls created now, awaited by a later "await"/"gather" step
        for step in plan:
            kind = step[0]
            if kind == "get":
                total += ctx.get(default=0)
            elif kind == "put":
                ctx.put(ctx.get(default=0) + step[1])
            elif kind == "item":
                ctx.put_item(step[1], total + step[2])
                total += len(ctx.scan_items(""))
            elif kind == "call":  # called and awaited at once
                total += await ctx.call(step[1], step[2], "node", step[3])
            elif kind == "dyn":  # the callee's key depends on the state read: what it calls changes on a rerun
                v = ctx.get(default=0)
                total += await ctx.call(step[1], f"{step[2].rsplit('-', 1)[0]}-{v % 3}", "node", step[3])
            elif kind == "cond":  # whether it calls at all depends on the state read
                if ctx.get(default=0) % 2:
                    total += await ctx.call(step[1], step[2], "node", step[3])
                else:
                    ctx.put(ctx.get(default=0) + 1)
            elif kind == "early":  # created now (target checked now), sent when awaited
                early.append(ctx.call(step[1], step[2], "node", step[3]))
            elif kind == "await":
                while early:
                    total += await early.pop(0)
            elif kind == "gather":
                if early:
                    total += sum(await ctx.gather(*early))
                    early = []
            elif kind == "send":
                ctx.send(step[1], step[2], "node", step[3])
            elif kind == "rand":  # a decision on ctx.random() and ctx.now()
                if ctx.random() < 0.5:
                    ctx.put(ctx.get(default=0) + 1 + int(ctx.now()) % 2)
                else:
                    total += 100
            elif kind == "unencodable":  # SerializationError: aborts the transaction
                ctx.put(object())
            elif kind == "badkey":  # InvalidKey
                await ctx.call("a", "", "node", [])
            elif kind == "badargs":  # BadArguments
                await ctx.call("a", "k", "node", "not a list", 3)
            elif kind == "listop":  # an unhashable operator name
                await ctx.call(["a"], "k", "node", [])
            elif kind == "badret":  # an unencodable return value
                return 2**70  # too big for msgpack
            elif kind == "fail":
                raise Boom("boom")
        if early:  # calls created and not awaited yet (UnawaitedCall has tests of its own: test_mistakes,
            total += sum(await ctx.gather(*early))  # test_caught_callee; mixed here with other errors of other
            # branches, which error a client sees is not defined by the serial order)
        return total

    node.__name__ = "node"
    op.function(node)


_body(a)
_body(b)
app = Application("review3", [a, b])
