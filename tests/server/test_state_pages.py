"""Paging an operator's state over the admin API on the in-process engine (volatile and durable):
``GET /admin/state/{operator}?after=&limit=&prefix=`` pages in key order with a ``next`` cursor, every entity
once; the following pages pinned to the first page's epoch show that cut (durable: while the epoch is retained)
or answer 410 EpochNotRetained; bad paging parameters are typed 400s; ``charon read --after --limit`` in a real
process follows the cursor."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.client import Client
from charon.config import GatewayConfig
from charon.errors import CharonError, EpochNotRetained
from charon.server.serve import BackgroundServer

TOKEN = "p4ges"
N = 250
BALANCE = 10
CHARON = str(Path(sys.executable).parent / "charon")
ALL = sorted(ycsb.key(i) for i in range(N))  # ASCII keys: byte order is string order


def _runtime(**kw) -> InProcessRuntime:
    rt = InProcessRuntime(ycsb.app, partitions=4, epoch_max_ms=2.0, **kw)
    rt.load("account", ycsb.initial_state(N, BALANCE))
    return rt


def _wait(pred, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_pages_in_key_order_each_entity_once_and_a_dropped_epoch_is_410() -> None:
    rt = _runtime()
    try:
        with BackgroundServer(rt, token=TOKEN, wait_timeout=5) as srv, Client(srv.url, token=TOKEN) as c:
            pages = list(c.iter_state("account", limit=40))
            assert [p["count"] for p in pages] == [40] * 6 + [10]
            assert [k for p in pages for k in p["entities"]] == ALL
            assert len({p["epoch"] for p in pages}) == 1
            assert [p["next"] for p in pages] == [ALL[40 * i + 39] for i in range(6)] + [None]
            assert [p["truncated"] for p in pages] == [True] * 6 + [False]
            # a prefix search, paged too
            first = c.read_state("account", prefix="a1", limit=5)
            a1 = [k for k in ALL if k.startswith("a1")]
            assert list(first["entities"]) == a1[:5] and first["next"] == a1[4]
            rest = c.read_state("account", prefix="a1", after=first["next"], epoch=first["epoch"], limit=1000)
            assert list(rest["entities"]) == a1[5:] and rest["next"] is None
            # the volatile runtime keeps only its last epoch: a page of an older cut is refused, not mixed
            c.invoke("account", "a0", "transfer", "a1", 1)
            with pytest.raises(CharonError) as err:
                c.read_state("account", after=pages[0]["next"], epoch=pages[0]["epoch"], limit=40)
            assert type(err.value) is EpochNotRetained  # the class the engine raises (410 over HTTP)
            # bad paging parameters: typed 400s
            auth = {"Authorization": f"Bearer {TOKEN}"}
            for query, kind in [("key=a1&after=a0", "BadRequest"), ("key=a1&prefix=a", "BadRequest"),
                                ("after=", "InvalidKey"), ("prefix=%00", "InvalidKey"),
                                (f"limit={srv.app.config.max_scan + 1}", "BadRequest")]:
                r = httpx.get(f"{srv.url}/admin/state/account?{query}", headers=auth)
                assert r.status_code == 400 and r.json()["error"]["type"] == kind, (query, r.text)
            # the CLI, a real process, follows the cursor
            cmd = [CHARON, "read", "account", "--limit", "100", "--url", srv.url, "--token", TOKEN]
            seen: list[str] = []
            after: list[str] = []
            while True:
                out = subprocess.run(cmd + after, capture_output=True, text=True, timeout=60, check=True)
                doc = json.loads(out.stdout)
                seen += list(doc["entities"])
                if doc["next"] is None:
                    break
                after = ["--after", doc["next"], "--epoch", str(doc["epoch"])]
            assert seen == ALL
    finally:
        rt.close()


def test_durable_pages_stay_on_the_first_pages_cut(tmp_path) -> None:
    rt = _runtime(data_dir=str(tmp_path / "node"), fsync=False, checkpoint_s=0.01)
    try:
        with BackgroundServer(rt, token=TOKEN, wait_timeout=5) as srv, Client(srv.url, token=TOKEN) as c:
            c.invoke("account", "a0", "deposit", 1)
            first = c.read_state("account", limit=100)
            at = first["epoch"]
            _wait(lambda: rt.node.checkpointed_epoch >= at, what="checkpoint")
            assert at in c.status()["retained_epochs"]
            later = ALL[150]  # on the second page: changed after the first page was read
            c.invoke("account", later, "deposit", 5)
            assert c.read_state("account", [later])["entities"][later] == BALANCE + 5
            second = c.read_state("account", after=first["next"], epoch=at, limit=100)
            assert second["epoch"] == at and second["entities"][later] == BALANCE
            assert list(second["entities"]) == ALL[100:200]
            third = c.read_state("account", after=second["next"], epoch=at, limit=100)
            assert list(third["entities"]) == ALL[200:] and third["next"] is None
            total = {**first["entities"], **second["entities"], **third["entities"]}
            assert sum(total.values()) == N * BALANCE + 1  # that cut: the first deposit, not the later one
    finally:
        rt.close()


def test_a_page_stops_at_max_scan_bytes_with_next() -> None:
    rt = InProcessRuntime(ycsb.app, partitions=4, epoch_max_ms=2.0)
    rt.load("account", {ycsb.key(i): "x" * 1000 for i in range(30)})  # ~1 KB an entity
    cfg = GatewayConfig(max_scan_bytes=5_000)
    try:
        with BackgroundServer(rt, token=TOKEN, config=cfg) as srv, Client(srv.url, token=TOKEN) as c:
            first = c.read_state("account", limit=100)
            assert first["count"] == 4 and first["truncated"] is True and first["next"] == sorted(first["entities"])[-1]
            pages = list(c.iter_state("account", limit=100))
            assert all(p["count"] <= 4 for p in pages) and pages[-1]["next"] is None
            assert [k for p in pages for k in p["entities"]] == sorted(ycsb.key(i) for i in range(30))
    finally:
        rt.close()
