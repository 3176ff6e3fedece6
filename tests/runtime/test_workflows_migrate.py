"""Workflow migration with a state and step mapping (``@wf.migrates``, charon.core.workflows) on the in-process
runtime: a mapped step and the function's state applied by the workflow's own ``migrate`` transaction, its pending
await kept; an unmapped step, a workflow mid-step, a function that raises or returns a bad state refused
(NotMigratable) with nothing changed; the same logged epochs replayed give the same records; bad declarations
typed; over HTTP, the dry run forecasts the skips."""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from charon import Application, Context, InProcessRuntime, NotMigratable, Workflow
from charon.core.workflows import workflow_operator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from wf_migrate import v1  # noqa: E402

OP = workflow_operator("order")
STARTS = {"a": {"then": "approved", "state": {"n": 1}}, "c": {"then": "charged"}, "u": {"then": "review"},
          "m": {"then": "review"}, "x": {"then": "approved", "state": {"bad": "raise"}},
          "y": {"then": "approved", "state": {"bad": "bytes"}}}


async def _until(rt: InProcessRuntime, wid: str, status: str) -> dict[str, Any]:
    for _ in range(1000):
        rec = rt.read_state(OP, wid)
        if rec is not None and rec["status"] == status:
            return dict(rec)
        await asyncio.sleep(0.01)
    raise AssertionError(rt.read_state(OP, wid))


async def test_a_declared_migration_maps_the_step_and_state_and_replays_exactly(tmp_path: Path) -> None:
    data = tmp_path / "node"
    rt = InProcessRuntime(v1, partitions=2, data_dir=str(data), checkpoint_s=3600)
    async with rt:
        for wid, doc in STARTS.items():
            await rt.invoke(OP, wid, "start", doc)
        recs = {wid: await _until(rt, wid, "waiting") for wid in STARTS}
        await rt.invoke("charon.promise", recs["m"]["awaiting"][0]["id"], "resolve", True)
        mid = await _until(rt, "m", "running")  # its step (review, raising on v1) is retried in 600 s: mid-step
        await rt.engine().update_code("wf_migrate:v2", "2")
        assert await rt.invoke(OP, "a", "migrate", "1") == {"id": "a", "from": "1", "to": "2"}
        a = rt.read_state(OP, "a")
        assert a["version"] == "2" and a["step"] == "approved_v2" and a["status"] == "waiting"
        assert a["state"] == {"n": 1, "ran": ["v1:begin"], "currency": "EUR"}
        assert {k: a["history"][-1][k] for k in ("migrated", "step", "to_step", "seq")} == {
            "migrated": ["1", "2"], "step": "approved", "to_step": "approved_v2", "seq": recs["a"]["seq"]}
        assert a["awaiting"] == recs["a"]["awaiting"] and a["seq"] == recs["a"]["seq"]  # its await is kept
        await rt.invoke(OP, "c", "migrate", "1")
        for wid, why in (("u", "maps no step 'review'"), ("m", "mid-step"), ("x", "raised KeyError: 'no price"),
                         ("y", "not JSON-able")):
            with pytest.raises(NotMigratable, match=why):
                await rt.invoke(OP, wid, "migrate", "1")
            assert rt.read_state(OP, wid) == (mid if wid == "m" else recs[wid])  # nothing changed
        for wid in ("a", "c"):
            await rt.invoke("charon.promise", recs[wid]["awaiting"][0]["id"], "resolve", True)
        assert (await _until(rt, "a", "done"))["result"]["ran"] == ["v1:begin", "v2:approved_v2:EUR"]
        assert (await _until(rt, "c", "done"))["result"] == {"ran": ["v1:begin", "v2:charged"], "currency": "EUR"}
        with rt.finish_lock:  # between epochs: the logged epochs since the last checkpoint (the code update's)
            snapshot = rt.snapshot()
            shutil.copytree(data, tmp_path / "copy")
    again = InProcessRuntime(v1, partitions=2, data_dir=str(tmp_path / "copy"))
    try:
        assert again.replayed_epochs >= 4  # the migrations and the steps after them, run again from the log
        assert again.snapshot() == snapshot
        assert again.read_state(OP, "a") == rt.read_state(OP, "a")
    finally:
        again.close()
        rt.close()


def test_bad_declarations_are_typed() -> None:
    wf = Workflow("w")

    @wf.step(first=True)
    async def one(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
        return w.done()

    @wf.migrates("1", steps={"old": "one"})
    def first(state: dict[str, Any]) -> dict[str, Any]:
        return state

    with pytest.raises(ValueError, match="two migrations from version '1'"):
        wf.migrates("1", steps={"old": "one"})
    with pytest.raises(ValueError, match="non-empty dict"):
        wf.migrates("2", steps={})
    with pytest.raises(TypeError, match="plain function"):
        @wf.migrates("3", steps={"old": "one"})  # type: ignore[type-var]
        async def coro(state: dict[str, Any]) -> dict[str, Any]:
            return state

    @wf.migrates("4", steps={"old": "gone"})
    def to_nowhere(state: dict[str, Any]) -> dict[str, Any]:
        return state

    with pytest.raises(ValueError, match="maps step 'old' to 'gone', which it does not have"):
        Application("x", [], workflows=[wf])
    assert set(wf.migrations) == {"1", "4"}


def test_the_dry_run_forecasts_the_skips_over_http() -> None:
    """``POST /admin/workflows/migrate`` with a declared migration: the dry run changes nothing and counts in
    ``would_skip`` the one at an unmapped step; the real run moves the others (each its own transaction)."""
    from charon.client import Client
    from charon.config import GatewayConfig
    from charon.server.serve import BackgroundServer

    rt = InProcessRuntime(v1, partitions=2)
    cfg = GatewayConfig.from_env(code_refs="wf_migrate:v2")
    with BackgroundServer(rt, token="t", config=cfg) as srv, Client(srv.url, token="t") as c:
        for wid in ("a", "c", "u"):
            c.start_workflow("order", STARTS[wid], id=wid)
        deadline = time.monotonic() + 30
        while {c.workflow("order", w)["status"] for w in ("a", "c", "u")} != {"waiting"}:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        c.update_code("wf_migrate:v2", "2")
        dry = c.migrate_workflows("order", "1", dry_run=True)
        assert (dry["matched"], dry["done"], dry["would_skip"]) == (3, 0, {"NotMigratable": 1}), dry
        assert c.workflow("order", "a")["step"] == "approved"  # a dry run changes nothing
        moved = c.migrate_workflows("order", "1")
        assert (moved["done"], moved["skipped"], moved["would_skip"]) == (2, {"NotMigratable": 1}, {}), moved
        a = c.workflow("order", "a")
        assert (a["version"], a["step"], a["state"]["currency"]) == ("2", "approved_v2", "EUR")
