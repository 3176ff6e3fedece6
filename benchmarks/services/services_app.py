"""The application the services benchmarks (issue 34) run on ``charon run``: YCSB-T's ``account`` operator (the
background load, and the admission benchmark's transfers) and ``clock``, a public target for schedules created at
run time whose firing records its slot, the tick's time and its own transaction's timestamp (``ctx.now()``).

Imported by the node by name (``services_app:app``, this folder on ``PYTHONPATH``); the promise benchmark uses
``tests/support/promises_app.py`` instead (an order whose continuation writes its state)."""

from __future__ import annotations

from typing import Any

from charon import Application, Context, Operator
from charon.apps.ycsb import account

clock = Operator("clock")


@clock.function(public=True)
async def record(ctx: Context, firing: dict[str, Any]) -> None:
    """A schedule's firing: ``[slot, tick time, this transaction's time]`` appended to the entity's list."""
    rows = ctx.get(default=[])
    rows.append([firing["slot"], firing["time"], ctx.now()])
    ctx.put(rows[-5000:])


app = Application("services", [account, clock])
