"""A function cannot redirect its state access by assigning ``ctx.key``/``ctx.operator``/``ctx.tid`` (plain
attributes it can see): get/put always address the invocation's own entity in its own transaction (as before
the Context hot-path rewrite, which read them from the attributes)."""

from __future__ import annotations

import pytest

from charon import Application, Context, InProcessRuntime, Operator, Request, serde
from charon.testing import check_epoch

o = Operator("ident")


@o.function
async def retarget(ctx: Context, how: str) -> int:
    """Assign one of the context's identity attributes, then read and write."""
    if how == "key":
        ctx.key = "victim"
    elif how == "operator":
        ctx.operator = "other"
    else:
        ctx.tid = ctx.tid + 1  # another transaction's id
    ctx.put(ctx.get(default=0) + 5)
    return 0


@o.function
async def bump(ctx: Context) -> int:
    """Add one."""
    ctx.put(ctx.get(default=0) + 1)
    return ctx.get()


app = Application("ident", [o])


@pytest.mark.parametrize("how", ["key", "operator", "tid"])
@pytest.mark.parametrize("partitions", [1, 3])
def test_assigning_identity_attributes_does_not_redirect_state(how, partitions):
    rt = InProcessRuntime(app, partitions=partitions)
    reqs = [Request("r0", "ident", "a", "retarget", serde.encode([how])),
            Request("r1", "ident", "b", "bump", serde.encode([]))]
    before = rt.snapshot()
    result = rt.run_epoch(reqs)
    check_epoch(app, before, rt.snapshot(), result)  # the serial oracle agrees (its SerialContext too)
    assert all(r.ok for r in result.replies.values())
    assert rt.entities("ident") == {"a": 5, "b": 1}
    assert rt.read_state("ident", "a") == 5
