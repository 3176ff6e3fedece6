"""Ad-hoc SQL cannot hurt the Spark engine (issue 22, item 5), over real HTTP on ``charon run --engine spark``:
spark_sql_kills_jvm.sh's query (a task built a 10^9-character string and the JVM exited) and
spark_sql_stall.sh's two concurrent cross joins (epochs stalled ~25 s) run in the SQL sandbox, not the JVM:
typed 4xx answers, the same JVM alive, /health ok, a trickle of invokes keeps committing with a bounded p99,
and the money is conserved."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from deployproc import Deployment, Trickle, p99

pytestmark = pytest.mark.spark


def _big(expr: str) -> str:
    for _ in range(9):
        expr = f"replace({expr},'a','aaaaaaaaaa')"
    return expr


def test_hostile_sql_never_reaches_the_jvm(tmp_path: Path) -> None:
    d = Deployment("spark", tmp_path / "data", env={"CHARON_GATEWAY_SQL_TIMEOUT_S": "8"})
    try:
        d.wait_ok()
        n = 2000
        d.seed(["a1"] + [f"k{i}" for i in range(n)])
        java = d.java()
        assert len(java) == 1
        with Trickle(d.url) as trickle:
            time.sleep(3)
            t0 = time.monotonic()
            r = d.http.post("/admin/sql", json={"sql": f"SELECT length({_big('key')}) FROM account WHERE key = 'a1'"})
            assert (r.status_code, r.json()["error"]["type"]) == (422, "SQLTooExpensive"), r.text
            answers: list[httpx.Response] = []
            join = {"sql": "SELECT count(*) FROM account a, account b, account c, account d"}
            qs = [threading.Thread(target=lambda: answers.append(d.http.post("/admin/sql", json=join)))
                  for _ in range(2)]
            for t in qs:
                t.start()
            for t in qs:
                t.join()
            time.sleep(2)
            t1 = time.monotonic()
            assert [(a.status_code, a.json()["error"]["type"]) for a in answers] == [(422, "SQLTimeout")] * 2
            during = trickle.window(t0, t1)
            lat = sorted(x for _, x, _ in during)
            assert len(during) >= 8 and all(st == 200 for _, _, st in during), during
            assert p99(lat) < 3.0, lat[-5:]  # the old code: invokes waited ~10-25 s
        assert java[0].is_running() and d.java() == java, "the same JVM serves"
        assert httpx.get(d.url + "/health", timeout=5).status_code == 200
        r = d.http.post("/admin/sql", json={"sql": "SELECT sum(value), count(*) FROM account WHERE key <> 'w'"})
        assert r.status_code == 200 and r.json()["rows"] == [[n + 1, n + 1]], r.text
        w = d.http.get("/state/account/w").json()
        assert w["value"] == trickle.committed(), (w, trickle.committed())
    finally:
        d.stop()
