"""The dashboard's SQL box on real PySpark (``POST /admin/sql``), answered in the SQL sandbox (never the JVM).
Under load, ``SELECT sum(value) FROM account`` equals the conserved total at the latest and an earlier epoch;
reflection, files, catalogs, commands, DDL/DML and table functions are typed 4xx before anything runs; rows
and time are bounded (a cancelled query leaves the running epochs alone)."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from charon.apps import ycsb
from charon.client import Client
from charon.config import GatewayConfig, SparkConfig
from charon.runtime.contract import SQLTimeout
from charon.runtime.spark.runtime import SparkRuntime
from charon.runtime.spark.session import make_session
from charon.server.serve import BackgroundServer

pytestmark = pytest.mark.spark
TOKEN = "sq1"
N = 40
AUTH = {"Authorization": f"Bearer {TOKEN}"}

#: Spark SQL's dangerous forms, now answered by the SQL sandbox's SQLite (the dialect changed: a Spark-only form
#: that SQLite does not parse is 400 SQLSyntaxError instead of 422; CTEs and hint comments are harmless there)
REJECTED = [
    ("SELECT reflect('java.lang.Runtime', 'getRuntime')", 422, 'SQLRejected'),
    ("SELECT java_method('java.lang.System', 'exit', 0)", 422, 'SQLRejected'),
    ("SELECT `reflect`('java.lang.Runtime', 'getRuntime')", 422, 'SQLRejected'),
    ("SELECT IDENTIFIER('reflect')('a', 'b')", 400, 'SQLSyntaxError'),
    ("SELECT transform(array(1), x -> reflect('a', 'b'))", 422, 'SQLRejected'),
    ('SELECT * FROM parquet.`/etc`', 400, 'SQLSyntaxError'),
    ('SELECT * FROM json.`file:///etc/hostname`', 400, 'SQLSyntaxError'),
    ("SELECT * FROM read_files('/etc')", 400, 'SQLSyntaxError'),
    ('SELECT * FROM range(10)', 400, 'SQLSyntaxError'),
    ('SELECT input_file_name() FROM account', 422, 'SQLRejected'),
    ('SELECT * FROM default.account', 400, 'SQLSyntaxError'),
    ('SELECT * FROM spark_catalog.default.t', 400, 'SQLSyntaxError'),
    ('SELECT * FROM other_table', 400, 'SQLSyntaxError'),
    ('SHOW TABLES', 400, 'SQLSyntaxError'),
    ('SET spark.sql.ansi.enabled=false', 400, 'SQLSyntaxError'),
    ('DROP TABLE account', 422, 'SQLRejected'),
    ('CREATE TABLE t (a INT)', 422, 'SQLRejected'),
    ("INSERT INTO account VALUES ('k', '', 1, '1', 0)", 422, 'SQLRejected'),
    ('CACHE TABLE account', 400, 'SQLSyntaxError'),
    ('ADD JAR /tmp/x.jar', 400, 'SQLSyntaxError'),
    ('EXPLAIN SELECT 1', 422, 'SQLRejected'),
    ('SELECT current_user()', 422, 'SQLRejected'),
    ('SELECT 1; SELECT 2', 400, 'SQLSyntaxError'),
    ('SELEC 1', 400, 'SQLSyntaxError'),
    ('SELECT no_such_column FROM account', 400, 'SQLSyntaxError'),
]


def test_sql_box_on_spark(tmp_path) -> None:
    spark = make_session(SparkConfig(master="local[2]", partitions=2))
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, idle_wait_ms=50)
    stop = threading.Event()
    try:
        rt = SparkRuntime("charon.apps.ycsb:app", cfg, spark=spark)
        rt.load("account", ycsb.initial_state(N, 100))
        gcfg = GatewayConfig(sql_max_rows=5)
        srv = BackgroundServer(rt, token=TOKEN, config=gcfg).start(timeout=120)
        try:
            with Client(srv.url, token=TOKEN, timeout=120) as c, \
                    httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as h:
                def drive() -> None:
                    rng = random.Random(1)
                    while not stop.is_set():
                        c.submit("account", ycsb.key(rng.randrange(N)), "transfer", ycsb.key(rng.randrange(N)), 1)
                        time.sleep(0.01)

                loader = threading.Thread(target=drive, daemon=True)
                loader.start()
                time.sleep(2)
                good = {"sql": "SELECT sum(value) AS total, count(*) AS n, min(epoch), max(epoch) FROM account"}
                r = h.post("/admin/sql", json=good)
                assert r.status_code == 200, r.text
                doc = r.json()
                e = doc["epoch"]
                assert doc["engine"] == "sqlite" and doc["columns"][:2] == ["total", "n"]  # the SQL sandbox
                assert doc["rows"] == [[N * 100, N, e, e]], doc
                time.sleep(1)
                later = h.post("/admin/sql", json=good).json()
                assert later["rows"][0][:2] == [N * 100, N] and later["epoch"] > e, "epochs ran meanwhile"
                earlier = h.post("/admin/sql", json={**good, "epoch": e}).json()  # an earlier retained epoch
                assert earlier["epoch"] == e and earlier["rows"] == [[N * 100, N, e, e]]
                stop.set()
                loader.join()
                rows = h.post("/admin/sql", json={"sql": "SELECT key, value FROM account ORDER BY key"}).json()
                assert len(rows["rows"]) == 5 and rows["truncated"] is True
                for sql, status, kind in REJECTED:
                    r = h.post("/admin/sql", json={"sql": sql})
                    assert (r.status_code, r.json()["error"]["type"]) == (status, kind), (sql, r.text)
                assert httpx.post(f"{srv.url}/admin/sql", json=good).status_code == 401
                assert h.post("/admin/sql", json={**good, "epoch": 1 << 40}).status_code == 410
                # the time bound: a huge cross join is cancelled; the epochs keep running
                slow = "SELECT count(*) FROM account a, account b, account c, account d, account f, account g"
                before = c.status()["epoch"]
                t0 = time.monotonic()
                with pytest.raises(SQLTimeout):
                    rt.sql(slow, timeout_s=2.0)
                assert time.monotonic() - t0 < 60
                res = c.invoke_result("account", ycsb.key(1), "transfer", ycsb.key(2), 1)
                assert res.epoch > before, "epochs run after a cancelled query"
                assert h.post("/admin/sql", json=good).json()["rows"][0][:2] == [N * 100, N]
        finally:
            stop.set()
            srv.stop(timeout=120)
    finally:
        spark.stop()
