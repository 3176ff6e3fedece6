"""The in-process runtime's per-request path: each caller awaits a future of its own (no shield), duplicates of a
waiting request run once, and a caller that gives up affects nobody else."""

from __future__ import annotations

import asyncio

from charon import serde
from charon.apps import ycsb
from charon.messages import Request
from charon.runtime.node.inprocess import InProcessRuntime


def _runtime() -> InProcessRuntime:
    rt = InProcessRuntime(ycsb.app, partitions=2, warmup_txns=0, gc_tuning=False)
    rt.load("account", ycsb.initial_state(10))
    return rt


def test_duplicates_and_a_cancelled_caller() -> None:
    async def main() -> None:
        rt = _runtime()
        async with rt:
            rt.gate.pause()  # no epoch starts: the requests wait together
            req = Request("r1", "account", ycsb.key(0), "deposit", serde.encode([5]))
            first = asyncio.ensure_future(rt.submit("account", ycsb.key(0), "deposit", [5], request_id="r1"))
            await asyncio.sleep(0)
            dup = rt.enqueue(req)
            later = asyncio.ensure_future(rt.submit("account", ycsb.key(0), "deposit", [5], request_id="r1"))
            await asyncio.sleep(0)
            first.cancel()  # the first caller gives up: the request still runs, the others get its reply
            await asyncio.sleep(0)
            assert first.cancelled()
            rt.gate.resume()
            a, b = await asyncio.wait_for(asyncio.gather(dup, later), 10)
            assert a == b and a.ok and a.request_id == "r1"
            again = await rt.submit("account", ycsb.key(0), "deposit", [5], request_id="r1")  # answered: not rerun
            assert again == a
        assert rt.read_state("account", ycsb.key(0)) == ycsb.INITIAL_BALANCE + 5  # ran once
        assert not rt._futures and not rt._waiters

    asyncio.run(main())


def test_cancelled_callers_leave_nothing_behind() -> None:
    async def main() -> None:
        rt = _runtime()
        async with rt:
            rt.gate.pause()
            tasks = [asyncio.ensure_future(rt.submit("account", ycsb.key(i), "deposit", [1], request_id=f"c{i}"))
                     for i in range(10)]
            await asyncio.sleep(0)
            for t in tasks:
                t.cancel()
            rt.gate.resume()
            await asyncio.gather(*tasks, return_exceptions=True)
            for _ in range(200):
                if not rt._futures:
                    break
                await asyncio.sleep(0.005)
            assert not rt._futures  # delivered (to nobody) and dropped
            assert all(rt.get_reply(f"c{i}").ok for i in range(10))  # they ran all the same
        assert sum(rt.read_state("account", ycsb.key(i)) for i in range(10)) == 10 * ycsb.INITIAL_BALANCE + 10

    asyncio.run(main())
