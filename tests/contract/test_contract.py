"""The engine contract over HTTP: every runtime-facing behaviour, one test each, against every engine (the
``engine`` fixture: in-process, durable node, Spark; ``--engine`` picks some), asserting the same observable
result on each. One deployment per engine serves the whole module (``contract_app`` behind a real gateway and
the Python client); each test uses keys of its own. The tests that change the deployment itself (rescale, code
update) run last, in that order.

The engines are built by the one factory (``make_engine``, see ``tests/support/contract_engines.py``)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from contract_engines import served

from charon.client import Client
from charon.config import GatewayConfig
from charon.errors import PromiseConflict, TransactionAborted
from charon.server.serve import BackgroundServer

TOKEN = "c0ntract"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PARTITIONS = 2
#: per test, its own accounts (loaded with BALANCE each before the engine starts)
PREFIXES = ("sub", "idem", "err", "read", "pause", "stat", "sql", "tmr", "str", "alone", "resc", "code", "wf")
ACCOUNTS = 6
BALANCE = 100


class Deployment:
    """One engine behind a gateway: the engine, the background server and a client."""

    def __init__(self, engine: str, eng: Any, srv: BackgroundServer, client: Client) -> None:
        self.engine, self.eng, self.srv, self.c = engine, eng, srv, client

    @property
    def url(self) -> str:
        return self.srv.url


def _initial() -> dict[str, int]:
    return {f"{p}{i}": BALANCE for p in PREFIXES for i in range(ACCOUNTS)}


@pytest.fixture(scope="module")
def dep(engine: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    data_dir = str(tmp_path_factory.mktemp(f"contract-{engine}"))
    with served(engine, "contract_app:v1", data_dir, request, token=TOKEN, partitions=PARTITIONS,
                load={"acct": _initial()}, config=GatewayConfig(code_refs="contract_app:v2")) as (eng, srv), \
            Client(srv.url, token=TOKEN, timeout=120) as c:
        yield Deployment(engine, eng, srv, c)


def _wait(pred: Callable[[], bool], timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _balances(c: Client, prefix: str) -> dict[str, Any]:
    return c.read_state("acct", [f"{prefix}{i}" for i in range(ACCOUNTS)])["entities"]


# -- the declared contract -------------------------------------------------------------------------------------
def test_every_engine_offers_the_declared_contract(dep: Deployment) -> None:
    from charon.runtime.contract import Controls, Engine, as_engine

    eng = as_engine(dep.eng)
    assert isinstance(eng, Engine) and isinstance(eng.controls, Controls)
    assert eng.durable is (dep.engine != "inprocess") and dep.c.status()["durable"] is eng.durable
    assert eng.partitions == PARTITIONS and eng.app.name == "contract"


# -- submit and replies ----------------------------------------------------------------------------------------
def test_invoke_replies_with_the_value_and_commits(dep: Deployment) -> None:
    c = dep.c
    assert c.invoke("acct", "sub0", "deposit", 5) == ["v1", BALANCE + 5]
    rid = c.submit("acct", "sub1", "transfer", "sub2", 30)
    res = c.result_of(rid, 120)
    assert res.value == BALANCE - 30 and res.epoch >= 1
    assert c.state("acct", "sub1") == BALANCE - 30 and c.state("acct", "sub2") == BALANCE + 30


def test_a_retried_request_id_runs_once_and_gets_the_same_reply(dep: Deployment) -> None:
    c = dep.c
    rid = f"idem-{uuid.uuid4().hex}"
    first = c.invoke_result("acct", "idem0", "deposit", 7, request_id=rid)
    again = c.invoke_result("acct", "idem0", "deposit", 7, request_id=rid)  # a client's retry
    sub = c.submit("acct", "idem0", "deposit", 7, request_id=rid)
    assert sub == rid
    assert first.value == again.value == c.result_of(rid, 120).value == ["v1", BALANCE + 7]
    assert first.epoch == again.epoch
    assert c.state("acct", "idem0") == BALANCE + 7, "executed once"


def test_an_aborted_transaction_is_a_typed_error_and_changes_nothing(dep: Deployment) -> None:
    c = dep.c
    with pytest.raises(TransactionAborted) as info:
        c.invoke("acct", "err0", "transfer", "err1", BALANCE + 1)
    assert info.value.error_type == "ValueError" and f"cannot transfer {BALANCE + 1}" in str(info.value)
    assert _balances(c, "err") == {f"err{i}": BALANCE for i in range(ACCOUNTS)}
    r = httpx.post(f"{dep.url}/invoke/acct/err0/no_such_function", json={"args": []}, headers=AUTH)
    assert r.status_code == 404, r.text


# -- state reads -----------------------------------------------------------------------------------------------
def test_state_reads_see_one_committed_epoch(dep: Deployment) -> None:
    c = dep.c
    c.invoke("acct", "read0", "transfer", "read1", 40)
    assert c.state("acct", "read0") == BALANCE - 40
    cut = c.read_state("acct", [f"read{i}" for i in range(ACCOUNTS)])
    assert cut["entities"] == {"read0": 60, "read1": 140, **{f"read{i}": BALANCE for i in range(2, ACCOUNTS)}}
    assert cut["count"] == ACCOUNTS and cut["truncated"] is False and cut["epoch"] >= 1
    assert c.state("acct", "read-nobody") is None
    page = c.read_state("acct", limit=3)
    assert page["count"] == 3 and page["truncated"] is True


# -- pause / resume / status -----------------------------------------------------------------------------------
def test_pause_holds_epochs_and_resume_runs_the_backlog_in_arrival_order(dep: Deployment) -> None:
    c = dep.c
    c.invoke("acct", "pause0", "deposit", 1)
    st = c.pause()
    assert st["state"] in ("paused", "pausing")
    _wait(lambda: c.status()["state"] == "paused", what="paused")
    frozen = c.status()["epoch"]
    rids = [c.submit("acct", f"pause{i % ACCOUNTS}", "deposit", 1) for i in range(12)]
    _wait(lambda: c.status()["backlog"] >= 12, what="the backlog")
    time.sleep(0.5)
    st = c.status()
    assert st["epoch"] == frozen and st["paused"] is True and st["backlog"] >= 12
    r = httpx.get(f"{dep.url}/requests/{rids[0]}", headers=AUTH)
    assert r.status_code == 202 and r.json()["status"] == "pending"
    # the inspector lists them as pending on every engine (on Spark: still in the input log, before any epoch)
    page = httpx.get(f"{dep.url}/admin/requests", params={"status": "pending", "limit": 100}, headers=AUTH).json()
    listed = {i["request_id"]: i for i in page["items"]}
    assert set(rids) <= set(listed) and all(listed[r]["epoch"] is None for r in rids), sorted(listed)
    st = c.resume()
    assert st["paused"] is False
    results = [c.result_of(rid, 120) for rid in rids]
    assert all(res.epoch > frozen for res in results)
    order = [(res.epoch, res.tid) for res in results]
    assert order == sorted(order), "the requests that waited ran in arrival order"
    _wait(lambda: c.status()["backlog"] == 0, what="drained")
    assert sum(_balances(c, "pause").values()) == ACCOUNTS * BALANCE + 13
    page = httpx.get(f"{dep.url}/admin/requests", params={"status": "pending", "limit": 100}, headers=AUTH).json()
    assert not set(rids) & {i["request_id"] for i in page["items"]}
    assert httpx.get(f"{dep.url}/admin/requests/{rids[0]}", headers=AUTH).json()["status"] == "committed"


def test_status_and_metrics_say_the_same_on_every_engine(dep: Deployment) -> None:
    c = dep.c
    c.invoke("acct", "stat0", "deposit", 1)
    st = c.status()
    assert {"state", "paused", "epoch", "backlog", "code_version"} <= set(st), st
    assert st["state"] == "running" and st["paused"] is False and st["epoch"] >= 1
    assert c.health()["ok"] is True
    assert "charon_paused 0.0" in c.metrics()


# -- SQL -------------------------------------------------------------------------------------------------------
def test_sql_answers_over_one_consistent_cut(dep: Deployment) -> None:
    c = dep.c
    c.invoke("acct", "sql0", "transfer", "sql1", 25)
    doc = c.sql("SELECT sum(value) AS total, count(*) AS n FROM acct WHERE item = '' AND key LIKE 'sql%'")
    assert doc["columns"] == ["total", "n"] and doc["rows"] == [[ACCOUNTS * BALANCE, ACCOUNTS]], doc
    assert doc["epoch"] >= 1 and doc["truncated"] is False
    one = c.sql("SELECT value FROM acct WHERE item = '' AND key = 'sql1'")
    assert one["rows"] == [[BALANCE + 25]]
    r = httpx.post(f"{dep.url}/admin/sql", json={"sql": "DROP TABLE acct"}, headers=AUTH)
    assert r.status_code == 422 and r.json()["error"]["type"] == "SQLRejected", r.text


# -- timers ----------------------------------------------------------------------------------------------------
def test_a_timer_is_listed_then_fires_once(dep: Deployment) -> None:
    c = dep.c
    tid = c.invoke("acct", "tmr0", "hold", "h", 30, 1.5)
    assert c.state("acct", "tmr0") == BALANCE - 30
    listed = c.timers("acct", "tmr0")
    assert [(t["id"], t["function"], t["key"], t["args"]) for t in listed] == [(tid, "release", "tmr0", ["h", 30])]
    _wait(lambda: c.timers("acct", "tmr0") == [], what="the timer to fire")
    # the next epoch of another entity: the fired timer's epoch is committed and nothing fires twice
    c.invoke("acct", "tmr1", "deposit", 1)
    _wait(lambda: c.state("acct", "tmr0") == BALANCE, what="the release")
    cut = c.read_state("acct", ["tmr0"])
    assert cut["items"]["tmr0"] == {"fired:h": 1}, cut


# -- streams ---------------------------------------------------------------------------------------------------
def test_events_of_committed_transactions_reach_the_stream_once(dep: Deployment) -> None:
    c = dep.c
    start = c.read_stream("deposits", 0, limit=1).end_offset
    for i in range(4):
        c.invoke("acct", f"str{i}", "deposit", 10 + i)
    with pytest.raises(TransactionAborted):
        c.invoke("acct", "str5", "transfer", "str4", BALANCE * 5)  # aborted: its deposit's event never appears
    got: list[Any] = []
    offset = start

    def mine() -> list[Any]:
        return [e.value for e in got if isinstance(e.value, list) and str(e.value[0]).startswith("str")]

    deadline = time.monotonic() + 120
    while len(mine()) < 4 and time.monotonic() < deadline:
        page = c.read_stream("deposits", offset, limit=1000, wait=0.5)
        got.extend(page.events)
        offset = page.next_offset
    assert mine() == [[f"str{i}", 10 + i] for i in range(4)]
    page = c.read_stream("deposits", offset, wait=0.3)
    assert [e.value for e in page.events if str(e.value[0]).startswith("str")] == []


# -- run alone (a serializable admin update) -------------------------------------------------------------------
def test_bulk_cancels_by_filter_go_through_the_engine(dep: Deployment) -> None:
    """Bulk cancels (issue 34 item 5): pending promises through their own cancel, queued invocations by the epoch
    that takes the cancel; a dry run changes nothing; each item is cancelled once."""
    c = dep.c
    keys = [f"bulk{i}" for i in range(4)]
    pids = {k: c.invoke("acct", k, "wait", 3600.0) for k in keys}
    dry = c.bulk("promises", "cancel", {"key_prefix": "bulk", "function": "woken"}, dry_run=True, limit=1000)
    assert (dry["matched"], dry["done"]) == (4, 0) and {c.promise(p)["status"] for p in pids.values()} == {"pending"}
    total = c.bulk_all("promises", "cancel", {"key_prefix": "bulk", "operator": "acct"}, limit=3)
    assert total["done"] == 4 and total["pages"] >= 2
    assert {c.promise(p)["status"] for p in pids.values()} == {"cancelled"}
    _wait(lambda: all(c.read_state("acct", [k])["items"].get(k, {}).get("woken") for k in keys),
          what="the continuations")
    time.sleep(0.5)  # a second continuation would have run by now
    assert all(c.read_state("acct", [k])["items"][k]["woken"] == ["PromiseCancelled"] for k in keys)
    assert c.bulk("promises", "cancel", {"key_prefix": "bulk"}, limit=1000)["matched"] == 0

    rids = [c.submit("acct", "bulkq", "queued", 1, request_id=f"bulkq-{uuid.uuid4().hex}") for _ in range(3)]
    _wait(lambda: c.limits()["held"] == 2, what="two requests waiting for admission")
    assert c.bulk("invocations", "cancel", {"function": "queued"}, dry_run=True)["matched"] == 2
    gone = c.bulk("invocations", "cancel", {"operator": "acct", "key_prefix": "bulkq"})
    assert gone["done"] == 2 and sorted(gone["items"]) == sorted(rids[1:]) and c.limits()["held"] == 0
    assert c.result_of(rids[0]).value == 1
    for rid in rids[1:]:
        with pytest.raises(TransactionAborted) as info:
            c.result_of(rid)
        assert info.value.error_type == "InvocationCancelled"
    assert c.read_state("acct", ["bulkq"])["items"]["bulkq"]["queued"] == 1


def test_a_workflow_step_awaits_a_promise(dep: Deployment) -> None:
    """A workflow (issue 34 item 4): its first step deposits and awaits a durable promise; resolving it runs the
    next step once (a second resolve is a conflict, never a second step); the record shows both steps' TIDs."""
    c = dep.c
    started = c.start_workflow("approve", {"acct": "wf0", "amount": 5}, id="wf-a")
    assert started["id"] == "wf-a" and started["workflow"] == "approve"

    def waiting() -> bool:
        rec = c.workflow("approve", "wf-a")
        return rec["status"] == "waiting" and rec["step"] == "approved" and bool(rec["awaiting"])

    _wait(waiting, what="the first step to await its promise")
    rec = c.workflow("approve", "wf-a")
    (awaited,) = rec["awaiting"]
    assert awaited["kind"] == "promise" and c.promise(awaited["id"])["status"] == "pending"
    assert rec["version"] == "v1" and _balances(c, "wf")["wf0"] == BALANCE + 5
    c.resolve(awaited["id"], 7)
    _wait(lambda: c.workflow("approve", "wf-a")["status"] == "done", what="the workflow to finish")
    rec = c.workflow("approve", "wf-a")
    assert rec["result"] == ["v1:ask", "v1:approved"]
    assert [h["step"] for h in rec["history"]] == ["ask", "approved"] and all(h["tid"] for h in rec["history"])
    with pytest.raises(PromiseConflict):
        c.resolve(awaited["id"], 7)
    time.sleep(0.5)  # a second step would have run by now
    assert _balances(c, "wf")["wf0"] == BALANCE + 12 and c.workflow("approve", "wf-a")["steps"] == 2
    assert [r["id"] for r in c.workflows("approve")["workflows"]] == ["wf-a"]
    # the drain counts the ones in flight per code version; a migration to the version they run on is refused by
    # each one's own transaction (NotMigratable); a cancelled one leaves the drain
    c.start_workflow("approve", {"acct": "wf1", "amount": 1}, id="wf-b")
    _wait(lambda: c.workflow("approve", "wf-b")["status"] == "waiting", what="wf-b to wait")
    assert c.workflow_versions()["versions"] == {"v1": {"running": 0, "waiting": 1}}
    assert c.migrate_workflows("approve", "v1", dry_run=True)["matched"] == 1
    moved = c.migrate_workflows("approve", "v1")
    assert moved["done"] == 0 and moved["skipped"] == {"NotMigratable": 1}, moved
    assert c.cancel_workflow("approve", "wf-b")["status"] == "cancelled"
    assert c.workflow_versions()["versions"] == {}


def test_an_admin_update_runs_alone_once_per_id(dep: Deployment) -> None:
    c = dep.c
    keys = [f"alone{i}" for i in range(ACCOUNTS)]
    uid = f"bonus-{uuid.uuid4().hex[:8]}"
    out = c.admin_update(uid, "acct", "deposit", 3, keys=keys)
    assert out["committed"] == ACCOUNTS and out["repeated"] is False and out["epochs"], out
    assert c.admin_update(uid, "acct", "deposit", 3, keys=keys)["repeated"] is True
    assert _balances(c, "alone") == {k: BALANCE + 3 for k in keys}


# -- the deployment itself: rescale, then a code update --------------------------------------------------------
def test_rescale_moves_nothing_lost_and_keeps_serving(dep: Deployment) -> None:
    c = dep.c
    stop = threading.Event()
    errors: list[BaseException] = []
    done: list[str] = []

    def drive() -> None:
        i = 0
        try:
            while not stop.is_set():
                done.append(c.submit("acct", f"resc{i % ACCOUNTS}", "deposit", 1))
                i += 1
                time.sleep(0.01)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=drive)
    t.start()
    try:
        out = c.rescale(PARTITIONS + 1)
        assert (out["from"], out["to"]) == (PARTITIONS, PARTITIONS + 1), out
        assert isinstance(out["epoch"], int) and out["keys"] >= 1, out
        time.sleep(0.5)
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert all(c.result_of(rid, 120).value[0] == "v1" for rid in done)
    assert sum(_balances(c, "resc").values()) == ACCOUNTS * BALANCE + len(done)
    assert c.invoke("acct", "resc0", "deposit", 0)[0] == "v1"
    r = httpx.post(f"{dep.url}/admin/rescale", json={"partitions": 0}, headers=AUTH)
    assert r.status_code == 400, r.text


def test_a_code_update_takes_effect_at_one_epoch_boundary(dep: Deployment) -> None:
    c = dep.c
    before = c.invoke_result("acct", "code0", "deposit", 1)
    assert before.value[0] == "v1"
    out = c.update_code("contract_app:v2", "v2")
    e = out["from_epoch"]
    assert isinstance(e, int) and e > before.epoch, out
    after = c.invoke_result("acct", "code1", "deposit", 1)
    assert after.value == ["v2", BALANCE + 1] and after.epoch >= e
    assert c.status()["code_version"] == "v2"
    from charon.runtime.contract import as_engine

    eng = as_engine(dep.eng)  # the version lookup: which code each epoch ran
    assert eng.version_at(before.epoch) == "v1" and eng.version_at(after.epoch) == "v2"
    r = httpx.post(f"{dep.url}/admin/code", json={"ref": "not_allowed:app", "version": "x"}, headers=AUTH)
    assert 400 <= r.status_code < 500, r.text
