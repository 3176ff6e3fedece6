"""Availability of the Spark runtime on real PySpark (local[2]): state reads never roll state back (issue 9
item 2, repros r7_*), an epoch that cannot be finalized after its replies went out stops the runtime loudly
(item 1), the query is supervised and its health reported (item 5), the layout lives in the checkpoint
(item 6), and per-epoch statistics are bounded."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from charon import serde
from charon.cli.exitcodes import ExitCode
from charon.config import SparkConfig
from charon.core.routing import store_key
from charon.errors import EngineUnavailable
from charon.messages import Request
from charon.runtime.spark.layout import LayoutMismatch
from charon.runtime.spark.runtime import TICK, SparkRuntime
from charon.runtime.spark.session import master_with_retries
from charon.server.serve import free_port

APP = "charon.apps.ycsb:app"
CHARON = str(Path(sys.executable).parent / "charon")


def _cfg(data_dir: Path, **kw: object) -> SparkConfig:
    base: dict = dict(master="local[2]", data_dir=str(data_dir), partitions=2, compact_every=0, truncate_log=False,
                      restart_backoff_s=0.2, epoch_max_failures=2)
    base.update(kw)
    return SparkConfig(**base)


def _wait_reply(rt: SparkRuntime, rid: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rep = rt.get_reply(rid)
        if rep is not None:
            return rep
        time.sleep(0.05)
    raise TimeoutError(f"no reply for {rid}: {rt.health()}")


def test_master_gets_task_retries() -> None:
    assert master_with_retries("local[*]", 4) == "local[*,4]"
    assert master_with_retries("local", 3) == "local[1,3]"
    assert master_with_retries("local[2]", 4) == "local[2,4]"
    assert master_with_retries("local[2,1]", 4) == "local[2,4]"
    assert master_with_retries("spark://h:7077", 4) == "spark://h:7077"


def test_layout_mismatch_is_refused_in_one_line(tmp_path: Path) -> None:
    SparkRuntime(APP, _cfg(tmp_path, partitions=4))  # first start records the layout
    SparkRuntime(APP, _cfg(tmp_path, partitions=4))  # the same layout: fine
    grown = SparkRuntime(APP, _cfg(tmp_path, partitions=4, log_partitions=6))  # another log count: resized
    assert grown.input_log.counts() == (6, 6)
    assert SparkRuntime(APP, _cfg(tmp_path, partitions=2, log_partitions=4)).config.partitions == 2  # rescaled
    assert grown.input_log.counts() == (6, 4), "the log routes over 4, its 6 partitions stay (and are read)"
    legacy = tmp_path / "legacy"  # a checkpoint from before layout.json: its state shows 4 partitions
    SparkRuntime(APP, _cfg(legacy, partitions=4))
    for p in range(4):
        (legacy / "checkpoint" / "state" / f"p{p}").mkdir(parents=True)
    (legacy / "checkpoint" / "layout.json").unlink()
    with pytest.raises(LayoutMismatch, match="state of 4 partitions, configured: 2"):
        SparkRuntime(APP, _cfg(legacy, partitions=2, log_partitions=4))
    assert not (legacy / "checkpoint" / "layout.json").exists()  # nothing recorded from a refused start
    env = dict(os.environ, CHARON_MASTER="local[2]", CHARON_LOG_PARTITIONS="3")
    out = subprocess.run([CHARON, "run", APP, "--engine", "spark", "--data-dir", str(legacy), "--partitions", "2",
                          "--port", str(free_port())], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == ExitCode.UNAVAILABLE  # the engine cannot be opened (docs/reference/exit-codes.md)
    assert "Traceback" not in out.stderr and "state of 4 partitions" in out.stderr
    assert [ln for ln in out.stderr.splitlines() if ln.strip()] == [out.stderr.strip()]  # one line


@pytest.mark.spark
def test_reads_during_empty_epochs_never_roll_back_and_survive_restart(spark, tmp_path: Path) -> None:
    """r7_spark_startup/live/restart: reads race empty (tick-only) epochs from start-up on; before the fix a read
    truncated a finalized, not yet recorded epoch and the query died with StoreError, also after a restart."""
    cfg = _cfg(tmp_path, keep_epoch_stats=1)
    rt = SparkRuntime(APP, cfg, spark=spark)
    rt.load("account", {"a": 1, "b": 2})
    rt.start()
    stop = threading.Event()

    def ticker() -> None:
        i = 0
        while not stop.is_set():
            rt.input_log.append(Request(f"{TICK}t{i}", TICK, "", "", serde.encode([])))
            i += 1
            time.sleep(0.05)

    t = threading.Thread(target=ticker, daemon=True)
    t.start()
    reads = 0
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 or (rt.last_recorded_epoch() < 5 and time.monotonic() - t0 < 120):
            epoch, got = rt.read_keys_at([store_key("account", "a"), store_key("account", "b")])
            assert {k: serde.decode(v) for k, v in got.items()} == {store_key("account", "a"): 1,
                                                                     store_key("account", "b"): 2}
            assert epoch <= rt.last_recorded_epoch()
            reads += 1
            h = rt.health()
            # (ok once the gang is up: "starting" while it launches)
            assert (h["ok"] or h["status"] == "starting") and h["restarts"] == 0 and h["last_error"] is None, h
        rt.input_log.append(Request("dep-1", "account", "a", "deposit", serde.encode([5])))
        assert _wait_reply(rt, "dep-1").ok
        assert rt.read_state("account", "a") == 6
    finally:
        stop.set()
        t.join()
        rt.stop()
    assert reads > 5 and rt.last_epoch >= 5
    assert 1 <= len(rt.epoch_stats) <= 2 and rt.epoch_stats[-1]["epoch"] == rt.last_epoch  # bounded
    assert rt.health()["status"] == "stopped" and not rt.health()["ok"]

    rt2 = SparkRuntime(APP, cfg, spark=spark)  # restart on the same data directory
    rt2.start()
    try:
        rt2.input_log.append(Request("dep-2", "account", "a", "deposit", serde.encode([5])))
        assert _wait_reply(rt2, "dep-2").ok
        assert rt2.read_state("account", "a") == 11 and rt2.health()["ok"]
    finally:
        rt2.stop()


@pytest.mark.spark
def test_epoch_that_cannot_be_finalized_stops_the_runtime_loudly(spark, tmp_path: Path) -> None:
    """The durable delta file of the next epoch cannot be written (a directory is in its place: a disk that
    refuses, deterministically). The reply already went out; the runtime must not serve state that
    contradicts it: it gives up (health red, reads 503-class), and a restart replays the epoch in full."""
    cfg = _cfg(tmp_path)
    rt = SparkRuntime(APP, cfg, spark=spark)
    rt.load("account", {"a": 1})
    rt.start()
    blocked: list[Path] = []
    try:
        rt.input_log.append(Request("dep-0", "account", "a", "deposit", serde.encode([1])))
        assert _wait_reply(rt, "dep-0").ok
        rt.wait_idle(60)
        nxt = rt.last_recorded_epoch() + 1
        for p in range(cfg.partitions):
            d = Path(cfg.checkpoint_dir) / "state" / f"p{p}" / f"delta-{nxt:012d}.arrow"
            d.mkdir(parents=True)
            blocked.append(d)
        rt.input_log.append(Request("dep-1", "account", "a", "deposit", serde.encode([10])))
        assert _wait_reply(rt, "dep-1").ok  # the early reply went out
        deadline = time.monotonic() + 120
        while rt.health()["status"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.1)
        h = rt.health()
        assert h["status"] == "failed" and not h["ok"] and h["fatal"] and f"epoch {nxt}" in h["fatal"], h
        assert h["unconfirmed_epoch"] == nxt and "IsADirectoryError" in h["fatal"], h  # named, one line
        with pytest.raises(EngineUnavailable):
            rt.read_state("account", "a")  # 2 would contradict the reply to dep-1
        with pytest.raises(EngineUnavailable):  # nothing would run a new request
            asyncio.run(rt.submit("account", "a", "deposit", [1], request_id="dep-2"))
    finally:
        rt.stop()
    for d in blocked:
        d.rmdir()  # the disk is repaired
    rt2 = SparkRuntime(APP, cfg, spark=spark)
    rt2.start()
    try:
        rt2.wait_idle(120)
        assert rt2.read_state("account", "a") == 12 and rt2.health()["ok"]
    finally:
        rt2.stop()


def _task_workers_of_this_process() -> list[int]:
    """Forked `pyspark.daemon pyspark.worker` processes under this process's JVM."""
    procs: dict[int, tuple[int, str]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            procs[int(d)] = (ppid, cmd)
    daemons = {p for p, (pp, cmd) in procs.items()
               if cmd.endswith("pyspark.daemon pyspark.worker") and procs.get(pp, (0, ""))[0] == os.getpid()}
    return [p for p, (pp, _) in procs.items() if pp in daemons]


@pytest.mark.spark
@pytest.mark.parametrize("exchange", ["jobs", "resident"])
def test_killed_python_workers_are_retried_by_spark(spark, tmp_path: Path, exchange: str) -> None:
    """With Spark's task retries on (the default), SIGKILLed task workers cost a task attempt, not the query:
    no restart, every request answered once. The resident gang cannot be retried in place: each kill costs a
    restart on a new gang, which does not count as a failure of the epoch (the runtime's own task retries), so the
    runtime never gives up either, and every request is answered once."""
    import signal

    rt = SparkRuntime(APP, _cfg(tmp_path, exchange=exchange), spark=spark)
    rt.load("account", {})
    rt.start()
    try:
        killed = 0
        for i in range(200):
            rt.input_log.append(Request(f"d{i}", "account", f"k{i % 4}", "deposit", serde.encode([1])))
            # a kill every ~0.8 s: each one costs the running tasks an attempt; Spark gives a task 4, so the
            # query only fails if one task is hit four times (then the supervisor restarts it: a restart)
            if i % 40 == 10:
                for pid in _task_workers_of_this_process():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        killed += 1
            time.sleep(0.02)
        rt.wait_idle(240)
        assert killed > 0
        assert all(rt.get_reply(f"d{i}").ok for i in range(200))
        assert [rt.read_state("account", f"k{j}") for j in range(4)] == [50] * 4
        h = rt.health()
        if exchange == "jobs":
            assert h["ok"] and h["restarts"] == 0, h
        else:  # a restart per gang lost (at most one per kill), never a failure counted towards giving up
            assert h["ok"] and h["fatal"] is None and 1 <= h["restarts"] <= killed, h
    finally:
        rt.stop()
