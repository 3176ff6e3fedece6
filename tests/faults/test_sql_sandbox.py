"""Ad-hoc SQL cannot hurt the engine (issue 22, item 5), in-process, over real HTTP on ``charon run``: the
repros' queries (sqlite_sql_memory.sh: one 10^9-character string; rows of 10^7 characters bounded only by rows;
concurrent cross joins) run in the SQL sandbox's child process: a typed 4xx, the engine's process never grows,
its epochs and /health keep answering, and no sandbox process is left behind."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from deployproc import Deployment, Trickle, p99


def _big(expr: str, times: int) -> str:
    for _ in range(times):
        expr = f"replace({expr},'a','aaaaaaaaaa')"
    return expr


def _sql(d: Deployment, query: str) -> httpx.Response:
    return d.http.post("/admin/sql", json={"sql": query})


def test_hostile_sql_is_contained_in_process(tmp_path: Path) -> None:
    d = Deployment("inprocess", tmp_path / "data", env={"CHARON_GATEWAY_SQL_TIMEOUT_S": "3",
                                                        "CHARON_GATEWAY_SQL_MAX_RESULT_BYTES": "100000"})
    try:
        d.wait_ok(60)
        n = 300
        d.seed([f"k{i}" for i in range(n)])
        rss0 = d.peak_rss()
        with Trickle(d.url) as trickle:
            time.sleep(1)
            # sqlite_sql_memory.sh: one 230-character query built a 10^9-character string in the engine's process
            r = _sql(d, f"SELECT length({_big(repr('a'), 9)})")
            assert (r.status_code, r.json()["error"]["type"]) == (422, "SQLTooExpensive"), r.text
            # rows of 10^7 characters: bounded in bytes, not only in rows
            r = _sql(d, f"SELECT {_big(repr('a'), 7)} FROM account LIMIT 40")
            assert (r.status_code, r.json()["error"]["type"]) == (413, "SQLResultTooLarge"), r.text
            r = _sql(d, f"SELECT key, substr({_big(repr('a'), 4)}, 1, 1000) FROM account")  # 300 kB > 100 kB
            assert (r.status_code, r.json()["error"]["type"]) == (413, "SQLResultTooLarge"), r.text
            # spark_sql_stall.sh's cross joins: stopped at sql_timeout_s, the epochs and /health go on meanwhile
            answers: list[httpx.Response] = []
            join = "SELECT count(*) FROM account a, account b, account c, account d"
            qs = [threading.Thread(target=lambda: answers.append(_sql(d, join))) for _ in range(2)]
            t0 = time.monotonic()
            for t in qs:
                t.start()
            health = []
            while any(t.is_alive() for t in qs):
                h0 = time.monotonic()
                st = httpx.get(d.url + "/health", timeout=5).status_code
                health.append((st, time.monotonic() - h0))
                time.sleep(0.2)
            t1 = time.monotonic()
            assert [(a.status_code, a.json()["error"]["type"]) for a in answers] == [(422, "SQLTimeout")] * 2
            assert health and all(st == 200 for st, _ in health), health
            assert max(s for _, s in health) < 1.0, health
            during = trickle.window(t0, t1)
            assert len(during) >= 10 and all(st == 200 for _, _, st in during), during
            assert p99([lat for _, lat, _ in during]) < 1.0, sorted(lat for _, lat, _ in during)[-5:]
        # the engine's process never held the hostile values (the old code's peak: +1.8 GB)
        assert d.peak_rss() - rss0 < 200 << 20, (rss0, d.peak_rss())
        # a good query still answers, over one cut: every account and w's increments
        r = _sql(d, "SELECT sum(value), count(*) FROM account WHERE key <> 'w'")
        assert r.status_code == 200 and r.json()["rows"] == [[n, n]], r.text
        w = _sql(d, "SELECT value FROM account WHERE key = 'w'").json()["rows"]
        assert w == [[trickle.committed()]], (w, trickle.committed())  # exactly once, nothing lost
        time.sleep(0.5)
        left = d.children("sqlchild")
        assert not left, left
    finally:
        d.stop()
