"""In-process runtime: every wait for a reply is its own (no shared future a cancelled caller could cancel)."""

from __future__ import annotations

import asyncio
from typing import Any

from charon import Application, Operator
from charon.runtime.node.inprocess import InProcessRuntime

counter = Operator("counter")


@counter.function
async def add(ctx: Any, n: int) -> int:
    v = (ctx.get(0) or 0) + n
    ctx.put(v)
    return v


APP = Application("waiters", [counter])


def test_a_cancelled_waiter_does_not_cancel_another_waiter_of_the_same_request() -> None:
    async def main() -> tuple[Any, ...]:
        rt = InProcessRuntime(APP, partitions=2, epoch_max_ms=0)
        async with rt:
            rt.gate.pause()  # hold the request in the queue while both wait for it
            a = asyncio.ensure_future(rt.submit("counter", "c", "add", [5], request_id="r1"))
            b = asyncio.ensure_future(rt.submit("counter", "c", "add", [5], request_id="r1"))
            await asyncio.sleep(0.01)
            a.cancel()
            rt.gate.resume()
            rep = await asyncio.wait_for(b, 5)
            again = await rt.submit("counter", "c", "add", [5], request_id="r1")  # answered: the same reply
            return a.cancelled(), rep.ok, rep.value, again.value, rt.read_state("counter", "c")

    cancelled, ok, value, again, state = asyncio.run(main())
    assert cancelled and ok and value == again
    assert state == 5  # ran once


def test_a_resubmission_after_a_cancelled_wait_gets_the_reply() -> None:
    async def main() -> tuple[Any, Any]:
        rt = InProcessRuntime(APP, partitions=2, epoch_max_ms=0)
        async with rt:
            rt.gate.pause()
            a = asyncio.ensure_future(rt.submit("counter", "d", "add", [3], request_id="r2"))
            await asyncio.sleep(0.01)
            a.cancel()
            await asyncio.sleep(0)
            b = asyncio.ensure_future(rt.submit("counter", "d", "add", [3], request_id="r2"))
            rt.gate.resume()
            rep = await asyncio.wait_for(b, 5)
            return rep.ok, rt.read_state("counter", "d")

    ok, state = asyncio.run(main())
    assert ok and state == 3
