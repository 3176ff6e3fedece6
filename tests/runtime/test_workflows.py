"""Workflows (charon.core.workflows) on the in-process runtime: each step one transaction that commits once,
effects, promises and timers awaited between steps, compensation, stale deliveries ignored, started from a
transaction iff it commits, a step that aborts retried, typed errors, and the internal functions not exposed."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from charon import (
    Application,
    BadArguments,
    InProcessRuntime,
    Operator,
    PromiseConflict,
    TransactionAborted,
    UnknownFunction,
    UnknownOperator,
    Workflow,
    WorkflowExists,
)
from charon.core.workflows import MINTED_PREFIX, workflow_operator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from workflows_app import app  # noqa: E402

OP = workflow_operator("checkout")


async def _finished(rt: InProcessRuntime, wid: str, status: tuple[str, ...] = ("done", "failed", "compensated"),
                    ) -> dict[str, Any]:
    for _ in range(1000):
        rec = rt.read_state(OP, wid)
        if rec and rec["status"] in status:
            await asyncio.sleep(0.3)  # a second run or delivery would have committed by now
            return dict(rt.read_state(OP, wid))
        await asyncio.sleep(0.01)
    raise AssertionError(rt.read_state(OP, wid))


def _order(**kw: Any) -> dict[str, Any]:
    return {"sku": "apple", "qty": 2, "card": "visa", "amount": 10, **kw}


async def test_a_workflow_runs_its_steps_once_through_an_effect_and_a_timer() -> None:
    async with InProcessRuntime(app) as rt:
        await rt.invoke("stock", "apple", "put", 5)
        out = await rt.invoke(OP, "w1", "start", _order())
        assert out == {"id": "w1", "workflow": "checkout", "status": "running"}
        rec = await _finished(rt, "w1")
        eid = rec["history"][0]["awaits"]["id"]
        assert rec["status"] == "done" and rec["result"] == {"shipped": "apple", "charge": f"ch-{eid}"}
        assert [h["step"] for h in rec["history"]] == ["reserve", "charged", "ship"]
        assert [h.get("awaits", {}).get("kind") for h in rec["history"]] == ["effect", "timer", None]
        assert rec["history"][-1]["finished"] == "done" and rec["steps"] == 3 and rec["version"] == "1"
        assert rt.read_state("steps", "w1") == {"reserve": 1, "charged": 1, "ship": 1}
        assert rt.read_state("stock", "apple") == 3
        with pytest.raises(WorkflowExists):
            await rt.invoke(OP, "w1", "start", _order())
        # a stale delivery (an old seq) and a stale run change nothing but the count
        assert await rt.invoke(OP, "w1", "deliver", {"ok": True, "value": 1}, 2) == {"stale": True}
        assert await rt.invoke(OP, "w1", "run", 1, 1) == {"stale": True}
        again = rt.read_state(OP, "w1")
        assert again["stale"] == rec["stale"] + 2 and again["history"] == rec["history"]
        assert rt.read_state("steps", "w1") == {"reserve": 1, "charged": 1, "ship": 1}


async def test_a_promise_drives_the_next_step_and_a_declined_card_compensates() -> None:
    async with InProcessRuntime(app) as rt:
        await rt.invoke("stock", "apple", "put", 10)
        await rt.invoke(OP, "a", "start", _order(approval=True))
        await rt.invoke(OP, "d", "start", _order(card="declined"))
        for _ in range(500):
            rec = rt.read_state(OP, "a")
            if rec["awaiting"] and rec["awaiting"][0]["kind"] == "promise":
                break
            await asyncio.sleep(0.01)
        assert rec["status"] == "waiting" and rec["step"] == "approved"
        pid = rec["awaiting"][0]["id"]
        await rt.invoke("charon.promise", pid, "resolve", {"by": "alice"})
        done = await _finished(rt, "a")
        assert done["status"] == "done"
        assert rt.read_state("steps", "a") == {"reserve": 1, "charged": 1, "approved": 1, "ship": 1}
        comp = await _finished(rt, "d")
        assert comp["status"] == "compensated" and comp["undo"] == []
        assert rt.read_state("steps", "d") == {"reserve": 1, "charged": 1}
        assert rt.read_state("stock", "apple") == 8, "the declined order's stock was given back, once"


async def test_started_from_a_transaction_iff_it_commits_with_a_minted_id() -> None:
    async with InProcessRuntime(app) as rt:
        await rt.invoke("stock", "apple", "put", 5)
        wid = await rt.invoke("steps", "b1", "begin", _order())
        assert isinstance(wid, str) and wid.startswith(MINTED_PREFIX) and wid.split(".")[2].isdigit()
        assert (await _finished(rt, wid))["status"] == "done"
        with pytest.raises(TransactionAborted, match="never exists"):
            await rt.invoke("steps", "b2", "begin", _order(abort=True))
        await asyncio.sleep(0.3)
        assert rt.read_state("steps", "b2") is None
        assert rt.read_state("stock", "apple") == 3, "the aborted start took nothing"


async def test_a_step_that_aborts_is_retried_and_its_transaction_commits_once() -> None:
    async with InProcessRuntime(app) as rt:
        await rt.invoke("stock", "apple", "put", 5)
        await rt.invoke(OP, "f", "start", _order(flaky=True))
        await rt.invoke(OP, "g", "start", _order(flaky="always"))
        rec = await _finished(rt, "f")
        # ship's first attempt raised (its transaction, and its count, aborted), the second committed
        assert rec["status"] == "done" and rec["history"][-1]["attempt"] == 2
        assert rt.read_state("steps", "f") == {"reserve": 1, "charged": 1, "ship": 1}
        failed = await _finished(rt, "g")
        assert failed["status"] == "failed" and failed["error"].startswith("StepFailed: step 'ship' aborted 3 times")
        assert rt.read_state("steps", "g") == {"reserve": 1, "charged": 1}


def test_the_internal_functions_are_not_exposed_and_bad_declarations_are_typed() -> None:
    with pytest.raises((UnknownOperator, UnknownFunction)):
        app.exposed(OP, "deliver")
    with pytest.raises((UnknownOperator, UnknownFunction)):
        app.exposed(OP, "start")
    assert OP not in app.public_functions()
    with pytest.raises(ValueError, match="reserved"):
        Application("x", [Operator(OP)])
    with pytest.raises(BadArguments):
        Workflow("no/slash")
    wf = Workflow("w")
    with pytest.raises(TypeError, match=r"\(ctx, w, outcome\)"):
        @wf.step
        async def bad(ctx: Any) -> None: ...


def test_a_client_cannot_take_a_minted_workflow_id_over_http() -> None:
    """The ids a transaction's ``start`` mints (``__charon.wf.<tid>.<hash>``) are guessable (the tid is a
    number): a client starting a workflow under one would make that transaction abort with WorkflowExists, or
    run its own input in its place. The gateway refuses such an id (400 ``ReservedRequestId``, before the log),
    whoever asks; a client's own id is started."""
    import httpx

    from charon.server.serve import BackgroundServer

    rt = InProcessRuntime(app, partitions=2)
    with BackgroundServer(rt, token="t") as srv:
        auth = {"Authorization": "Bearer t"}
        for wid in (f"{MINTED_PREFIX}17.abcdef012345", "__charon.other", "fx.x.1.0.done"):
            r = httpx.post(f"{srv.url}/workflows/checkout", json={"id": wid, "input": _order()}, headers=auth,
                           timeout=10)
            assert r.status_code == 400 and r.json()["error"]["type"] == "ReservedRequestId", (wid, r.text)
            assert httpx.get(f"{srv.url}/workflows/checkout/{wid}", headers=auth, timeout=10).status_code == 404
        r = httpx.post(f"{srv.url}/workflows/checkout", json={"id": "mine-1", "input": _order()}, headers=auth,
                       timeout=10)
        assert r.status_code == 200, r.text
        rec = httpx.get(f"{srv.url}/workflows/checkout/mine-1", headers=auth, timeout=10)
        assert rec.status_code == 200 and rec.json()["id"] == "mine-1", rec.text


def test_the_openapi_document_declares_every_workflow_route() -> None:
    """Each workflow route of the gateway (the drain and migration too) is in /openapi.json, its workflow names
    enumerated."""
    from starlette.routing import Route

    from charon.server.openapi import openapi_document
    from charon.server.workflows import workflow_routes

    doc = openapi_document(app, secured=True)
    routes = [r for r in workflow_routes(cast(Any, None)) if isinstance(r, Route)]
    assert len(routes) == 7
    for r in routes:
        path = r.path.replace("{wid:charonkey}", "{wid}")
        for method in r.methods or ():
            if method != "HEAD":
                assert method.lower() in doc["paths"][path], (method, path)
    name = doc["paths"]["/workflows/{name}"]["post"]["parameters"][0]
    assert name["schema"]["enum"] == sorted(app.workflows)


# -- w.all / w.any ------------------------------------------------------------------------------------------------
def _gather_app() -> Any:
    from charon import Application, Context, Workflow

    flow = Workflow("gather", backoff=0.2)

    @flow.step(first=True)
    async def ask(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
        kind = outcome["value"]
        parts = [w.promise(timeout=60), w.promise(timeout=60), w.sleep(30 if kind == "any" else 0.05)]
        return w.all(parts, then=got) if kind == "all" else w.any(parts, then=got)

    @flow.step
    async def got(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
        return w.done(outcome)

    return Application("gathering", [], workflows=[flow]), flow


async def test_all_waits_for_every_await_and_any_for_the_first() -> None:
    gapp, _ = _gather_app()
    op = workflow_operator("gather")

    async def waiting(wid: str) -> dict[str, Any]:
        for _ in range(500):
            rec = rt.read_state(op, wid)
            if rec and rec["status"] == "waiting":
                return dict(rec)
            await asyncio.sleep(0.01)
        raise AssertionError(rt.read_state(op, wid))

    async def finished(wid: str) -> dict[str, Any]:
        for _ in range(500):
            rec = rt.read_state(op, wid)
            if rec and rec["status"] == "done":
                await asyncio.sleep(0.3)  # a second run would have committed by now
                return dict(rt.read_state(op, wid))
            await asyncio.sleep(0.01)
        raise AssertionError(rt.read_state(op, wid))

    async with InProcessRuntime(gapp) as rt:
        await rt.invoke(op, "all", "start", "all")
        rec = await waiting("all")
        assert [a["kind"] for a in rec["awaiting"]] == ["promise", "promise", "timer"] and rec["mode"] == "all"
        p1, p2 = rec["awaiting"][0]["id"], rec["awaiting"][1]["id"]
        await rt.invoke("charon.promise", p2, "resolve", "second")
        await asyncio.sleep(0.3)  # the timer fired too: one promise still missing
        rec = rt.read_state(op, "all")
        assert rec["status"] == "waiting" and rec["outcomes"][0] is None and rec["outcomes"][1]["value"] == "second"
        await rt.invoke("charon.promise", p1, "reject", "no")
        rec = await finished("all")
        assert rec["result"]["ok"] is False and rec["result"]["value"] == [None, "second", None]
        assert [o["ok"] for o in rec["result"]["outcomes"]] == [False, True, True]
        assert rec["history"][0]["awaits"] == {"kind": "all", "ids": [p1, p2, rec["history"][0]["awaits"]["ids"][2]]}
        assert rec["steps"] == 2

        await rt.invoke(op, "any", "start", "any")
        rec = await waiting("any")
        q1, q2 = rec["awaiting"][0]["id"], rec["awaiting"][1]["id"]
        timer = rec["awaiting"][2]["id"]
        await rt.invoke("charon.promise", q2, "resolve", "fast")
        rec = await finished("any")
        assert rec["result"] == {"ok": True, "value": "fast", "index": 1}
        assert timer not in {t.id for t in rt.timers(op, "any")}  # the other timer is cancelled
        # the other promise is withdrawn in the same transaction: cancelled, its continuation arrives stale
        assert rt.read_state("charon.promise", q1)["status"] == "cancelled"
        assert rt.read_state("charon.promise", q2)["status"] == "resolved"
        with pytest.raises(PromiseConflict):
            await rt.invoke("charon.promise", q1, "resolve", "late")
        await asyncio.sleep(0.3)
        late = rt.read_state(op, "any")
        assert late["result"] == rec["result"] and late["stale"] >= 1 and late["steps"] == 2

        # cancelling a waiting workflow withdraws its pending promises and cancels its timers
        await rt.invoke(op, "gone", "start", "any")
        rec = await waiting("gone")
        r1, r2, gone_timer = (a["id"] for a in rec["awaiting"])
        await rt.invoke(op, "gone", "cancel", "no longer needed")
        assert rt.read_state(op, "gone")["status"] == "cancelled"
        assert {rt.read_state("charon.promise", r)["status"] for r in (r1, r2)} == {"cancelled"}
        assert rt.read_state("charon.promise", r1)["error"].endswith("no longer needed")
        assert gone_timer not in {t.id for t in rt.timers(op, "gone")}


async def test_a_step_pinned_to_an_unrecorded_version_fails_and_a_declared_label_runs_the_deployed_code() -> None:
    """A record naming a code version the engine never recorded: its step aborts (``VersionUnavailable``) on every
    attempt, then the workflow fails; a record naming the workflow's declared ``version`` (one started before
    versions were recorded) runs the deployed steps."""
    from charon import Application, Context, VersionUnavailable, Workflow

    flow = Workflow("old", version="7", attempts=2, backoff=0.05)

    @flow.step(first=True)
    async def only(ctx: Context, w: Any, outcome: dict[str, Any]) -> Any:
        return w.done(w.version)

    op = workflow_operator("old")
    async with InProcessRuntime(Application("olds", [], workflows=[flow])) as rt:
        assert (await rt.invoke(op, "fresh", "start", None))["status"] == "running"
        started = {"id": "", "workflow": "old", "status": "waiting", "step": "only", "seq": 1, "awaiting": [],
                   "attempt": 0, "state": {}, "undo": [], "history": [], "dropped": 0, "steps": 0, "stale": 0,
                   "created": 0.0, "updated": 0.0, "result": None, "error": None, "outcome": None, "timers": []}
        for wid, version in (("gone", "9"), ("declared", "7")):
            rt.load(op, {wid: {**started, "id": wid, "version": version}})
            await rt.invoke(op, wid, "deliver", {"ok": True, "value": None}, 1)
        for _ in range(500):
            recs = {w: rt.read_state(op, w) for w in ("fresh", "gone", "declared")}
            if all(r["status"] in ("done", "failed") for r in recs.values()):
                break
            await asyncio.sleep(0.01)
        assert recs["fresh"]["version"] == "1" and recs["fresh"]["result"] == "1"  # the engine's code version
        assert recs["declared"]["status"] == "done" and recs["declared"]["result"] == "7"
        assert recs["gone"]["status"] == "failed" and "StepFailed" in recs["gone"]["error"], recs["gone"]
        rt.load(op, {"due": {**started, "id": "due", "version": "9", "status": "running",
                             "outcome": {"ok": True, "value": None}}})
        with pytest.raises(VersionUnavailable):  # what each attempt of its step aborts with
            await rt.invoke(op, "due", "run", 1, 1)
