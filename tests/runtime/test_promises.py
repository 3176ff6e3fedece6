"""Durable promises (charon.core.promises) on the in-process runtime: created iff the transaction commits, the
continuation runs exactly once whatever resolves, rejects, cancels or times out first, typed conflicts, and the
engine's epochs against the serial oracle."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from charon import (
    InProcessRuntime,
    PromiseConflict,
    PromiseRejected,
    PromiseTimedOut,
    Request,
    TransactionAborted,
    UnknownPromise,
    ValueTooLarge,
    promise_value,
    serde,
)
from charon.core.promises import MAX_PROMISE_VALUE_BYTES, PROMISE_OPERATOR, is_promise_id
from charon.testing import check_epoch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from promises_app import app  # noqa: E402

T0 = 10_000.0


async def _settled(rt: InProcessRuntime, key: str, runs: int = 1) -> dict:
    for _ in range(500):
        st = rt.read_state("orders", key)
        if st and st.get("runs", 0) >= runs:
            await asyncio.sleep(0.05)  # a second continuation would have run by now
            return rt.read_state("orders", key)
        await asyncio.sleep(0.01)
    raise AssertionError(rt.read_state("orders", key))


async def test_resolve_runs_the_continuation_once_and_a_second_resolve_is_a_typed_conflict() -> None:
    async with InProcessRuntime(app) as rt:
        pid = await rt.invoke("orders", "o1", "place")
        assert is_promise_id(pid) and pid.startswith("pr.approvals.")
        assert rt.read_state(PROMISE_OPERATOR, pid)["status"] == "pending"
        done = await rt.invoke(PROMISE_OPERATOR, pid, "resolve", {"by": "alice"})
        assert done["status"] == "resolved" and done["continuation"].startswith("__charon_timer:")
        with pytest.raises(PromiseConflict, match="already resolved"):
            await rt.invoke(PROMISE_OPERATOR, pid, "resolve", {"by": "bob"})
        with pytest.raises(PromiseConflict):
            await rt.invoke(PROMISE_OPERATOR, pid, "reject", "too late")
        st = await _settled(rt, "o1")
        assert st["runs"] == 1 and st["outcome"] == {"ok": True, "value": {"by": "alice"}}
        assert promise_value(st["outcome"]) == {"by": "alice"}
        rec = rt.read_state(PROMISE_OPERATOR, pid)
        assert rec["status"] == "resolved" and rec["value"] == {"by": "alice"}
        cont = rt.get_reply(rec["continuation"])
        assert cont is not None and cont.ok, "the continuation's own transaction, under the recorded id"


async def test_a_timeout_runs_it_with_promise_timed_out_and_a_later_resolve_conflicts() -> None:
    async with InProcessRuntime(app) as rt:
        pid = await rt.invoke("orders", "o2", "place", 0.2)
        st = await _settled(rt, "o2")
        assert st["runs"] == 1 and st["outcome"]["error_type"] == "PromiseTimedOut"
        with pytest.raises(PromiseTimedOut):
            promise_value(st["outcome"])
        with pytest.raises(PromiseConflict, match="timed_out"):
            await rt.invoke(PROMISE_OPERATOR, pid, "resolve", 1)
        assert (await _settled(rt, "o2"))["runs"] == 1


async def test_reject_cancel_and_unknown_ids() -> None:
    async with InProcessRuntime(app) as rt:
        p1 = await rt.invoke("orders", "r1", "place")
        p2 = await rt.invoke("orders", "r2", "place")
        await rt.invoke(PROMISE_OPERATOR, p1, "reject", "declined")
        await rt.invoke(PROMISE_OPERATOR, p2, "cancel", "ops")
        o1, o2 = (await _settled(rt, "r1"))["outcome"], (await _settled(rt, "r2"))["outcome"]
        assert (o1["error_type"], o1["error"]) == ("PromiseRejected", "declined")
        assert o2["error_type"] == "PromiseCancelled"
        with pytest.raises(PromiseRejected, match="declined"):
            promise_value(o1)
        with pytest.raises(UnknownPromise):
            await rt.invoke(PROMISE_OPERATOR, "pr.approvals.999.0.1", "resolve", 1)


async def test_an_aborted_transaction_creates_no_promise_and_bounds_hold() -> None:
    async with InProcessRuntime(app) as rt:
        with pytest.raises(TransactionAborted):
            await rt.invoke("orders", "d", "doomed")
        page = await rt.engine().inspect(PROMISE_OPERATOR)
        assert page.rows == {}, "the aborted transaction's promise never existed"
        pid = await rt.invoke("orders", "big", "place")
        with pytest.raises(ValueTooLarge):
            await rt.invoke(PROMISE_OPERATOR, pid, "resolve", "x" * (MAX_PROMISE_VALUE_BYTES + 1))
        with pytest.raises(TransactionAborted, match="timeout"):
            await rt.invoke("orders", "t", "place", -1.0)
        assert rt.read_state(PROMISE_OPERATOR, pid)["status"] == "pending", "a refused value settles nothing"


async def test_resolve_from_another_transaction_and_its_conflict_aborts_the_resolver() -> None:
    async with InProcessRuntime(app) as rt:
        pid = await rt.invoke("orders", "o3", "place")
        out = await rt.invoke("orders", "boss", "approve", pid, 42)
        assert out["status"] == "resolved"
        with pytest.raises(PromiseConflict):
            await rt.invoke("orders", "boss2", "approve", pid, 43)
        assert rt.read_state("orders", "boss2") is None, "the resolver's transaction aborted as a whole"
        st = await _settled(rt, "o3")
        assert st["runs"] == 1 and st["outcome"]["value"] == 42


def _req(rid: str, key: str, fn: str, *args: object, ts: float, op: str = "orders") -> Request:
    return Request(rid, op, key, fn, serde.encode(list(args)), ts)


def test_epochs_with_promises_agree_with_the_serial_oracle() -> None:
    """Creation, a resolve racing a second resolve and a timeout in the same epochs: the oracle gives the same
    state and replies, and each continuation fires once (as a timer of a later epoch)."""
    rt = InProcessRuntime(app, partitions=3)

    def epoch(reqs: list[Request], now: float):  # noqa: ANN202
        before = rt.snapshot()
        result = rt.run_epoch(reqs, now=now)
        check_epoch(app, before, rt.snapshot(), result, partitions=3)
        return result

    r = epoch([_req("a", "a", "place", ts=T0), _req("b", "b", "place", 5.0, ts=T0)], T0)
    pa, pb = (serde.decode(rep.value) for rep in sorted(r.replies.values(), key=lambda x: x.request_id))
    r = epoch([_req("x1", "x", "approve", pa, 1, ts=T0 + 1), _req("x2", "y", "approve", pa, 2, ts=T0 + 1)], T0 + 1)
    oks = sorted(rep.ok for rep in r.replies.values() if rep.request_id in ("x1", "x2"))
    assert oks == [False, True], "one resolve commits, the other aborts with PromiseConflict"
    epoch([], T0 + 2)  # the continuation fires
    epoch([], T0 + 10)  # b's timeout, then its continuation
    epoch([], T0 + 11)
    a, b = rt.read_state("orders", "a"), rt.read_state("orders", "b")
    assert a["runs"] == 1 and a["outcome"]["ok"] and b["runs"] == 1
    assert b["outcome"]["error_type"] == "PromiseTimedOut"
    assert rt.read_state(PROMISE_OPERATOR, pb)["status"] == "timed_out"
