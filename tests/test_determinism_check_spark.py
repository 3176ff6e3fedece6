"""The determinism check on real PySpark (local[2]): the Python workers run every function step twice, a function
using random.random() aborts with NonDeterministicFunction naming it, deterministic ones commit as without it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from charon import serde
from charon.config import SparkConfig
from charon.messages import Request
from charon.runtime.spark.runtime import SparkRuntime
from charon.runtime.spark.session import make_session

pytestmark = pytest.mark.spark
sys.path.insert(0, str(Path(__file__).resolve().parent / "repros"))


def _req(rid: str, key: str, fn: str, *args: object) -> Request:
    return Request(rid, "acc", key, fn, serde.encode(list(args)))


def test_spark_workers_check_determinism(tmp_path: Path) -> None:
    spark = make_session(SparkConfig(master="local[2]", partitions=2))
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=1, idle_wait_ms=50,
                      determinism_check=True)
    try:
        rt = SparkRuntime("mistakes_app:app", cfg, spark=spark)
        rt.start()
        try:
            rt.input_log.append_many([_req("rnd-1", "k", "rnd"), _req("rec-1", "r", "recurse_other", 3),
                                      _req("set-1", "s", "setiter", ["a", "b", "c"])])
            rt.wait_idle(120)
            reps = {r: rt.get_reply(r) for r in ("rnd-1", "rec-1", "set-1")}
            snap = rt.snapshot()
        finally:
            rt.stop()
        assert reps["rnd-1"] is not None and reps["rnd-1"].error_type == "NonDeterministicFunction", reps
        assert "acc.rnd on key 'k'" in reps["rnd-1"].error_message, reps
        assert "state writes (the value of acc 'k')" in reps["rnd-1"].error_message, reps
        assert reps["rec-1"].ok and serde.decode(reps["rec-1"].value) == 3, reps
        assert reps["set-1"].ok, reps
        assert not any(k.startswith(b"acc\0k\0") for k in snap), snap  # nothing of rnd committed
    finally:
        spark.stop()
