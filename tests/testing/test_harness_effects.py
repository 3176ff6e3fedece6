"""Effects are exercised in tests (issue 31 item 6): the fault harness runs an application's effect handlers under
seeded handler faults (failures before the call, lost replies, timeouts, duplicate continuation deliveries) and
checks that every continuation has exactly one outcome; ``InProcessRuntime`` runs the handlers of an application
that has them; a continuation the resume path refuses is resumed with a typed failure, never dropped."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from charon import InProcessRuntime
from charon.errors import ReservedRequestId
from charon.runtime.effects import ContinuationRefused, EffectExecutor, engine_resume
from charon.testing import Snapshot, run_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
import fx_harness_app as fx  # noqa: E402


def test_the_harness_runs_handlers_under_faults_and_continues_each_effect_once() -> None:
    reports = []
    for seed in range(4):
        last: list[Snapshot] = []
        fx.CHARGED.clear()
        fx.CALLS.clear()
        report = run_app("fx_harness_app:app", fx.workload, [fx.continuation_once, last.append], seed=seed,
                         steps=40)
        reports.append(report)
        assert report.effects > 0, report
        assert len(fx.CALLS) <= report.effect_attempts  # an injected failure before the call never reached it
        orders = last[-1].entities("orders")
        # every effect was continued before the expiry timers' horizon: no order is left charging or expired
        assert orders and all(o["state"] in ("paid", "declined") for o in orders.values()), orders
        paid = {k for k, o in orders.items() if o["state"] == "paid"}
        assert len(fx.CHARGED) >= len(paid)  # a paid order was charged at the service (once per effect id)
        assert all(k.startswith("fx.fxharness.") for k in fx.CHARGED)
    # the seeds drew handler faults and duplicate deliveries (the schedule is part of the seed)
    assert any(r.effect_failures for r in reports) and any(r.continuation_duplicates for r in reports)
    again = run_app("fx_harness_app:app", fx.workload, [fx.continuation_once], seed=2, steps=40)
    assert again.fingerprint == reports[2].fingerprint  # the same seed, the same run


def test_a_continuation_lost_to_the_engine_is_caught() -> None:
    """The exactly-once check has teeth: a harness whose continuations never reach the engine fails the seed."""
    from charon.testing import harness

    real = harness._Effects.deliver

    def dropped(self: Any, req: Any, at: int, fresh: bool) -> None:
        if not req.request_id.endswith(".1.done"):  # the first effect of a transaction never reaches the log
            real(self, req, at, fresh)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness._Effects, "deliver", dropped)
        with pytest.raises(harness.HarnessFailure, match=r"its continuation ran 0 times \(exactly once expected\)"):
            run_app("fx_harness_app:app", fx.workload, [], seed=1, steps=40)


async def test_inprocess_runtime_runs_the_handlers() -> None:
    async with InProcessRuntime(fx.app, partitions=2) as rt:  # volatile, with handlers: on by default
        assert rt.run_effects and rt.effects_executor is not None
        await rt.invoke("orders", "a", "place", 10)
        await rt.invoke("orders", "b", "place", 14)  # declined by the card service
        await rt.settle_effects(30)
        assert (await rt.invoke("orders", "a", "status"))["state"] == "paid"
        assert (await rt.invoke("orders", "b", "status"))["state"] == "declined"
        eid = next(r["id"] for r in rt.effects_executor.list_effects() if r["key"] == "a")
        with pytest.raises(ReservedRequestId):  # no caller takes a continuation's id
            await rt.invoke("orders", "z", "status", request_id=eid + ".done")
    async with InProcessRuntime(fx.app, partitions=1, effects=False) as rt:
        await rt.invoke("orders", "a", "place", 10)
        assert rt.effects_executor is None
        with pytest.raises(RuntimeError, match="runs no effects"):
            await rt.settle_effects(1)
        assert (await rt.invoke("orders", "a", "status"))["state"] == "charging"


async def test_a_refused_continuation_is_resumed_with_a_typed_failure() -> None:
    async with InProcessRuntime(fx.app, partitions=1, effects=False) as rt:
        inner = engine_resume(rt.submit)
        seen: list[dict] = []

        async def resume(op: str, key: str, fn: str, args: list, rid: str) -> tuple[bool, str]:
            seen.append(args[0])
            if args[0]["ok"]:  # e.g. a gateway's 413: refused before the log
                raise ContinuationRefused("PayloadTooLarge: body exceeds the limit")
            return await inner(op, key, fn, args, rid)

        ex = EffectExecutor(fx.app, rt.streams, resume, backoff_s=0.01, poll_s=0.01)
        await ex.start()
        try:
            await rt.invoke("orders", "a", "place", 10)
            assert rt.streams.end_offset("charon.effects") == 1  # (a read: the epoch's deferred finalize ran)
            await ex.settle(30)
        finally:
            await ex.stop()
        order = await rt.invoke("orders", "a", "status")
        assert order["state"] == "declined" and order["fx_runs"] == 1, order
        assert [r["ok"] for r in seen] == [True, False] and seen[1]["error_type"] == "ContinuationRefused"
        row = ex.list_effects()[0]
        assert (row["status"], row["outcome"], row["continuation_error"]) == ("done", "failed", "")
