"""Runaway and slow functions on real PySpark (local[2]): a task stops a function past its budget (an endless loop,
a C-level sleep: the task's SIGALRM sampler interrupts both), its transaction aborts with InvocationTimeout, the
driver records the verdict before anything depends on it, the other transactions commit, and a restarted runtime
never runs it again."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from charon import serde
from charon.config import SparkConfig
from charon.messages import Request
from charon.runtime.spark.runtime import SparkRuntime
from charon.server.serve import BackgroundServer

pytestmark = pytest.mark.spark
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))


def _req(rid: str, key: str, fn: str, *args: object) -> Request:
    return Request(rid, "acc", key, fn, serde.encode(list(args)))


def test_spark_tasks_stop_functions_past_their_budget(spark, tmp_path: Path) -> None:
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=1, idle_wait_ms=50,
                      function_timeout=1.0)
    rt = SparkRuntime("hostile_app:app", cfg, spark=spark)
    rt.load("acc", {"a": 100})
    srv = BackgroundServer(rt, token="t").start(120)  # starts the runtime
    try:
        t0 = time.monotonic()
        rt.input_log.append_many([_req("spin-1", "k", "spin"), _req("sleep-1", "s", "sleepy", 60.0),
                                  _req("cs-1", "x", "spin_callee", "y")]
                                 + [_req(f"t{i}", "a", "transfer", "b", 1) for i in range(5)])
        times = []  # /health and /metrics while the functions run in the executors
        with httpx.Client(base_url=srv.url, headers={"Authorization": "Bearer t"}) as probe:
            while rt.get_reply("t4") is None and time.monotonic() - t0 < 120:
                for path in ("/health", "/metrics"):
                    q0 = time.perf_counter()
                    assert probe.get(path, timeout=5).status_code in (200, 503)
                    times.append(time.perf_counter() - q0)
                time.sleep(0.05)
        rt.wait_idle(120)
        took = time.monotonic() - t0
        times.sort()
        assert len(times) > 4 and times[len(times) // 2] < 0.1 and times[-1] < 1.5, times  # (loaded CI)
        reps = {r: rt.get_reply(r) for r in ["spin-1", "sleep-1", "cs-1", *(f"t{i}" for i in range(5))]}
        assert all(v is not None for v in reps.values()), reps
        assert reps["spin-1"].error_type == "InvocationTimeout"
        assert reps["sleep-1"].error_type == "InvocationTimeout"  # sleepy's own budget: 0.5 s
        assert reps["cs-1"].error_type == "InvocationTimeout" and "[raised by acc.spin on key 'y'" in (
            reps["cs-1"].error_message)
        assert all(reps[f"t{i}"].ok for i in range(5))
        assert took < 60, took  # the 60 s sleep was interrupted
        assert {d["request_id"] for d in rt.dead_letters()} == {"spin-1", "sleep-1", "cs-1"}
        snap = rt.snapshot()
    finally:
        srv.stop()
    state = {k: serde.decode(v) for k, v in snap.items()}
    assert sum(v for v in state.values() if isinstance(v, int) and v > 0) == 100  # money conserved
    # a restarted runtime keeps the verdicts: the same request ids are answered, never run again
    again = SparkRuntime("hostile_app:app", cfg, spark=spark)
    assert {d["request_id"] for d in again.dead_letters()} == {"spin-1", "sleep-1", "cs-1"}
    assert set(again.verdict_book.verdicts) == {"spin-1", "sleep-1", "cs-1"}


def test_a_transaction_that_kills_its_python_worker_is_quarantined(spark, tmp_path: Path) -> None:
    """`die` kills the Python worker running it on every attempt: the epoch fails, its next run is probed, the
    transaction found is recorded as Quarantined, and the epoch then commits without it (no give-up, no person)."""
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=1, idle_wait_ms=50,
                      restart_backoff_s=0.2)
    rt = SparkRuntime("hostile_app:app", cfg, spark=spark)
    rt.load("acc", {"a": 100})
    rt.start()
    try:
        t0 = time.monotonic()
        rt.input_log.append_many([_req("die-1", "x", "die")] + [_req(f"t{i}", "a", "transfer", "b", 1)
                                                               for i in range(5)])
        rt.wait_idle(300)
        healed = time.monotonic() - t0
        die = rt.get_reply("die-1")
        assert die is not None and die.error_type == "Quarantined", die
        assert all(rt.get_reply(f"t{i}").ok for i in range(5))
        assert rt.health()["ok"], rt.health()
        assert [d["request_id"] for d in rt.dead_letters()] == ["die-1"]
        print(f"worker-killing transaction quarantined, epoch committed after {healed:.1f} s")
        state = {k: serde.decode(v) for k, v in rt.snapshot().items()}
    finally:
        rt.stop()
    assert sum(v for v in state.values() if isinstance(v, int) and v > 0) == 100
