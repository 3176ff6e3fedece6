"""Workflow version pinning, version 2 (``wf_pin_v1`` is version 1): workflow ``pin`` awaits two durable promises;
each step appends ``"<version>:<step>"`` to the workflow's state, so a record says which code ran each step."""

from __future__ import annotations

from typing import Any

from charon import Application, Context, Operator, Workflow

VERSION = "v2"
probe = Operator("probe")
pin = Workflow("pin", backoff=0.2)


@probe.function(public=True)
async def ping(ctx: Context) -> str:
    return VERSION


@pin.step(first=True)
async def begin(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
    w.state["ran"] = [f"{VERSION}:begin"]
    return w.promise(then=middle)


@pin.step
async def middle(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
    w.state["ran"].append(f"{VERSION}:middle")
    return w.promise(then=end)


@pin.step
async def end(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
    w.state["ran"].append(f"{VERSION}:end")
    return w.done({"ran": w.state["ran"], "pinned": w.version})


app = Application("pinapp", [probe], workflows=[pin])
