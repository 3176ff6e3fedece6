"""The invocation inspector over HTTP (a real uvicorn gateway, the in-process engine): GET /admin/requests with
each filter and its cursor, GET /admin/requests/{id} with reply, call graph and traceback, typed 400/401/404."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import inspector_app
import pytest

from charon.runtime.node.inprocess import InProcessRuntime
from charon.server.serve import BackgroundServer

TOKEN = "inspector-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, dict[str, str]]]:
    rt = InProcessRuntime(inspector_app.app, partitions=2, warmup_txns=0, gc_tuning=False)
    rt.load("account", {"a": 100, "b": 0, "c": 5})
    with BackgroundServer(rt, token=TOKEN) as srv, httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as c:
        ids: dict[str, str] = {}

        def invoke(name: str, op: str, key: str, fn: str, *args: Any) -> None:
            r = c.post(f"/invoke/{op}/{key}/{fn}", json={"args": list(args)}, headers={"Idempotency-Key": name})
            assert r.status_code in (200, 409), r.text
            ids[name] = name

        invoke("ok1", "bank", "t1", "transfer", "a", "b", 30)
        invoke("over", "bank", "t2", "transfer", "c", "a", 1000)  # account.withdraw raises Overdrawn
        invoke("boom", "bank", "t3", "fail", "boom")  # the root raises ValueError
        for i in range(5):
            invoke(f"dep{i}", "account", f"k{i}", "deposit", i)
        yield srv.url, ids


def _get(url: str, path: str, **params: Any) -> httpx.Response:
    return httpx.get(url + path, params=params, headers=AUTH, timeout=30)


def test_list_newest_first_and_each_filter(gateway: tuple[str, dict[str, str]]) -> None:
    url, _ = gateway
    page = _get(url, "/admin/requests").json()
    rids = [i["request_id"] for i in page["items"]]
    assert rids[:3] == ["dep4", "dep3", "dep2"] and rids[-3:] == ["boom", "over", "ok1"]  # newest first
    assert page["next"] is None and page["retention"]["max_records"] == 10_000
    assert page["retention"]["oldest"] is not None
    by = lambda **p: [i["request_id"] for i in _get(url, "/admin/requests", **p).json()["items"]]  # noqa: E731
    assert by(status="aborted") == ["boom", "over"]
    assert by(status="committed")[-1] == "ok1" and "over" not in by(status="committed")
    assert by(status="pending") == [] and by(status="quarantined") == []
    assert by(operator="bank") == ["boom", "over", "ok1"]
    assert by(key="t2") == ["over"]
    assert by(function="fail") == ["boom"]
    assert by(error_type="Overdrawn") == ["over"]
    ok1 = _get(url, "/admin/requests/ok1").json()
    assert by(epoch_min=ok1["epoch"], epoch_max=ok1["epoch"]) == ["ok1"]
    later = _get(url, "/admin/requests/dep0").json()["accepted_at"]
    assert by(since=later) == ["dep4", "dep3", "dep2", "dep1", "dep0"]
    assert by(until=later - 1e-6) == ["boom", "over", "ok1"]
    assert by(until=time.time() - 3600) == []


def test_pages_follow_the_cursor(gateway: tuple[str, dict[str, str]]) -> None:
    url, _ = gateway
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 3}
        if cursor:
            params["cursor"] = cursor
        page = _get(url, "/admin/requests", **params).json()
        assert len(page["items"]) <= 3
        seen += [i["request_id"] for i in page["items"]]
        pages += 1
        cursor = page["next"]
        if cursor is None:
            break
    assert pages == 3 and len(seen) == 8 == len(set(seen))
    everything = [i["request_id"] for i in _get(url, "/admin/requests").json()["items"]]
    assert seen == everything


def test_detail_of_a_transfer_and_of_aborts(gateway: tuple[str, dict[str, str]]) -> None:
    url, _ = gateway
    d = _get(url, "/admin/requests/ok1").json()
    assert d["status"] == "committed" and d["reply"] == [70, 30] and d["error"] is None and not d["truncated"]
    assert d["accepted_at"] <= d["sequenced_at"] <= d["replied_at"]
    graph = [(n["index"], n["parent"], n["kind"], n["operator"], n["key"], n["function"], n["outcome"])
             for n in d["call_graph"]]
    assert graph == [(0, None, "root", "bank", "t1", "transfer", "ok"),
                     (1, 0, "call", "account", "a", "withdraw", "ok"),
                     (2, 0, "call", "account", "b", "deposit", "ok"),
                     (3, 0, "send", "account", "b", "notify", "ok")]
    over = _get(url, "/admin/requests/over").json()
    assert over["status"] == "aborted" and over["reply"] is None
    assert over["error"]["type"] == "Overdrawn" and "needs 1000" in over["error"]["message"]
    tb = over["error"]["traceback"]
    src = inspector_app.__file__
    line = next(i for i, text in enumerate(open(src).read().splitlines(), 1) if "WITHDRAW-RAISES" in text)
    assert f'File "{src}", line {line}, in withdraw' in tb and "WITHDRAW-RAISES" in tb  # the user's file and line
    assert "charon/core" not in tb  # the engine's frames are left out
    assert [(n["function"], n["outcome"]) for n in over["call_graph"]] == [("transfer", None), ("withdraw", "raised")]
    boom = _get(url, "/admin/requests/boom").json()
    assert "ROOT-RAISES" in boom["error"]["traceback"] and boom["call_graph"][0]["outcome"] == "raised"


def test_typed_refusals(gateway: tuple[str, dict[str, str]]) -> None:
    url, _ = gateway
    assert httpx.get(url + "/admin/requests", timeout=30).status_code == 401
    assert httpx.get(url + "/admin/requests/ok1", timeout=30).status_code == 401
    missing = _get(url, "/admin/requests/nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFound"
    for bad in ({"colour": "red"}, {"status": "exploded"}, {"limit": 0}, {"limit": 1001}, {"limit": "x"},
                {"epoch_min": -1}, {"since": "yesterday"}, {"until": "nan"}, {"cursor": "garbage!"}, {"key": ""}):
        r = _get(url, "/admin/requests", **bad)
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequest", (bad, r.text)
    twice = httpx.get(url + "/admin/requests?key=a&key=b", headers=AUTH, timeout=30)
    assert twice.status_code == 400
