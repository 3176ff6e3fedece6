"""Crash recovery of the Spark runtime: a driver SIGKILLed again and again still computes exactly the
in-process runtime's result, with one reply per request.

The driver (``tests/support/spark_driver.py``, ``local[2]``) runs as a subprocess in its own session. It is killed
at named crash points (``CHARON_CRASH_AT``: before an epoch, after its first round, between the state commit
and the epoch record, in the middle of a compaction; between the record and Spark's commit log in the deferred
transactions test) and restarted each time, while the test keeps appending YCSB-T transfers to the input log.
Compaction runs every 3 epochs and the log is never truncated, so the whole history can be replayed through the
in-process runtime at the end.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import msgspec
import pytest
from spark_driver import Driver, check_result, driver_args, last_epoch, make_config, transfers

from charon.log.sqlite import InputLog
from charon.runtime.faults import crash_point
from charon.runtime.spark.runtime import SparkRuntime
from charon.state.records import EpochRecord

pytestmark = [pytest.mark.spark, pytest.mark.timeout(1500)]

APP = "charon.apps.ycsb:app"
ACCOUNTS = 1000
BALANCE = 100
MAX_BATCH = 100
COMPACT_EVERY = 3
BACKLOG = 5 * MAX_BATCH  # unconsumed requests before each start: enough to reach the crash point's epoch
MID_RUN = 100  # appended while the driver runs
FINAL = 300
# where each run dies: a named crash point at a coming epoch, or "random" (SIGKILL at a wall-clock moment)
# (the seeded simulator covers every point and their combinations at scale). Each start costs a JVM and a
# SparkSession, so two kills live in other tests: after_record in
# test_crash_after_recording_an_epoch_with_deferred_transactions below (killed at after_record:0, the records
# stop at 0, the restart's result equals the in-process runtime's), a SIGKILL at a wall-clock moment under load
# in test_spark_supervision.py::test_driver_sigkill_under_load_then_restart (every reply unchanged, money
# conserved) and test_spark_streams.py's consumer SIGKILL.
PLAN = ["before_epoch", "after_round", "after_finalize", "compaction"]
START_TIMEOUT = 300.0  # JVM + SparkSession start on a loaded 2-core machine
RUN_TIMEOUT = 400.0


def crash_epoch(point: str, last: int) -> int:
    """A coming epoch for ``point`` (the compaction point fires only at epochs that start a compaction)."""
    e = last + 2
    if point == "compaction":
        e = max(e, COMPACT_EVERY)
        e += -e % COMPACT_EVERY
    return e


def consumed(data_dir: str) -> int:
    last = last_epoch(data_dir)
    if last < 0:
        return 0
    path = os.path.join(make_config(data_dir).checkpoint_dir, "epochs", f"{last:012d}.msgpack")
    with open(path, "rb") as f:
        rec = msgspec.msgpack.decode(f.read(), type=EpochRecord)
    return sum(rec.ends)  # includes ticks, a few at most: the backlog is a lower bound


def test_crash_point_is_inert_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHARON_CRASH_AT", raising=False)
    crash_point("after_finalize", 3)  # returns: this process is still alive
    monkeypatch.setenv("CHARON_CRASH_AT", "after_finalize:4")
    crash_point("after_finalize", 3)
    crash_point("before_epoch", 4)
    # ... and fires (SIGKILL) on an exact match, in a child process
    code = "from charon.runtime.faults import crash_point; crash_point('after_finalize', 4); print('alive')"
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                           env=dict(os.environ, CHARON_CRASH_AT="after_finalize:4"))
    assert child.returncode == -signal.SIGKILL and b"alive" not in child.stdout


def test_driver_killed_repeatedly_matches_in_process(tmp_path: Path) -> None:
    t_start = time.monotonic()
    data = str(tmp_path / "data")
    local = str(tmp_path / "local")  # executor-local LMDB stores, kept across restarts
    env = {"CHARON_LOCAL_DIR": local}
    # each restart ramps its first batches (25, then MAX_BATCH): sized epochs are replayed exactly too
    args = driver_args(max_batch=MAX_BATCH, compact_every=COMPACT_EVERY, restart_batch=MAX_BATCH // 4)
    rng = random.Random(2024)
    workload = transfers(ACCOUNTS, 8000, seed=7)
    appended: list = []
    drivers: list[Driver] = []
    log: InputLog | None = None

    def append(n: int) -> None:
        assert log is not None
        batch = workload[len(appended):len(appended) + n]
        assert len(batch) == n, "the workload ran out"
        log.append_many(batch)
        appended.extend(batch)

    def top_up() -> None:
        missing = BACKLOG - (len(appended) - consumed(data))
        if missing > 0:
            append(missing)

    outcomes: list[tuple[str, int, int]] = []  # (how it died, epoch at start, epoch at death)
    try:
        for i, point in enumerate(PLAN):
            last = last_epoch(data)
            target = crash_epoch(point, last)
            crash_at = None if point == "random" else f"{point}:{target}"
            extra = ["--load", str(ACCOUNTS), "--run", "--balance", str(BALANCE)] if i == 0 else []
            d = Driver(data, [*extra, *args], str(tmp_path / f"driver-{i:02d}.log"), crash_at=crash_at, env=env)
            drivers.append(d)
            if i == 0:
                # the bulk load happens once, before the first start; its snapshot is the replay's initial state
                d.wait_until(lambda d=d: "loaded" in d.output(), START_TIMEOUT, "the bulk load")
                initial = SparkRuntime(APP, make_config(data)).snapshot()
                assert len(initial) == ACCOUNTS
                log = InputLog(os.path.join(data, "input.sqlite"), 4)
                append(BACKLOG)
                Path(data, "go").touch()
            else:
                top_up()
            # (a crash point may fire before the driver says so: then the appends below are for the next run)
            d.wait_until(lambda d=d: "started" in d.output() or d.proc.poll() is not None, START_TIMEOUT,
                         "the query start")
            append(MID_RUN)
            if point == "random":
                d.wait_until(lambda last=last: last_epoch(data) > last, RUN_TIMEOUT, "a new epoch")
                time.sleep(rng.uniform(0.0, 2.0))
                d.kill()
            else:
                rc = d.wait(RUN_TIMEOUT)
                d.kill()  # stragglers: the JVM and Python workers outlive the driver for a moment
                assert rc == -signal.SIGKILL, f"the driver did not die at {crash_at} (exit {rc})\n{d.tail()}"
            outcomes.append((crash_at or "random", last, last_epoch(data)))

        # the last run: everything appended, then run until idle and exit cleanly
        append(FINAL)
        Path(data, "done").touch()
        d = Driver(data, args, str(tmp_path / "driver-final.log"), env=env)
        drivers.append(d)
        rc = d.wait(RUN_TIMEOUT + START_TIMEOUT)
        assert rc == 0, f"the last run failed (exit {rc})\n{d.tail()}"
        assert "idle" in d.output()
        d.kill()
    finally:
        for d in drivers:
            d.kill()
        if log is not None:
            log.close()

    print(f"\nkills: {outcomes}\nappended {len(appended)}, epochs {last_epoch(data) + 1}, "
          f"{time.monotonic() - t_start:.0f} s")
    assert len(outcomes) == len(PLAN) >= 4
    # every named crash fired at its epoch (the run before it reached it: records stop right below it)
    for how, _, died_at in outcomes:
        if how != "random":
            point, _, e = how.partition(":")
            if point == "compaction":  # the next epoch may finish while the compaction runs
                assert died_at in (int(e), int(e) + 1), (how, died_at)
            elif point in ("before_epoch", "after_round"):
                # under load epoch e-1's finalize rides in epoch e's first round (pipeline_finalize), and its
                # record is written after that round: then the records stop two below
                assert died_at in (int(e) - 1, int(e) - 2), (how, died_at)
            else:
                assert died_at == (int(e) if point == "after_record" else int(e) - 1), (how, died_at)
    assert last_epoch(data) + 1 >= 12

    rt = check_result(data, initial, appended, ACCOUNTS * BALANCE)
    # compaction ran (and survived being killed): every partition's durable base is past the bulk load
    for pid in range(4):
        assert rt.durable.manifest(pid).base_epoch >= COMPACT_EVERY - 1, rt.durable.manifest(pid)
    # the stores were resident: executor-local LMDB environments per partition under CHARON_LOCAL_DIR
    stores = {p.parent.name for p in Path(local).glob("charon-*/p*/data.mdb")}
    assert stores == {"p0", "p1", "p2", "p3"}


def test_crash_after_recording_an_epoch_with_deferred_transactions(tmp_path: Path) -> None:
    """A deferred transaction runs in the next epoch, which a tick in the input log triggers. Killed between
    the epoch record and that tick, the driver must append the tick when Spark replays the recorded batch,
    or the deferred transactions never run (and the runtime never becomes idle)."""
    data = str(tmp_path / "data")
    env = {"CHARON_LOCAL_DIR": str(tmp_path / "local")}
    balance = 20  # low balances: transfers refused in the dry run succeed in the fallback and touch a new key
    args = driver_args(max_batch=10_000, compact_every=0, restart_batch=10_000)
    workload = transfers(ACCOUNTS, 1000, seed=1)  # appended before the start: epoch 0 is all of it, then no data
    drivers: list[Driver] = []
    try:
        d = Driver(data, ["--load", str(ACCOUNTS), "--run", "--balance", str(balance), *args],
                   str(tmp_path / "driver-0.log"), crash_at="after_record:0", env=env)
        drivers.append(d)
        d.wait_until(lambda: "loaded" in d.output(), START_TIMEOUT, "the bulk load")
        initial = SparkRuntime(APP, make_config(data)).snapshot()
        with InputLog(os.path.join(data, "input.sqlite"), 4) as log:
            log.append_many(workload)
        Path(data, "go").touch()
        assert d.wait(RUN_TIMEOUT) == -signal.SIGKILL, d.tail()
        d.kill()
        rec = SparkRuntime(APP, make_config(data)).read_record(0)
        assert rec is not None and rec.deferred, "the workload no longer defers transactions in epoch 0"
        assert last_epoch(data) == 0

        Path(data, "done").touch()
        d = Driver(data, [*args, "--idle-timeout", "180"], str(tmp_path / "driver-1.log"), env=env)
        drivers.append(d)
        assert d.wait(RUN_TIMEOUT) == 0, d.tail()
    finally:
        for x in drivers:
            x.kill()
    assert last_epoch(data) >= 1
    check_result(data, initial, workload, ACCOUNTS * balance, max_batch=10_000, compact_every=0)
