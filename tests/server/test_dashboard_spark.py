"""The dashboard's history routes on real PySpark (local[2]) behind the gateway: one sample a second with the
Spark epochs' durations, the backlog read from its input log, and aborts by type; the code history."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from charon.apps import ycsb
from charon.client import Client
from charon.config import SparkConfig
from charon.runtime.spark.runtime import SparkRuntime
from charon.server.serve import BackgroundServer

pytestmark = pytest.mark.spark
TOKEN = "sp4rk"
N = 50


def test_history_and_code_history_on_spark(spark, tmp_path) -> None:
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=1, max_batch=200,
                      idle_wait_ms=100, compact_every=1000)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg, spark=spark)
    rt.load("account", ycsb.initial_state(N, 2))  # transfers of 1..5 out of 2: many abort
    srv = BackgroundServer(rt, token=TOKEN, wait_timeout=0.5).start()
    try:
        with Client(srv.url, token=TOKEN) as c, \
                httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
            rng = random.Random(2)
            deadline = time.monotonic() + 60
            samples: list[dict] = []
            while time.monotonic() < deadline:
                c.submit("account", ycsb.key(rng.randrange(N)), "transfer", ycsb.key(rng.randrange(N)),
                         rng.randint(1, 5))
                time.sleep(0.01)
                samples = http.get("/admin/metrics/history").json()["samples"]
                if sum(s["epochs"] for s in samples) >= 3 and sum(s["aborted"] for s in samples) >= 3:
                    break
            assert sum(s["epochs"] for s in samples) >= 3, samples[-5:]
            assert any(s["epoch_ms"] is not None and s["epoch_ms"] > 0 for s in samples)
            assert any(s["aborts"].get("NotEnoughCredit") for s in samples)
            assert any(s["backlog"] is not None for s in samples)
            ts = [s["t"] for s in samples]
            assert ts == sorted(ts) and len(ts) == len(set(ts))
            code = http.get("/admin/code/history").json()
            assert code["app"] == "ycsb" and [v["from_epoch"] for v in code["versions"]] == [0]
            assert code["current"] == code["versions"][0]["version"]
    finally:
        srv.stop()
        rt.close()
