"""The SQL box (``POST /admin/sql``, answered in the SQL sandbox over one consistent cut) on every engine: under
load each answer is one cut (money conserved, one epoch), at the latest and at an earlier retained epoch; every
query outside one SELECT over the state views is the same typed 4xx before it runs; rows and time are bounded
(a cancelled query leaves the epochs running); the token is required.

(It replaces the Spark twin of ``tests/server/test_sql_box.py``, whose assertions it makes on all three engines;
the in-process file keeps its bounds on size, concurrency and the async client.)"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from contract_engines import served

from charon.apps import ycsb
from charon.client import Client
from charon.config import GatewayConfig
from charon.server.serve import BackgroundServer

TOKEN = "sq1"
N = 40
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GOOD = {"sql": "SELECT sum(value) AS total, count(*) AS n, min(epoch), max(epoch) FROM account"}

#: (query, status, error type): each is refused before it runs, alike on every engine (Spark SQL's dangerous
#: forms included: a Spark-only form SQLite does not parse is 400 SQLSyntaxError)
REJECTED = [
    ("SELECT reflect('java.lang.Runtime', 'getRuntime')", 422, "SQLRejected"),
    ("SELECT java_method('java.lang.System', 'exit', 0)", 422, "SQLRejected"),
    ("SELECT `reflect`('java.lang.Runtime', 'getRuntime')", 422, "SQLRejected"),
    ("SELECT IDENTIFIER('reflect')('a', 'b')", 400, "SQLSyntaxError"),
    ("SELECT transform(array(1), x -> reflect('a', 'b'))", 422, "SQLRejected"),
    ("SELECT * FROM parquet.`/etc`", 400, "SQLSyntaxError"),
    ("SELECT * FROM json.`file:///etc/hostname`", 400, "SQLSyntaxError"),
    ("SELECT * FROM read_files('/etc')", 400, "SQLSyntaxError"),
    ("SELECT * FROM range(10)", 400, "SQLSyntaxError"),
    ("SELECT input_file_name() FROM account", 422, "SQLRejected"),
    ("SELECT * FROM default.account", 400, "SQLSyntaxError"),
    ("SELECT * FROM spark_catalog.default.t", 400, "SQLSyntaxError"),
    ("SELECT * FROM other_table", 400, "SQLSyntaxError"),
    ("SHOW TABLES", 400, "SQLSyntaxError"),
    ("SET spark.sql.ansi.enabled=false", 400, "SQLSyntaxError"),
    ("DROP TABLE account", 422, "SQLRejected"),
    ("CREATE TABLE t (a INT)", 422, "SQLRejected"),
    ("INSERT INTO account VALUES ('k', '', 1, '1', 0)", 422, "SQLRejected"),
    ("CACHE TABLE account", 400, "SQLSyntaxError"),
    ("ADD JAR /tmp/x.jar", 400, "SQLSyntaxError"),
    ("EXPLAIN SELECT 1", 422, "SQLRejected"),
    ("SELECT current_user()", 422, "SQLRejected"),
    ("SELECT 1; SELECT 2", 400, "SQLSyntaxError"),
    ("SELEC 1", 400, "SQLSyntaxError"),
    ("SELECT no_such_column FROM account", 400, "SQLSyntaxError"),
    ("DELETE FROM account", 422, "SQLRejected"),
    ("UPDATE account SET value = 0", 422, "SQLRejected"),
    ("ATTACH DATABASE '/tmp/charon-sql-box.db' AS x", 422, "SQLRejected"),
    ("PRAGMA table_info(account)", 422, "SQLRejected"),
    ("SELECT * FROM sqlite_master", 422, "SQLRejected"),
    ("SELECT load_extension('/tmp/x')", 422, "SQLRejected"),
    ("SELECT randomblob(100)", 422, "SQLRejected"),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c", 422, "SQLRejected"),
    ("BEGIN", 422, "SQLRejected"),
]


@pytest.fixture(scope="module")
def srv(engine: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[BackgroundServer]:
    data_dir = str(tmp_path_factory.mktemp(f"sql-{engine}"))
    with served(engine, "charon.apps.ycsb:app", data_dir, request, token=TOKEN,
                load={"account": ycsb.initial_state(N, 100)},
                config=GatewayConfig(sql_max_rows=5, sql_timeout_s=2.0)) as (_, server):
        yield server


def test_sql_answers_one_cut_under_load_at_the_latest_and_a_retained_epoch(srv: BackgroundServer) -> None:
    stop = threading.Event()
    with Client(srv.url, token=TOKEN, timeout=120) as c, httpx.Client(base_url=srv.url, headers=AUTH,
                                                                      timeout=120) as h:
        def drive() -> None:
            rng = random.Random(1)
            while not stop.is_set():
                c.submit("account", ycsb.key(rng.randrange(N)), "transfer", ycsb.key(rng.randrange(N)), 1)
                time.sleep(0.01)

        loader = threading.Thread(target=drive, daemon=True)
        loader.start()
        try:
            deadline = time.monotonic() + 120
            while c.status()["epoch"] < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            r = h.post("/admin/sql", json=GOOD)
            assert r.status_code == 200, r.text
            doc = r.json()
            e = doc["epoch"]
            assert doc["engine"] == "sqlite" and doc["columns"][:2] == ["total", "n"]  # the SQL sandbox
            assert doc["rows"] == [[N * 100, N, e, e]], doc
            deadline = time.monotonic() + 120
            while c.status()["epoch"] <= e and time.monotonic() < deadline:
                time.sleep(0.05)
            # a durable engine keeps an earlier epoch (its durable copy), except just after a compaction reached the
            # latest one (Spark's epochs are fast: its base may be the latest epoch for a moment): epochs go on
            deadline = time.monotonic() + 120
            while True:
                later = h.post("/admin/sql", json=GOOD).json()
                assert later["rows"][0][:2] == [N * 100, N] and later["epoch"] > e, "epochs ran meanwhile"
                st = c.status()
                retained = st.get("retained_epochs") or list(range(st["retained_from"], st["epoch"] + 1))
                older = [x for x in retained if x < later["epoch"]]
                if older or not st["durable"] or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if st["durable"]:
                assert older, st
            # earlier epochs: each one the status says is retained answers its own cut, any other is 410
            for x in {e, *older[-1:]}:
                earlier = h.post("/admin/sql", json={**GOOD, "epoch": x})
                if x in retained and earlier.status_code == 410:  # epochs ran on: a compaction passed it since
                    now = c.status()
                    still = now.get("retained_epochs") or list(range(now["retained_from"], now["epoch"] + 1))
                    assert x not in still, (earlier.text, now)  # a 410 for an epoch still said to be retained
                elif x in retained:
                    assert earlier.status_code == 200, earlier.text
                    assert earlier.json()["epoch"] == x and earlier.json()["rows"] == [[N * 100, N, x, x]]
                else:
                    assert (earlier.status_code, earlier.json()["error"]["type"]) == (410, "EpochNotRetained")
        finally:
            stop.set()
            loader.join()


def test_sql_refuses_everything_but_one_select_alike(srv: BackgroundServer) -> None:
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as h:
        rows = h.post("/admin/sql", json={"sql": "SELECT key, value FROM account ORDER BY key"}).json()
        assert len(rows["rows"]) == 5 and rows["truncated"] is True  # sql_max_rows
        for sql, status, kind in REJECTED:
            r = h.post("/admin/sql", json={"sql": sql})
            assert (r.status_code, r.json()["error"]["type"]) == (status, kind), (sql, r.text)
        assert httpx.post(f"{srv.url}/admin/sql", json=GOOD).status_code == 401
        assert h.post("/admin/sql", json={**GOOD, "epoch": 1 << 40}).status_code == 410
        assert h.post("/admin/sql", json={"sql": ""}).status_code == 400
        assert h.post("/admin/sql", json={"sql": "SELECT 1", "extra": 1}).status_code == 400
        assert h.post("/admin/sql", json={"sql": "SELECT 1", "epoch": "x"}).status_code == 400


def test_a_query_past_its_time_is_cancelled_and_epochs_keep_running(srv: BackgroundServer) -> None:
    with Client(srv.url, token=TOKEN, timeout=120) as c, httpx.Client(base_url=srv.url, headers=AUTH,
                                                                      timeout=120) as h:
        slow = "SELECT count(*) FROM account a, account b, account c, account d, account f, account g"
        before = c.status()["epoch"]
        t0 = time.monotonic()
        r = h.post("/admin/sql", json={"sql": slow})
        assert (r.status_code, r.json()["error"]["type"]) == (422, "SQLTimeout"), r.text
        assert time.monotonic() - t0 < 60
        res = c.invoke_result("account", ycsb.key(1), "transfer", ycsb.key(2), 1)
        assert res.epoch > before, "epochs run after a cancelled query"
        assert h.post("/admin/sql", json=GOOD).json()["rows"][0][:2] == [N * 100, N]
