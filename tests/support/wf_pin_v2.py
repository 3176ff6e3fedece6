"""Workflow version pinning, version 2 (``wf_pin_v1`` is version 1): workflow ``pin`` awaits two durable promises;
each step appends ``"<version>:<step>"`` to the workflow's state, so a record says which code ran each step. It
declares the migration from version ``"1"`` (the steps keep their names; the state gains ``"from": "1"``)."""

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


@pin.migrates("1", steps={"middle": "middle", "end": "end"})
def from_v1(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "from": "1"}


app = Application("pinapp", [probe], workflows=[pin])
