"""A test application of schedules: a counter fired every second (declared in code) and a public target for
schedules created at run time. Each firing records its slot, so a slot fired twice is seen."""

from __future__ import annotations

from typing import Any

from charon import Application, Context, Operator

ticks = Operator("ticks")
app = Application("clock", [ticks])


@app.schedule("* * * * * *", key="every-second", name="heartbeat", catch_up=2)
@ticks.function
async def beat(ctx: Context, firing: dict[str, Any], label: str = "beat") -> None:
    st = ctx.get(default={"slots": [], "ids": []})
    st["slots"].append(firing["slot"])
    st["ids"].append(firing["id"])
    st["slots"], st["ids"] = st["slots"][-5000:], st["ids"][-5000:]
    st["label"] = label
    ctx.put(st)


@ticks.function(public=True)
async def count(ctx: Context, firing: dict[str, Any], label: str = "count") -> None:
    await beat.body(ctx, firing, label)


@ticks.function(public=True)
async def read(ctx: Context) -> Any:
    return ctx.get()
