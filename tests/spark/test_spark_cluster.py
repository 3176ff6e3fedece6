"""The Spark runtime on a real standalone cluster (a Master and 2 or 3 Workers on 127.0.0.1, ``bin/spark-class``).

YCSB-T runs with one single-core executor per Worker; each Worker has its own ``CHARON_LOCAL_DIR``, so the
executors' resident partition stores are per Worker, and one Worker (with its executor and Python workers) is
SIGKILLed mid-run: in the job-per-round mode (``exchange="jobs"``, kept for clusters where a gang cannot run) on
2 Workers, Spark reschedules the lost tasks on the remaining executor and the result still equals the in-process
runtime's.

The resident mode (the default) on 3 Workers is one cluster run with the object-storage test
(tests/storage/test_spark_storage.py::test_a_cluster_sharing_only_object_storage_and_the_log_loses_a_worker):
the gang's three tasks run on the three Workers' executors (the runtime's ``health()["gang"]``, each task's
Python worker found under its Worker's process tree); after the kill the gang is relaunched with two tasks on the
two Workers left (sized by the slots left), restores the partitions it lacks from the durable copy, and the
result still equals the in-process runtime's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from spark_driver import Driver, check_result, driver_args, last_epoch, make_config, transfers

from charon.log.sqlite import InputLog
from charon.runtime.spark.cluster import StandaloneCluster
from charon.runtime.spark.runtime import SparkRuntime
from charon.state.lmdbstore import LmdbStore
from charon.state.records import EpochRecord

pytestmark = [pytest.mark.spark, pytest.mark.timeout(1200)]

APP = "charon.apps.ycsb:app"
ACCOUNTS = 1000
BALANCE = 100
MAX_BATCH = 200
COMPACT_EVERY = 5
START_TIMEOUT = 300.0
RUN_TIMEOUT = 600.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[StandaloneCluster]:
    """A Master and 2 Workers; it checks the cluster's own start and stop (they were a test of their own, with a
    cluster start of its own): the Master on 127.0.0.1, every daemon alive and the Workers registered, then after
    ``stop`` no daemon and no descendant left."""
    cl = StandaloneCluster(str(tmp_path / "cluster"), workers=2, cores=1, memory="1g")
    try:
        cl.start()  # stops what it started if it fails
        assert cl.master_url.startswith("spark://127.0.0.1:")
        assert all(d.alive() for d in cl.daemons)
        assert "Registering worker 127.0.0.1" in cl.master.log()
        yield cl
    finally:
        cl.stop()
    assert not any(d.alive() for d in cl.daemons)
    assert all(not d.tree._alive() for d in cl.daemons)


def stores(root: str) -> dict[int, str]:
    """Partition stores (LMDB environments) under a worker's ``CHARON_LOCAL_DIR``: {pid: directory}."""
    return {int(p.parent.name[1:]): str(p.parent.parent) for p in Path(root).glob("charon-*/p*/data.mdb")}


def local_epoch(root: str, pid: int) -> int:
    s = LmdbStore(root, pid)  # no durable copy: only reads the local marker
    try:
        return s.epoch
    finally:
        s.close()


def consumed(data_dir: str) -> int:
    path = os.path.join(make_config(data_dir).checkpoint_dir, "epochs", f"{last_epoch(data_dir):012d}.msgpack")
    with open(path, "rb") as f:
        return sum(msgspec.msgpack.decode(f.read(), type=EpochRecord).ends)


def test_worker_killed_mid_run_matches_in_process(cluster: StandaloneCluster, tmp_path: Path) -> None:
    """The job-per-round mode: Spark reschedules a lost Worker's tasks on the other one."""
    t0 = time.monotonic()
    data = str(tmp_path / "data")
    args = driver_args(master=cluster.master_url, max_batch=MAX_BATCH, compact_every=COMPACT_EVERY,
                       conf=cluster.app_conf(executor_cores=1, max_cores=2), exchange="jobs")
    workload = transfers(ACCOUNTS, 3000, seed=3)
    appended = workload[:2000]
    log: InputLog | None = None
    d = Driver(data, ["--load", str(ACCOUNTS), "--run", "--balance", str(BALANCE), *args],
               str(tmp_path / "driver.log"))
    try:
        d.wait_until(lambda: "loaded" in d.output(), START_TIMEOUT, "the bulk load")
        initial = SparkRuntime(APP, make_config(data)).snapshot()
        assert len(initial) == ACCOUNTS
        log = InputLog(os.path.join(data, "input.sqlite"), 4)
        log.append_many(appended)
        Path(data, "go").touch()

        # residency: each Worker's executor keeps partition stores in its own local directory
        dirs = [cluster.worker_store_dir(i) for i in range(2)]

        def both_resident() -> bool:
            cluster.scan()
            return last_epoch(data) >= 2 and all(stores(x) for x in dirs)

        d.wait_until(both_resident, RUN_TIMEOUT, "partition stores on both workers")
        before = [stores(x) for x in dirs]
        at_kill = last_epoch(data)
        assert consumed(data) < len(appended), "the run finished before the kill"
        assert cluster.kill_worker(1), "worker 1 survived SIGKILL"
        assert not cluster.workers[1].alive() and cluster.workers[0].alive()

        log.append_many(workload[2000:])
        appended = workload
        Path(data, "done").touch()
        rc = d.wait(RUN_TIMEOUT)
        assert rc == 0, f"the run failed after losing a worker (exit {rc})\n{d.tail()}"
        spark_log = Path(data, "spark.log").read_text(errors="replace")  # Spark's output (make_session)
        assert "Lost executor" in spark_log, "Spark did not notice the lost executor"
    finally:
        d.kill()
        if log is not None:
            log.close()

    last = last_epoch(data)
    print(f"\nstores before the kill: {before}; killed at epoch {at_kill}, last epoch {last}, "
          f"{time.monotonic() - t0:.0f} s")
    assert all(before), before
    assert {os.path.dirname(p) for b in before for p in b.values()} == set(dirs)
    assert last >= at_kill + 3, "too few epochs ran after the kill"
    check_result(data, initial, appended, ACCOUNTS * BALANCE, master=cluster.master_url, max_batch=MAX_BATCH,
                 compact_every=COMPACT_EVERY, exchange="jobs")
    # the survivor ran every partition to the end: its stores hold all of them at the last epoch
    survivor = stores(dirs[0])
    assert sorted(survivor) == [0, 1, 2, 3]
    assert [local_epoch(survivor[p], p) for p in range(4)] == [last] * 4
