"""Schedules (charon.core.schedules) on the in-process runtime: each slot fires once, in its own transaction with
an id derived from (schedule, slot); the missed-slot policy (the slot due now, plus at most ``catch_up`` missed
ones); pause, resume, delete, declarations at start; epochs checked against the serial oracle."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from charon import Application, InProcessRuntime, Operator, Request, TransactionAborted, UnknownSchedule, serde
from charon.core.schedules import SCHEDULE_OPERATOR, declarations
from charon.testing import check_epoch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from schedules_app import app  # noqa: E402

T0 = 1_700_000_000.0  # a whole second


def _declare(ts: float) -> list[Request]:
    return [Request(rid, SCHEDULE_OPERATOR, spec["name"], "upsert", serde.encode([spec, True]), ts)
            for rid, spec in declarations(app)]


def _op(rid: str, name: str, fn: str, *args: object, ts: float) -> Request:
    return Request(rid, SCHEDULE_OPERATOR, name, fn, serde.encode(list(args)), ts)


class Clock:
    """Epochs at chosen times, each checked against the serial oracle."""

    def __init__(self) -> None:
        self.rt = InProcessRuntime(app, partitions=3)

    def epoch(self, now: float, reqs: list[Request] | None = None):  # noqa: ANN201
        before = self.rt.snapshot()
        result = self.rt.run_epoch(reqs or [], now=now)
        check_epoch(app, before, self.rt.snapshot(), result, partitions=3)
        return result

    def slots(self) -> list[float]:
        return (self.rt.read_state("ticks", "every-second") or {"slots": []})["slots"]

    def record(self) -> dict:
        return self.rt.read_state(SCHEDULE_OPERATOR, "heartbeat")


def test_each_slot_fires_once_with_an_id_from_schedule_and_slot() -> None:
    c = Clock()
    c.epoch(T0 + 0.2, _declare(T0 + 0.2))
    assert c.record()["next_slot"] == T0 + 1
    for t in (T0 + 0.5, T0 + 1.1, T0 + 1.2, T0 + 1.9, T0 + 2.05, T0 + 2.1, T0 + 3.0, T0 + 3.0, T0 + 3.5):
        c.epoch(t)
    assert c.slots() == [T0 + 1, T0 + 2, T0 + 3], "each slot once, in order"
    ids = c.rt.read_state("ticks", "every-second")["ids"]
    assert ids == [f"heartbeat@{T0 + s:.0f}" for s in (1, 2, 3)]
    rec = c.record()
    assert rec["fired"] == 3 and rec["skipped"] == 0 and rec["next_slot"] == T0 + 4
    c.epoch(T0 + 3.6, _declare(T0 + 3.6))  # a restart's declaration of the same spec changes nothing
    assert c.record()["next_slot"] == T0 + 4 and c.record()["fired"] == 3


def test_missed_slots_fire_the_current_one_plus_at_most_catch_up_and_count_the_rest() -> None:
    c = Clock()
    c.epoch(T0 + 0.2, _declare(T0 + 0.2))
    c.epoch(T0 + 1.0)
    c.epoch(T0 + 1.5)
    assert c.slots() == [T0 + 1]
    c.epoch(T0 + 10.4)  # down for 9 slots (2..10): 10 is due now, catch_up=2 fires 8 and 9, 2..7 skipped
    c.epoch(T0 + 10.5)
    assert c.slots() == [T0 + 1, T0 + 8, T0 + 9, T0 + 10]
    rec = c.record()
    assert rec["skipped"] == 6 and rec["fired"] == 4 and rec["last_slot"] == T0 + 10 and rec["next_slot"] == T0 + 11


def test_pause_resume_and_delete_are_transactions_and_stale_ticks_do_nothing() -> None:
    c = Clock()
    c.epoch(T0 + 0.2, _declare(T0 + 0.2))
    c.epoch(T0 + 1.0)
    c.epoch(T0 + 1.2, [_op("p", "heartbeat", "pause", ts=T0 + 1.2)])
    c.epoch(T0 + 5.0)
    c.epoch(T0 + 5.5)
    assert c.slots() == [T0 + 1] and c.record()["paused"] and c.record()["next_slot"] is None
    c.epoch(T0 + 5.6, [_op("r", "heartbeat", "resume", ts=T0 + 5.6)])
    assert c.record()["next_slot"] == T0 + 6, "resumed at the first slot after the resume (paused slots: none)"
    c.epoch(T0 + 6.0)
    c.epoch(T0 + 6.1)
    assert c.slots() == [T0 + 1, T0 + 6]
    r = c.epoch(T0 + 6.2, [_op("d", "heartbeat", "delete", ts=T0 + 6.2)])
    assert all(rep.ok for rep in r.replies.values())
    c.epoch(T0 + 9.0)
    assert c.slots() == [T0 + 1, T0 + 6] and c.record()["deleted"]
    c.epoch(T0 + 9.1, _declare(T0 + 9.1))  # the same declaration: it stays deleted
    c.epoch(T0 + 12.0)
    assert c.slots() == [T0 + 1, T0 + 6]


def test_bad_declarations_are_refused_where_they_are_written() -> None:
    op = Operator("o")
    bad = Application("bad", [op])

    @op.function
    async def f(ctx, firing: dict) -> None: ...  # noqa: ANN001

    for kwargs, match in (({"expr": "nope"}, "cron"), ({"expr": "* * * * *", "catch_up": 101}, "catch_up"),
                          ({"expr": "* * * * *", "args": [1, 2]}, "argument")):
        with pytest.raises(ValueError, match=match):
            bad.schedule(kwargs.pop("expr"), key="k", **kwargs)(f)


async def test_declared_at_start_and_managed_at_run_time() -> None:
    async with InProcessRuntime(app) as rt:
        for _ in range(300):
            if len((rt.read_state("ticks", "every-second") or {"slots": []})["slots"]) >= 2:
                break
            await asyncio.sleep(0.02)
        slots = rt.read_state("ticks", "every-second")["slots"]
        assert len(slots) >= 2 and len(set(slots)) == len(slots) and slots == sorted(slots)
        spec = {"name": "fast", "cron": "* * * * * *", "operator": "ticks", "key": "other", "function": "count",
                "args": ["x"], "catch_up": 0}
        await rt.invoke(SCHEDULE_OPERATOR, "fast", "upsert", spec, False)
        with pytest.raises(TransactionAborted, match="ScheduleExists"):
            await rt.invoke(SCHEDULE_OPERATOR, "fast", "upsert", spec, False)
        for _ in range(300):
            if (rt.read_state("ticks", "other") or {}).get("slots"):
                break
            await asyncio.sleep(0.02)
        assert rt.read_state("ticks", "other")["label"] == "x"
        await rt.invoke(SCHEDULE_OPERATOR, "fast", "delete")
        assert rt.read_state(SCHEDULE_OPERATOR, "fast") is None
        with pytest.raises(UnknownSchedule):
            await rt.invoke(SCHEDULE_OPERATOR, "fast", "pause")
