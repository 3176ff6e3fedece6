"""Workflow migration (``@wf.migrates``): workflow ``order`` in two code versions. Version 1's first step awaits a
promise before the step its input names (``charged``, ``approved`` or ``review``, which aborts: retried in 600 s)
and keeps its input's ``state``;
version 2 renames ``approved`` to ``approved_v2``, drops ``review`` and declares the migration from ``"1"``, whose
function adds a currency (it raises on ``{"bad": "raise"}`` and returns a bad state on ``{"bad": "bytes"}``)."""

from __future__ import annotations

from typing import Any

from charon import Application, Context, Workflow


def _order(label: str, backoff: float) -> Workflow:
    order = Workflow("order", attempts=2, backoff=backoff)

    @order.step(first=True)
    async def begin(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
        doc = outcome["value"]
        w.state.update(doc.get("state", {}), ran=[f"{label}:begin"])
        return w.promise(then=doc["then"])

    @order.step
    async def charged(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
        w.state["ran"].append(f"{label}:charged")
        return w.done(w.state)

    return order


v1_order = _order("v1", 600.0)  # a step that aborts is retried in 600 s: it stays mid-step


@v1_order.step
async def approved(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
    w.state["ran"].append("v1:approved")
    return w.done(w.state)


@v1_order.step
async def review(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
    raise RuntimeError("the review service is down")


v2_order = _order("v2", 0.05)


@v2_order.migrates("1", steps={"charged": "charged", "approved": "approved_v2"})
def from_v1(state: dict[str, Any]) -> dict[str, Any]:
    """Pure: the old state in, the new state out."""
    if state.get("bad") == "raise":
        raise KeyError("no price list")
    if state.get("bad") == "bytes":
        return {**state, "blob": b"\x00"}
    return {**state, "currency": "EUR"}


@v2_order.step
async def approved_v2(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
    w.state["ran"].append(f"v2:approved_v2:{w.state['currency']}")
    return w.done(w.state)


v1 = Application("orders", [], workflows=[v1_order])
v2 = Application("orders", [], workflows=[v2_order])
