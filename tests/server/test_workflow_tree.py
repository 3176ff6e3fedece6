"""``GET /workflows/{name}/{id}/tree`` and ``charon workflows show --tree`` over a gateway with an effect executor
beside its durable in-process node: a checkout with two committed steps (reserve, then charged after its effect)
waiting on an approval promise shows both steps with their transactions' call graphs from the inspector and the
promise's status and deadline; an unknown workflow is a typed 404, a bad parameter a typed 400."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from charon import InProcessRuntime
from charon.cli import app as cli
from charon.client import Client
from charon.runtime.effects import EffectExecutor, engine_resume
from charon.server.serve import BackgroundServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from workflows_app import app  # noqa: E402

TOKEN = "wf-tree"
ORDER = {"sku": "apple", "qty": 2, "card": "visa", "amount": 10, "approval": True}


def _waiting_on_approval(c: Client, wid: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rec = c.workflow("checkout", wid)
        if rec["status"] == "waiting" and rec["step"] == "approved":
            return rec
        time.sleep(0.05)
    raise AssertionError(rec)


@pytest.fixture
def served(tmp_path: Path) -> Any:
    rt = InProcessRuntime(app, partitions=2, data_dir=str(tmp_path / "node"))
    eng = rt.engine()
    ex = EffectExecutor(app, lambda: eng.streams, engine_resume(eng.submit), backoff_s=0.01)
    try:
        with BackgroundServer(rt, token=TOKEN, effects=ex) as srv, Client(srv.url, token=TOKEN) as c:
            c.invoke("stock", "apple", "put", 10)
            c.start_workflow("checkout", ORDER, id="o-1")
            yield srv, c, _waiting_on_approval(c, "o-1"), ex
    finally:
        rt.close()


def test_the_tree_has_each_step_with_its_call_graph_and_the_pending_promise(served: Any) -> None:
    srv, c, rec, _ = served
    tree = c.workflow_tree("checkout", "o-1")
    assert {k: tree[k] for k in ("id", "workflow", "status", "step")} == {
        "id": "o-1", "workflow": "checkout", "status": "waiting", "step": "approved"}
    assert isinstance(tree["epoch"], int) and tree["omitted"] == 0
    assert [(s["step"], s["seq"], s["tid"]) for s in tree["steps"]] == [
        (e["step"], e["seq"], e["tid"]) for e in rec["history"]]
    reserve, charged = tree["steps"]
    assert (reserve["step"], charged["step"]) == ("reserve", "charged")
    assert reserve["awaits"]["kind"] == "effect" and charged["awaits"]["kind"] == "promise"
    for s in (reserve, charged):
        root, *calls = s["call_graph"]
        assert (root["kind"], root["operator"], root["function"], root["key"]) == (
            "root", "charon.workflow.checkout", "run", "o-1")
        assert ("steps", "count") in {(n["operator"], n["function"]) for n in calls}
        assert all(n["outcome"] == "ok" for n in s["call_graph"])
    assert ("stock", "take", "apple") in {(n["operator"], n["function"], n["key"]) for n in reserve["call_graph"]}
    [waiting] = tree["awaiting"]
    assert waiting["kind"] == "promise" and waiting["id"] == charged["awaits"]["id"] == rec["awaiting"][0]["id"]
    assert waiting["promise"]["status"] == "pending"
    assert waiting["promise"]["deadline"] == pytest.approx(waiting["promise"]["created"] + 3600)
    assert c.workflow_tree("checkout", "o-1", steps=1)["omitted"] == 1

    h = {"Authorization": f"Bearer {TOKEN}"}
    for path, status, etype in (("/workflows/checkout/nobody/tree", 404, "UnknownWorkflow"),
                                ("/workflows/nothing/o-1/tree", 404, "UnknownWorkflow"),
                                ("/workflows/checkout/o-1/tree?steps=0", 400, "BadRequest"),
                                ("/workflows/checkout/o-1/tree?depth=2", 400, "BadRequest")):
        r = httpx.get(srv.url + path, headers=h, timeout=10)
        assert r.status_code == status and r.json()["error"]["type"] == etype, (path, r.text)
    assert httpx.get(srv.url + "/workflows/checkout/o-1/tree", timeout=10).status_code == 401


def test_charon_workflows_show_tree_draws_it(served: Any) -> None:
    srv, _, _, _ = served
    env = {"CHARON_URL": srv.url, "CHARON_TOKEN": TOKEN, "COLUMNS": "200"}
    out = CliRunner().invoke(cli, ["workflows", "show", "checkout", "o-1", "--tree"], env=env)
    assert out.exit_code == 0, out.output
    text = out.output
    assert "workflow checkout 'o-1': waiting at step 'approved'" in text
    assert "step reserve seq=1" in text and "awaits effect fx." in text
    assert "step charged seq=2" in text and "awaits promise pr." in text
    assert "call stock.take key='apple' [ok]" in text and "root charon.workflow.checkout.run key='o-1' [ok]" in text
    assert "awaiting promise pr." in text and ": pending, deadline " in text
    gone = CliRunner().invoke(cli, ["workflows", "show", "checkout", "nobody", "--tree"], env=env)
    assert gone.exit_code != 0 and "UnknownWorkflow" in gone.output


def test_an_awaited_effect_shows_its_executor_row_or_why_not(served: Any, tmp_path: Path) -> None:
    """The executor's row of an effect (what the tree shows for an awaited one: status, attempts, last error) is
    found by its id; a gateway without an executor says so in the awaited effect's note."""
    _, _, rec, ex = served
    eid = rec["history"][0]["awaits"]["id"]
    row = ex.get_effect(eid)
    assert row is not None and (row["status"], row["attempts"], row["outcome"], row["last_error"]) == (
        "done", 1, "ok", "")
    assert ex.get_effect(eid + "9") is None
    rt = InProcessRuntime(app, partitions=2, data_dir=str(tmp_path / "bare"))
    try:
        with BackgroundServer(rt, token=TOKEN) as bare, Client(bare.url, token=TOKEN) as b:
            b.invoke("stock", "apple", "put", 10)
            b.start_workflow("checkout", ORDER, id="o-2")
            deadline = time.monotonic() + 20
            while (t := b.workflow_tree("checkout", "o-2"))["step"] != "charged" or not t["awaiting"]:
                assert time.monotonic() < deadline, t
                time.sleep(0.05)
            [waiting] = t["awaiting"]
            assert waiting["kind"] == "effect" and "effect" not in waiting
            assert waiting["note"].startswith("no effect executor beside this gateway")
    finally:
        rt.close()
