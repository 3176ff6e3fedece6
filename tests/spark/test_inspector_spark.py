"""The invocation inspector on real PySpark (local[2]) behind the gateway: a transfer's call graph and a callee's
traceback come back from the Spark tasks to the driver beside the replies, and the requests are searchable."""

from __future__ import annotations

import httpx
import pytest

from charon.config import SparkConfig
from charon.runtime.spark.runtime import SparkRuntime
from charon.server.serve import BackgroundServer

pytestmark = pytest.mark.spark
TOKEN = "insp"
H = {"Authorization": f"Bearer {TOKEN}"}


def test_call_graph_and_traceback_on_spark(spark, tmp_path) -> None:
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=1, idle_wait_ms=100)
    rt = SparkRuntime("inspector_app:app", cfg, spark=spark)
    rt.load("account", {"a": 100, "b": 0})
    with BackgroundServer(rt, token=TOKEN) as srv, httpx.Client(base_url=srv.url, headers=H, timeout=180) as c:
        def invoke(rid: str, path: str, *args: object) -> httpx.Response:
            return c.post(f"/invoke/{path}", json={"args": list(args)}, headers={"Idempotency-Key": rid})

        assert invoke("s-ok", "bank/t1/transfer", "a", "b", 30).json()["value"] == [70, 30]
        assert invoke("s-over", "bank/t2/transfer", "b", "a", 1000).json()["error"]["type"] == "Overdrawn"
        assert invoke("s-boom", "bank/t3/fail", "boom").json()["error"]["type"] == "ValueError"
        ok = c.get("/admin/requests/s-ok").json()
        assert ok["status"] == "committed" and ok["reply"] == [70, 30] and ok["epoch"] is not None
        assert [(n["parent"], n["kind"], n["key"], n["function"], n["outcome"]) for n in ok["call_graph"]] == [
            (None, "root", "t1", "transfer", "ok"), (0, "call", "a", "withdraw", "ok"),
            (0, "call", "b", "deposit", "ok"), (0, "send", "b", "notify", "ok")]
        over = c.get("/admin/requests/s-over").json()
        assert over["error"]["type"] == "Overdrawn" and "WITHDRAW-RAISES" in over["error"]["traceback"]
        assert "inspector_app.py" in over["error"]["traceback"]
        assert [(n["function"], n["outcome"]) for n in over["call_graph"]] == [("transfer", None),
                                                                                ("withdraw", "raised")]
        page = c.get("/admin/requests", params={"status": "aborted"}).json()
        assert [i["request_id"] for i in page["items"]] == ["s-boom", "s-over"]
        assert "ROOT-RAISES" in c.get("/admin/requests/s-boom").json()["error"]["traceback"]
