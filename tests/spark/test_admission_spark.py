"""Admission on real PySpark (issue 34 item 3): the Spark driver's epochs take the same admission decisions as the
in-process runtime replaying the same log (same boundaries, same recorded times), and hold the limits."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from admission_app import app

from charon.config import SparkConfig
from charon.runtime.spark.runtime import SparkRuntime
from charon.testing import replay_in_process

pytestmark = pytest.mark.spark


def test_spark_admits_as_the_in_process_replay_of_its_log(spark, tmp_path: Path) -> None:
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path / "d"), partitions=2, truncate_log=False)
    rt = SparkRuntime("admission_app:app", cfg, spark=spark)
    initial = rt.snapshot()

    async def burst() -> list:
        return await asyncio.gather(*(rt.submit("lim", f"k{i % 2}", "take", [1, i % 3], request_id=f"r{i}")
                                      for i in range(40)))

    rt.start()
    try:
        replies = {r.request_id: r for r in asyncio.run(burst())}
        rt.wait_idle(300)
    finally:
        rt.stop()
    assert any(r.error_type == "RateLimited" for r in replies.values())
    assert any(r.ok for r in replies.values())
    _, results = replay_in_process(app, rt, initial)
    replayed = {rep.request_id: rep for res in results for rep in res.replies.values()}
    assert {rid: (r.ok, r.error_type, r.epoch, r.tid) for rid, r in replies.items()} == {
        rid: (replayed[rid].ok, replayed[rid].error_type, replayed[rid].epoch, replayed[rid].tid) for rid in replies}
    for res in results:  # at most 2 of a key commit in one epoch
        keys = [res.requests[t].key for t, rep in res.replies.items() if rep.ok]
        assert all(keys.count(k) <= 2 for k in set(keys))
