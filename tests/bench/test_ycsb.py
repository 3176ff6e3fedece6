"""YCSB-T on the in-process runtime: conservation, exactly one reply, no trace of aborts, fallback commits."""

from __future__ import annotations

import asyncio

import pytest

from charon import InProcessRuntime, Request, serde
from charon.apps import ycsb
from charon.client_errors import raise_for_reply
from charon.errors import TransactionAborted
from charon.testing import check_epoch


@pytest.mark.parametrize("zipf", [0.0, 0.99])
async def test_concurrent_transfers_conserve_money_and_answer_once(zipf):
    n = 1000
    rt = InProcessRuntime(ycsb.app, partitions=4, epoch_max_txns=300, epoch_max_ms=2.0)
    balances = ycsb.initial_state(n, balance=50)
    rt.load("account", balances)
    reqs = list(ycsb.workload(n, 4000, zipf=zipf, seed=3, max_amount=40))
    async with rt:
        replies = await asyncio.gather(
            *(rt.submit(op, k, f, a, request_id=f"q{i}") for i, (op, k, f, a) in enumerate(reqs))
        )
    assert [r.request_id for r in replies] == [f"q{i}" for i in range(len(reqs))]
    assert len({r.tid for r in replies}) == len(reqs), "one transaction per request"
    state = rt.entities("account")
    assert sum(state.values()) == 50 * n, "the total balance never changes"
    aborted = [r for r in replies if not r.ok]
    assert aborted and all(r.error_type == "NotEnoughCredit" for r in aborted)
    committed = [r for r in replies if r.ok]
    stats = rt.epoch_stats
    # every request ran in exactly one epoch (deferred ones are counted again in the next epoch)
    assert sum(s["size"] - s.get("deferred", 0) for s in stats) == len(reqs)
    fallback = sum(s.get("fast", 0) + s.get("slow_rounds", 0) for s in stats)
    assert fallback > 0, "conflicting transfers commit through the fallback"
    assert sum(s["committed"] for s in stats) == len(committed) > len(reqs) // 2


def test_aborted_transfers_leave_no_trace_and_fallback_commits_conflicts():
    n = 50
    rt = InProcessRuntime(ycsb.app, partitions=4)
    rt.load("account", ycsb.initial_state(n, balance=20))
    for e in range(8):
        reqs = [
            Request(f"{e}-{i}", op, k, f, serde.encode(a))
            for i, (op, k, f, a) in enumerate(ycsb.workload(n, 200, zipf=0.99, seed=e, max_amount=30))
        ]
        before = rt.snapshot()
        result = rt.run_epoch(reqs)
        after = rt.snapshot()
        check_epoch(ycsb.app, before, after, result)
        assert len(result.replies) + len(result.deferred) == len(result.requests) >= len(reqs)
        assert result.fast or result.slow, "conflicts are resolved by the fallback, not client retries"
        for rep in result.replies.values():
            if not rep.ok:
                with pytest.raises(TransactionAborted) as exc:
                    raise_for_reply(rep)
                assert exc.value.error_type == "NotEnoughCredit"
        assert sum(rt.entities("account").values()) == 20 * n
    for result in rt.drain():
        assert not result.deferred or len(result.requests) > len(result.deferred)
    assert not rt.coordinator.deferred


def test_idempotent_submit_executes_once():
    async def main():
        rt = InProcessRuntime(ycsb.app, partitions=2)
        rt.load("account", {"a": 100, "b": 0})
        async with rt:
            r1, r2 = await asyncio.gather(
                rt.submit("account", "a", "transfer", ["b", 10], request_id="same"),
                rt.submit("account", "a", "transfer", ["b", 10], request_id="same"),
            )
            r3 = await rt.submit("account", "a", "transfer", ["b", 10], request_id="same")
        assert r1 == r2 == r3
        assert rt.read_state("account", "a") == 90 and rt.read_state("account", "b") == 10

    asyncio.run(main())
