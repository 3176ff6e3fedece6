"""Paging an operator's state over the admin API on real PySpark (local[2]): pages in key order with a ``next``
cursor read from the durable copy on the driver, each entity once, the following pages at the first page's epoch
(that cut, not a later write), a prefix search, an epoch not recorded is 410 EpochNotRetained."""

from __future__ import annotations

import pytest

from charon.apps import ycsb
from charon.client import Client
from charon.config import SparkConfig
from charon.errors import CharonError, EpochNotRetained
from charon.runtime.spark.runtime import SparkRuntime
from charon.server.serve import BackgroundServer

pytestmark = pytest.mark.spark
TOKEN = "sp4ges"
N = 60
BALANCE = 10
ALL = sorted(ycsb.key(i) for i in range(N))


def test_state_pages_on_spark(spark, tmp_path) -> None:
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=1, max_batch=200,
                      idle_wait_ms=100, compact_every=1000)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg, spark=spark)
    rt.load("account", ycsb.initial_state(N, BALANCE))
    try:
        with BackgroundServer(rt, token=TOKEN, wait_timeout=30) as srv, Client(srv.url, token=TOKEN) as c:
            c.invoke("account", "a0", "deposit", 1)
            pages = list(c.iter_state("account", limit=7))
            assert [k for p in pages for k in p["entities"]] == ALL
            assert [p["count"] for p in pages] == [7] * 8 + [4] and pages[-1]["next"] is None
            at = pages[0]["epoch"]
            assert {p["epoch"] for p in pages} == {at}
            assert sum(v for p in pages for v in p["entities"].values()) == N * BALANCE + 1
            # a write after the first page: the following pages of that cut do not show it, the latest does
            later = ALL[30]
            c.invoke("account", later, "deposit", 5)
            again = c.read_state("account", after=pages[3]["next"], epoch=at, limit=7)
            assert again["epoch"] == at and again["entities"] == pages[4]["entities"]
            assert again["entities"][later] == BALANCE
            assert c.read_state("account", [later])["entities"][later] == BALANCE + 5
            a1 = [k for k in ALL if k.startswith("a1")]
            found = c.read_state("account", prefix="a1", limit=100)
            assert list(found["entities"]) == a1 and found["next"] is None
            with pytest.raises(CharonError) as err:
                c.read_state("account", after="a1", epoch=at + 10_000, limit=7)
            assert type(err.value) is EpochNotRetained  # the class the engine raises (410 over HTTP)
    finally:
        rt.close()
