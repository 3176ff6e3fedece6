"""The Spark engine with its checkpoint on object storage (``charon run --engine spark --storage s3://...``): the
driver's checkpoint directory and the executors' local directories are caches. A driver SIGKILLed mid-run, its
whole data directory and the executors' directories deleted, and a new driver on fresh directories with the same
S3 location and NATS log: every acknowledged transfer is there exactly once, money is conserved, and every reply
is the one given before the loss (real SeaweedFS, nats-server, PySpark ``local[2]``)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_transfers import balances, expected_balances, invoke_all, kill_mid_run
from natsfix import NatsCluster, NatsServer, free_port

from charon.storage.location import open_storage
from tests.support.seaweedfix import SeaweedS3

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]
CHARON = str(Path(sys.executable).parent / "charon")
TOKEN = "t0k"
N = 8  # accounts


class SparkDriver:
    """``charon run charon.apps.ycsb:app --engine spark`` in its own process group."""

    def __init__(self, tmp: Path, name: str, log_url: str, storage: str) -> None:
        self.data = tmp / f"{name}-data"
        self.local = tmp / f"{name}-executors"  # CHARON_LOCAL_DIR: the executors' stores and state cache
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "CHARON_MASTER": "local[2]", "CHARON_LOCAL_DIR": str(self.local),
               "CHARON_COMPACT_EVERY": "4", "CHARON_MAX_BATCH": "20", "CHARON_IDLE_WAIT_MS": "200",
               "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
        self.out = tmp / f"{name}.log"
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(
                [CHARON, "run", "charon.apps.ycsb:app", "--engine", "spark", "--partitions", "2", "--data-dir",
                 str(self.data), "--log", log_url, "--storage", storage, "--port", str(self.port), "--token", TOKEN],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def wait_ok(self, timeout: float = 240.0) -> float:
        t0 = time.monotonic()
        while True:
            assert self.proc.poll() is None, f"the driver exited:\n{self.out.read_text()[-3000:]}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < timeout, f"the driver did not start:\n{self.out.read_text()[-3000:]}"
            time.sleep(0.3)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def test_a_driver_and_its_executors_lost_resume_from_object_storage(tmp_path: Path, s3_env: SeaweedS3) -> None:
    """The log on a 3-server NATS cluster (replicas 3): the machine lost takes one of its servers with it."""
    cluster = NatsCluster(tmp_path / "nats").start()
    log_url = cluster.url(f"s3spark{uuid.uuid4().hex[:6]}")
    storage = s3_env.url(f"spark-{uuid.uuid4().hex[:8]}")
    first = SparkDriver(tmp_path, "m1", log_url, storage)
    second: SparkDriver | None = None
    try:
        first.wait_ok()
        seed: dict[str, dict] = {}
        asyncio.run(invoke_all(first.url, [(f"a{i}", "deposit", [100], f"seed{i}") for i in range(N)], seed, TOKEN))
        assert all(r["http"] == 200 for r in seed.values())
        transfers = [(f"a{i % N}", "transfer", [f"a{(i * 5 + 3) % N}", 1 + i % 7], f"t{i}") for i in range(120)]
        lost_at = 0.0

        def lose_the_machine() -> None:
            nonlocal lost_at
            lost_at = time.monotonic()
            first.kill()
            cluster.servers[0].kill()  # the NATS server of the driver's machine

        acked = kill_mid_run(first.url, lose_the_machine, transfers, after=70, token=TOKEN)
        assert 70 <= len(acked) < len(transfers), len(acked)
        store = open_storage(storage)
        keys = {o.key.split("/", 1)[0] for o in store.list("")}
        assert {"layout.json", "epochs", "state"} <= keys, keys  # the checkpoint is on object storage
        # the machine is lost: the driver's data directory (its checkpoint cache) and the executors' directories
        shutil.rmtree(first.data)
        shutil.rmtree(first.local)

        second = SparkDriver(tmp_path, "m2", log_url, storage)
        second.wait_ok()
        print(f"\nrecovery: the new driver served {time.monotonic() - lost_at:.1f} s after the loss (JVM start "
              f"included); {len(acked)} of {len(transfers)} transfers acknowledged before it")
        again: dict[str, dict] = {}
        asyncio.run(invoke_all(second.url, transfers, again, TOKEN))
        for tag, reply in acked.items():  # replies unchanged by the replay
            assert again[tag] == reply, (tag, reply, again[tag])
        accounts = [f"a{i}" for i in range(N)]
        got = balances(second.url, accounts, TOKEN)
        assert sum(got.values()) == 100 * N, got  # money conserved
        # every answered transfer applied exactly once, the refused ones not
        assert got == expected_balances({a: 100 for a in accounts}, transfers, again)
    finally:
        first.kill()
        if second is not None:
            second.kill()
        cluster.kill()


def test_a_cluster_sharing_only_object_storage_and_the_log_loses_a_worker(
        tmp_path: Path, s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A standalone cluster of 3 Workers x 1 core, each with its own directories (``CHARON_LOCAL_DIR``, Spark's
    local and work dirs), whose only shared things are S3 and the NATS log (the driver's data directory is its
    own): a Worker SIGKILLed mid-run and its directories wiped; the run completes, its state and replies equal the
    in-process runtime's over the same epochs, each request answered once, money conserved.

    The same run is the resident gang's test on 3 Workers (it was test_spark_cluster.py's own cluster run): the
    gang (3 tasks, ``resident_tasks`` 0: every slot) runs one task on each Worker's executor; the Worker killed
    while requests keep coming is the one under the gang's last task, and the gang is relaunched with 2 tasks on
    the 2 Workers left (never waiting for the lost slot), whose stores end holding every partition."""
    from spark_driver import Driver, check_result, driver_args, last_epoch, make_config, transfers

    from charon.log.location import open_input_log
    from charon.runtime.spark.cluster import StandaloneCluster
    from charon.runtime.spark.runtime import SparkRuntime

    accounts, balance = 200, 100
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    for k in aws:  # the Workers do not have the credentials: the application passes them (spark.executorEnv)
        monkeypatch.delenv(k)
    cluster = StandaloneCluster(str(tmp_path / "cluster"), workers=3, cores=1, memory="1g")
    nats = NatsServer(tmp_path / "nats").start()
    status = tmp_path / "status.json"
    d: Driver | None = None
    log = None
    feeder: threading.Thread | None = None
    stop_feeding = threading.Event()
    try:
        cluster.start()
        for k, v in aws.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("CHARON_LOG_URL", f"{nats.url}/cl{uuid.uuid4().hex[:6]}")
        monkeypatch.setenv("CHARON_STORAGE_URL", s3_env.url(f"cluster-{uuid.uuid4().hex[:8]}"))
        data = str(tmp_path / "driver")
        opts = {"master": cluster.master_url, "max_batch": 50, "compact_every": 4}
        conf = {**cluster.app_conf(executor_cores=1, max_cores=3), "spark.task.maxFailures": "2"}
        args = driver_args(**opts, conf=conf, status_file=str(status))  # type: ignore[arg-type]
        d = Driver(data, ["--load", str(accounts), "--run", "--balance", str(balance), *args],
                   str(tmp_path / "driver.log"))
        d.wait_until(lambda: "loaded" in d.output(), 300, "the bulk load")
        initial = SparkRuntime("charon.apps.ycsb:app", make_config(data, **opts)).snapshot()  # type: ignore[arg-type]
        assert len(initial) == accounts
        workload = transfers(accounts, 1200, seed=5)
        log = open_input_log(os.environ["CHARON_LOG_URL"], 4)
        log.append_many(workload[:400])
        Path(data, "go").touch()
        dirs = [cluster.worker_store_dir(i) for i in range(3)]

        def gang(tasks: int, token: str | None = None) -> dict:
            g = _read_status(status).get("gang") or {}
            ok = (g.get("tasks") == tasks and len(g.get("seated", [])) == tasks and not g.get("broken")
                  and g.get("token") != token)
            return g if ok else {}

        def all_resident() -> bool:
            cluster.scan()
            return (last_epoch(data) >= 2 and bool(gang(3))
                    and all(any(Path(x).glob("charon-*/p*/data.mdb")) for x in dirs))

        d.wait_until(all_resident, 300, "a gang of 3 tasks and partition stores on every worker")
        first = gang(3)
        executors = {t["executor"] for t in first["seated"]}
        assert len(executors) == 3, f"the gang's tasks share an executor: {first}"
        where = {t["task"]: _worker_of(cluster, t["pid"]) for t in first["seated"]}
        assert sorted(where.values()) == [0, 1, 2], f"the gang is not on all three Workers: {where} {first}"

        def feed() -> None:  # requests keep coming through the kill
            assert log is not None
            for i in range(400, len(workload), 40):
                if stop_feeding.is_set():
                    return
                log.append_many(workload[i:i + 40])
                time.sleep(0.1)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        time.sleep(1.0)
        victim_task = first["seated"][-1]
        victim = where[victim_task["task"]]
        assert victim is not None
        at_kill = last_epoch(data)
        assert feeder.is_alive(), "the load ended before the kill"
        t_kill = time.monotonic()
        assert cluster.kill_worker(victim), f"worker {victim} survived SIGKILL"
        survivors = sorted(set(range(3)) - {victim})
        assert all(cluster.workers[i].alive() for i in survivors) and not cluster.workers[victim].alive()
        for path in cluster.workers[victim].dirs.values():  # its machine's disks are gone with it
            shutil.rmtree(path)
        d.wait_until(lambda: gang(2, first["token"]) and last_epoch(data) > at_kill + 1, 400,
                     "a gang of 2 tasks on the Workers left")
        recovery = time.monotonic() - t_kill
        second = gang(2, first["token"])
        feeder.join(400)
        assert not feeder.is_alive()
        Path(data, "done").touch()
        rc = d.wait(400)
        assert rc == 0, f"the run failed after losing a worker (exit {rc})\n{d.tail()}"
        assert "Lost executor" in Path(data, "spark.log").read_text(errors="replace")
        last = last_epoch(data)
        print(f"\ngang on Workers {where}; worker {victim} lost at epoch {at_kill}; a 2-task gang committed "
              f"{recovery:.1f} s after the kill on {[t['executor'] for t in second['seated']]}; "
              f"the run ended at epoch {last}")
        left = {t["executor"] for t in second["seated"]}
        assert left == executors - {victim_task["executor"]}, (second, first)
        assert sorted(where[t["task"]] for t in first["seated"] if t["executor"] in left) == survivors
        assert last >= at_kill + 3, "too few epochs ran after the kill"
        check_result(data, initial, workload, accounts * balance, **opts)
        # the two Workers left ran every partition to the end: their stores hold all of them at the last epoch
        held = {p: root for i in survivors for p, root in _stores(cluster.worker_store_dir(i)).items()
                if _local_epoch(root, p) == last}
        assert sorted(held) == [0, 1, 2, 3], held
    finally:
        stop_feeding.set()
        if feeder is not None:
            feeder.join(30)
        if d is not None:
            d.kill()
        if log is not None:
            log.close()
        cluster.stop()
        nats.kill()


def _read_status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _worker_of(cluster: Any, pid: int) -> int | None:
    """The Worker whose process tree (its executor's Python workers) holds ``pid``."""
    cluster.scan()
    found = [i for i, w in enumerate(cluster.workers) if pid in w.tree.seen]
    return found[0] if len(found) == 1 else None


def _stores(root: str) -> dict[int, str]:
    """Partition stores (LMDB environments) under a worker's ``CHARON_LOCAL_DIR``: {pid: directory}."""
    return {int(p.parent.name[1:]): str(p.parent.parent) for p in Path(root).glob("charon-*/p*/data.mdb")}


def _local_epoch(root: str, pid: int) -> int:
    from charon.state.lmdbstore import LmdbStore

    s = LmdbStore(root, pid)  # no durable copy: only reads the local marker
    try:
        return s.epoch
    finally:
        s.close()
