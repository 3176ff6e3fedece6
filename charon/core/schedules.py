"""Schedules (issue 34): a function run on a cron schedule, each slot once, decided where the order is decided.

A schedule is an entity of the built-in operator ``charon.schedule`` (its key the schedule's name) whose record
holds the spec (cron expression, target ``operator/key.function``, extra ``args``, ``catch_up``) and a timer due
at its next slot. The timer fires the schedule's ``tick(slot)`` as a transaction in the first epoch whose
(deterministic, logged) time ``T`` passes the slot; the tick decides, from the record and ``T`` alone:

* the slot due now (the latest at or before ``T``) fires, late if the engine was down or paused;
* of the slots missed before it (since the one the timer was armed for), the newest ``catch_up`` fire too (at
  most :data:`MAX_CATCH_UP`); the rest are **skipped** and counted (``skipped``, exact up to
  :data:`MAX_COUNTED_MISSES` per tick);
* each firing is a timer due at once, running ``function(ctx, firing, *args)`` on the target entity as a
  transaction of its own (an abort there does not stop the schedule); ``firing`` is ``{"schedule": name,
  "slot": s, "id": "<name>@<s>", "time": T}``: ``id`` is derived from (schedule, slot), the idempotency key to
  pass on;
* the next timer is armed for the first slot after ``T``, in the same transaction.

One transaction both records the slots fired and arms the next tick, so a crash or a replay fires each slot once;
a stale tick (a timer armed before a pause, resume or update) finds ``next_slot`` changed and does nothing.
Pausing cancels the timer; resuming arms the first slot after the resume (slots while paused never fire).
Schedules declared in code (``@app.schedule``) are upserted at every start by a transaction whose request id
names the spec's hash: a changed spec replaces the record; one deleted at run time stays deleted until its
declaration changes.
"""

from __future__ import annotations

import math
from typing import Any

from charon.core import cron
from charon.core import timers as _timers
from charon.core.schedule_spec import MAX_CATCH_UP, spec_hash
from charon.errors import UnknownSchedule
from charon.operator import Application, Operator, register_builtin

__all__ = ["DECLARE_ID_PREFIX", "MAX_CATCH_UP", "MAX_COUNTED_MISSES", "SCHEDULE_OPERATOR", "ScheduleExists",
           "declarations"]

SCHEDULE_OPERATOR = "charon.schedule"
DECLARE_ID_PREFIX = "__charon_schedule:"  # request ids of the start's declarations (reserved)
MAX_COUNTED_MISSES = 1000

_op = Operator(SCHEDULE_OPERATOR)
register_builtin(_op)


class ScheduleExists(Exception):  # noqa: N818 - the name says what happened
    """Creating a schedule under a name that is taken (the transaction aborts: HTTP 409)."""


def declarations(app: Application) -> list[tuple[str, dict[str, Any]]]:
    """``(request id, spec)`` of the upsert of every schedule ``app`` declares in code."""
    return [(f"{DECLARE_ID_PREFIX}{name}:{spec_hash(spec)}", spec) for name, spec in sorted(app.schedules.items())]


def _arm(ctx: Any, rec: dict[str, Any], after: float) -> None:
    """Arm the record's timer for the first slot after ``after`` (none: ``next_slot`` None)."""
    slot = cron.next_after(rec["cron"], after)
    if math.isfinite(slot):
        rec["timer"] = ctx.send_at(slot, SCHEDULE_OPERATOR, ctx.key, tick, slot)
        rec["next_slot"] = slot
    else:
        rec["timer"], rec["next_slot"] = None, None


def _disarm(ctx: Any, rec: dict[str, Any]) -> None:
    if rec.get("timer"):
        ctx.cancel_timer(rec["timer"])
    rec["timer"], rec["next_slot"] = None, None


def _live(ctx: Any) -> dict[str, Any]:
    rec = ctx.get()
    if rec is None or rec.get("deleted"):
        raise UnknownSchedule(f"no schedule {ctx.key!r}")
    return dict(rec)


def _summary(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: rec.get(k) for k in ("name", "paused", "deleted", "next_slot", "last_slot", "fired", "skipped")}


# -- the built-in operator (internal functions: the start's declarations, the schedule routes, its timers)
@_op.function
async def upsert(ctx: Any, spec: dict[str, Any], declared: bool = False) -> dict[str, Any]:
    """Create the schedule (``ScheduleExists`` if the name is taken), or, declared in code, create or replace it
    when its spec changed (a declaration already applied, or deleted at run time, changes nothing)."""
    rec = ctx.get()
    digest = spec_hash(spec)
    if rec is not None:
        if declared and rec.get("hash") == digest:
            return _summary(rec)
        if not declared and not rec.get("deleted"):
            raise ScheduleExists(f"schedule {ctx.key!r} exists (delete it first)")
        _disarm(ctx, rec)
    now = ctx.now()
    new = {**spec, "name": ctx.key, "hash": digest, "declared": declared, "paused": False, "deleted": False,
           "timer": None, "next_slot": None, "last_slot": None, "fired": 0, "skipped": 0, "last_error": None,
           "last_firing": None, "created": now, "updated": now}
    _arm(ctx, new, now)
    ctx.put(new)
    return _summary(new)


@_op.function
async def pause(ctx: Any) -> dict[str, Any]:
    """Stop firing (the timer is cancelled) until :func:`resume`."""
    rec = _live(ctx)
    if not rec["paused"]:
        _disarm(ctx, rec)
        rec.update(paused=True, updated=ctx.now())
        ctx.put(rec)
    return _summary(rec)


@_op.function
async def resume(ctx: Any) -> dict[str, Any]:
    """Fire again from the first slot after now (slots while paused never fire)."""
    rec = _live(ctx)
    if rec["paused"]:
        rec.update(paused=False, updated=ctx.now())
        _arm(ctx, rec, ctx.now())
        ctx.put(rec)
    return _summary(rec)


@_op.function
async def delete(ctx: Any) -> dict[str, Any]:
    """Delete the schedule (one declared in code stays deleted until its declaration changes)."""
    rec = _live(ctx)
    _disarm(ctx, rec)
    if rec["declared"]:
        rec.update(deleted=True, paused=False, updated=ctx.now())
        ctx.put(rec)
    else:
        ctx.delete()
    return {**_summary(rec), "deleted": True}


def _missed(expr: str, first: float, latest: float, catch_up: int) -> tuple[list[float], int]:
    """The slots to fire before ``latest`` (the newest ``catch_up`` of those in [first, latest)) and how many of
    them are skipped (counted up to :data:`MAX_COUNTED_MISSES`)."""
    newest: list[float] = []
    s = latest
    while len(newest) < catch_up:
        s = cron.latest_at_or_before(expr, s - 0.5)  # slots are whole seconds
        if s < first:
            break
        newest.append(s)
    missed = cron.count_between(expr, first, latest, MAX_COUNTED_MISSES)
    return sorted(newest), max(0, missed - len(newest))


@_op.function
async def tick(ctx: Any, slot: float) -> dict[str, Any] | None:
    """The timer of ``slot``: fire the slot due now (and up to ``catch_up`` missed ones), arm the next."""
    rec = ctx.get()
    if rec is None or rec.get("deleted") or rec["paused"] or rec["next_slot"] != slot:
        return None  # stale: paused, resumed, replaced or deleted since it was armed
    now = ctx.now()
    latest = max(slot, cron.latest_at_or_before(rec["cron"], now))
    before, skipped = _missed(rec["cron"], slot, latest, rec["catch_up"])
    fired = []
    for s in [*before, latest]:
        firing = {"schedule": ctx.key, "slot": s, "id": f"{ctx.key}@{s:.0f}", "time": now}
        try:
            timer = ctx.send_at(now, rec["operator"], rec["key"], rec["function"], firing, *rec["args"])
        except Exception as exc:  # e.g. a code update removed the target: recorded, the schedule goes on
            rec["last_error"] = f"{type(exc).__name__}: {exc}"[:2000]
            continue
        fired.append(s)
        rec["last_firing"] = {"id": firing["id"], "slot": s, "request_id": _timers.REQUEST_PREFIX + timer}
    rec.update(last_slot=latest, fired=rec["fired"] + len(fired), skipped=rec["skipped"] + skipped, updated=now)
    _arm(ctx, rec, now)
    ctx.put(rec)
    return {"fired": fired, "skipped": skipped}


@_op.function
async def get(ctx: Any) -> dict[str, Any] | None:
    """The schedule's record (None: no such schedule)."""
    rec = ctx.get()
    return None if rec is None or rec.get("deleted") else dict(rec)
