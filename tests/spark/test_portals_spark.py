"""A portal served by an application on real PySpark: the in-process ``orders`` and ``shipping`` ask the
``payments`` application running on a SparkRuntime; its state equals an in-process replay of its log."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from charon import Deployment, InProcessRuntime
from charon.apps.orderflow import check_conservation, orders_app, payments_app, shipping_app
from charon.config import SparkConfig
from charon.runtime.spark.runtime import SparkRuntime
from charon.testing import replay_in_process

pytestmark = pytest.mark.spark


def test_a_spark_application_serves_portals(spark, tmp_path: Path) -> None:
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path / "payments"), partitions=2, max_batch=250,
                      truncate_log=False)
    p = SparkRuntime("charon.apps.orderflow:payments_app", cfg, spark=spark)
    p.load("wallets", {f"c{c}": 100 for c in range(4)})
    initial = p.snapshot()
    o, s = InProcessRuntime(orders_app, partitions=2), InProcessRuntime(shipping_app, partitions=2)
    rng = random.Random(2)

    async def flow() -> None:
        async with o, s:
            for i in range(3):
                await s.invoke("stock", f"i{i}", "restock", 15)
            async with Deployment([o, p, s]) as dep:
                await asyncio.gather(*(
                    o.submit("orders", f"o{k}", "place", [f"c{rng.randrange(4)}", f"i{rng.randrange(3)}",
                                                          rng.randint(1, 3), rng.randint(1, 9)])
                    for k in range(60)))
                await dep.settle(timeout=300, quiet_s=0.5)
                assert dep.routers["orders"].requests >= 60

    p.start()
    try:
        asyncio.run(flow())
        p.wait_idle(300)
    finally:
        p.stop()
    ip, _ = replay_in_process(payments_app, p, initial)
    assert ip.snapshot() == p.snapshot()  # the Spark application's state is its log's in-process replay
    by = check_conservation(o, ip, s, 400, 45)
    assert sum(by.values()) == 60 and by.get("shipped", 0) > 0, by
