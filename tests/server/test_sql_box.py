"""The dashboard's SQL box on the in-process runtime (``POST /admin/sql``, SQLite over one consistent cut):
a good query answers over the cut and names its epoch; everything outside one SELECT over the state views is
a typed 4xx before it runs; rows, time, size and concurrency are bounded; the token is required."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest

from charon import InProcessRuntime
from charon.apps import ycsb
from charon.client import AsyncClient, Client
from charon.config import GatewayConfig
from charon.errors import CharonError
from charon.runtime.contract import SQLRejected, SQLSyntaxError, StateTooLarge
from charon.server.serve import BackgroundServer

TOKEN = "sql-t0ken"
N = 60
AUTH = {"Authorization": f"Bearer {TOKEN}"}

#: (query, status, error type): each is refused before it runs
REJECTED = [
    ("DROP TABLE account", 422, "SQLRejected"),
    ("DELETE FROM account", 422, "SQLRejected"),
    ("INSERT INTO account VALUES ('x', '', 1, '1', 0)", 422, "SQLRejected"),
    ("UPDATE account SET value = 0", 422, "SQLRejected"),
    ("CREATE TABLE t (a)", 422, "SQLRejected"),
    ("ATTACH DATABASE '/tmp/charon-sql-box.db' AS x", 422, "SQLRejected"),
    ("PRAGMA table_info(account)", 422, "SQLRejected"),
    ("SELECT * FROM sqlite_master", 422, "SQLRejected"),
    ("SELECT load_extension('/tmp/x')", 422, "SQLRejected"),
    ("SELECT randomblob(100)", 422, "SQLRejected"),
    ("SELECT zeroblob(1000000000)", 422, "SQLRejected"),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c", 422, "SQLRejected"),
    ("BEGIN", 422, "SQLRejected"),
    ("SELECT 1; SELECT 2", 400, "SQLSyntaxError"),
    ("SELECT * FROM nothing_here", 400, "SQLSyntaxError"),
    ("SELEC 1", 400, "SQLSyntaxError"),
]


def _runtime(**kw) -> InProcessRuntime:
    rt = InProcessRuntime(ycsb.app, partitions=4, **kw)
    rt.load("account", ycsb.initial_state(N, 100))
    return rt


def test_sql_box_answers_over_one_cut_and_refuses_the_rest() -> None:
    cfg = GatewayConfig(sql_max_rows=7, sql_max_entities=1000)
    rt = _runtime(epoch_max_ms=2.0)
    stop = threading.Event()
    with BackgroundServer(rt, token=TOKEN, config=cfg) as srv, Client(srv.url, token=TOKEN) as c, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as h:
        def drive() -> None:
            rng = random.Random(3)
            while not stop.is_set():
                c.submit("account", ycsb.key(rng.randrange(N)), "transfer", ycsb.key(rng.randrange(N)), 1)
                time.sleep(0.002)

        loader = threading.Thread(target=drive, daemon=True)
        loader.start()
        try:
            sums = []
            for _ in range(20):  # under load: every answer is one cut, so money is conserved in each
                r = h.post("/admin/sql", json={"sql": "SELECT sum(value) AS total, count(*) AS n FROM account"})
                assert r.status_code == 200, r.text
                doc = r.json()
                assert doc["columns"] == ["total", "n"] and doc["rows"] == [[N * 100, N]], doc
                sums.append(doc["epoch"])
                time.sleep(0.02)
            assert sums[-1] > sums[0], "epochs advanced while querying"
        finally:
            stop.set()
            loader.join()
        # bounded rows: 7 of 60, truncated
        r = h.post("/admin/sql", json={"sql": "SELECT key, value, value_json, item, epoch FROM account ORDER BY key"})
        doc = r.json()
        assert r.status_code == 200 and len(doc["rows"]) == 7 and doc["truncated"] is True
        assert all(row[3] == "" and row[4] == doc["epoch"] and str(row[1]) == row[2] for row in doc["rows"])
        assert doc["engine"] == "sqlite"
        for sql, status, kind in REJECTED:
            r = h.post("/admin/sql", json={"sql": sql})
            assert (r.status_code, r.json()["error"]["type"]) == (status, kind), (sql, r.text)
        # malformed bodies and the token
        assert h.post("/admin/sql", json={"sql": ""}).status_code == 400
        assert h.post("/admin/sql", json={"sql": "SELECT 1", "extra": 1}).status_code == 400
        assert h.post("/admin/sql", json={"sql": "SELECT 1", "epoch": "x"}).status_code == 400
        assert h.post("/admin/sql", json={"sql": "x" * 10_001}).status_code == 400
        assert httpx.post(f"{srv.url}/admin/sql", json={"sql": "SELECT 1"}).status_code == 401
        assert h.post("/admin/sql", json={"sql": "SELECT 1", "epoch": 0}).json()["error"]["type"] == \
            "EpochNotRetained"  # volatile: only the last committed epoch
        # the Python clients
        assert c.sql("SELECT sum(value) FROM account")["rows"] == [[N * 100]]
        with pytest.raises(CharonError, match="SQLRejected|not authorized"):
            c.sql("DROP TABLE account")

        async def via_async() -> dict:
            async with AsyncClient(srv.url, token=TOKEN) as ac:
                return await ac.sql("SELECT count(*) FROM account")

        assert asyncio.run(via_async())["rows"] == [[N]]


def test_sql_box_bounds_time_and_size() -> None:
    rt = _runtime()
    cfg = GatewayConfig(sql_timeout_s=0.3, sql_max_entities=N - 1)
    with BackgroundServer(rt, token=TOKEN, config=cfg) as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as h:
        r = h.post("/admin/sql", json={"sql": "SELECT 1"})
        assert r.status_code == 200 and r.json()["rows"] == [[1]]
        r = h.post("/admin/sql", json={"sql": "SELECT count(*) FROM account"})
        assert (r.status_code, r.json()["error"]["type"]) == (413, "StateTooLarge")
    rt = _runtime()
    with BackgroundServer(rt, token=TOKEN, config=GatewayConfig(sql_timeout_s=0.3)) as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=30) as h:
        t0 = time.monotonic()
        slow = "SELECT count(*) FROM account a, account b, account c, account d, account e"  # 60^5 rows
        r = h.post("/admin/sql", json={"sql": slow})
        assert (r.status_code, r.json()["error"]["type"]) == (422, "SQLTimeout"), r.text
        assert time.monotonic() - t0 < 10


def test_sql_at_an_earlier_epoch_on_a_durable_node(tmp_path) -> None:
    """A durable node answers at a retained checkpoint too (the cut is read from the durable copy)."""

    async def main() -> None:
        rt = _runtime(data_dir=str(tmp_path / "node"), fsync=False)
        try:
            async with rt:
                for i in range(5):
                    await rt.submit("account", ycsb.key(i), "transfer", [ycsb.key(i + 1), 7])
            retained = rt.control_status()["retained_epochs"]
            for e in retained:
                doc = await rt.sql("SELECT sum(value), min(epoch), max(epoch) FROM account", epoch=e)
                assert doc["rows"] == [[N * 100, e, e]] and doc["epoch"] == e
            with pytest.raises(SQLRejected):
                await rt.sql("DELETE FROM account")
            with pytest.raises(SQLSyntaxError):
                await rt.sql("SELECT nope FROM account")
            with pytest.raises(StateTooLarge):
                await rt.sql("SELECT 1 FROM account", max_entities=5)
        finally:
            rt.close()

    asyncio.run(main())
