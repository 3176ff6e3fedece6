"""Property-based check of the epoch protocol against the serial-execution oracle (DESIGN §2)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.core import partition
from charon.testing import check_epoch

n0 = Operator("n0")
n1 = Operator("n1")


class Boom(Exception):
    pass


def _body(op: Operator):
    async def node(ctx: Context, plan: list) -> int:
        delta, fail, children = plan
        v = ctx.get(default=0) + delta
        if delta:  # delta 0: a read-only visit (read/read sharing must not serialize)
            ctx.put(v)
            ctx.put_item(f"i{delta % 3}", v)
        total = v
        for mode, opn, key, sub in children:
            if mode == "call":
                total += await ctx.call(opn, key, "node", sub)
            elif mode == "dyn":  # the callee's key depends on the state read: read/write sets change on rerun
                total += await ctx.call(opn, f"{key.rsplit('-', 1)[0]}-{v % 3}", "node", sub)
            elif mode == "gather":  # sub: several [op, key, plan] run concurrently
                values = await ctx.gather(*(ctx.call(o, k, "node", p) for o, k, p in sub))
                total += sum(values)
            else:
                ctx.send(opn, key, "node", sub)
        if delta:
            ctx.put_item("after", total + len(ctx.scan_items("i")))
        if fail:
            raise Boom("boom")  # which raise is seen first is a race; all carry one message
        return total

    node.__name__ = "node"
    return op.function(node)


_body(n0)
_body(n1)
app = Application("random", [n0, n1])


@st.composite
def plans(draw, pool: str, depth: int, path: str = ""):
    delta = draw(st.integers(0, 4))
    fail = draw(st.integers(0, 24)) == 0
    children = []
    if depth > 0:
        for i in range(draw(st.integers(0, 3))):
            mode = draw(st.sampled_from(["call", "call", "send", "gather", "dyn"]))
            op = draw(st.sampled_from(["n0", "n1"]))
            if mode == "gather":  # concurrent calls: each gets its own keys so the result is defined
                subs = []
                for j in range(draw(st.integers(1, 3))):
                    g_pool = f"g{path}{i}.{j}"
                    g_op = draw(st.sampled_from(["n0", "n1"]))
                    g_key = f"{g_pool}-{draw(st.integers(0, 2))}"
                    subs.append([g_op, g_key, draw(plans(g_pool, depth - 1, f"{path}{i}.{j}."))])
                children.append(["gather", "", "", subs])
                continue
            # Asynchronous branches run concurrently: give each its own keys so the result is defined.
            sub_pool = pool if mode in ("call", "dyn") else f"s{path}{i}"
            key = f"{sub_pool}-{draw(st.integers(0, 2))}"
            children.append([mode, op, key, draw(plans(sub_pool, depth - 1, f"{path}{i}."))])
    return [delta, fail, children]


@st.composite
def transactions(draw):
    op = draw(st.sampled_from(["n0", "n1"]))
    return op, f"r-{draw(st.integers(0, 2))}", draw(plans("r", draw(st.integers(0, 4))))


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    epochs=st.lists(st.lists(transactions(), min_size=1, max_size=25), min_size=1, max_size=4),
    partitions=st.sampled_from([1, 2, 4]),
    live=st.booleans(),
)
def test_every_epoch_equals_serial_execution(epochs, partitions, live, monkeypatch):
    """Both ways of resuming a suspended function (live coroutine, journal replay) are checked."""
    monkeypatch.setattr(partition, "KEEP_LIVE_COROUTINES", live)
    rt = InProcessRuntime(app, partitions=partitions)
    n = 0
    for batch in epochs:
        reqs = []
        for op, key, plan in batch:
            reqs.append(Request(f"r{n}", op, key, "node", serde.encode([plan]), ts=1000.0 + n))
            n += 1
        before = rt.snapshot()
        result = rt.run_epoch(reqs)
        check_epoch(app, before, rt.snapshot(), result)
    while rt.coordinator.deferred:
        before = rt.snapshot()
        result = rt.run_epoch([])
        check_epoch(app, before, rt.snapshot(), result)


def test_oracle_workload_exercises_every_commit_path():
    """A fixed contended workload must go through lock-free, cached and locked fallback commits."""
    import random

    rng = random.Random(7)
    rt = InProcessRuntime(app, partitions=3)
    totals = {"lockfree": 0, "fast": 0, "slow": 0, "aborted": 0}
    for e in range(6):
        reqs = []
        for i in range(40):
            children = [["call", "n1", f"r-{rng.randrange(3)}", [1, False, []]]]
            if rng.random() < 0.3:  # changes what it calls with the state: not cacheable
                children.append(["send", "n0", f"s{i}-0", [2, rng.random() < 0.1, []]])
            plan = [rng.randint(1, 5), rng.random() < 0.05, children]
            reqs.append(Request(f"{e}-{i}", "n0", f"r-{rng.randrange(3)}", "node", serde.encode([plan])))
        before = rt.snapshot()
        result = rt.run_epoch(reqs)
        check_epoch(app, before, rt.snapshot(), result)
        totals["lockfree"] += len(result.lockfree)
        totals["fast"] += len(result.fast)
        totals["slow"] += len(result.slow)
        totals["aborted"] += sum(1 for r in result.replies.values() if not r.ok)
    assert all(v > 0 for v in totals.values()), totals
