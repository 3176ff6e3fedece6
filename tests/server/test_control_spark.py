"""Runtime control on real PySpark (local[2]) behind the gateway: pause under load (no epoch advances, nothing
lost, resume drains in order), consistent cuts during YCSB-T, reads and SQL at retained epochs, metrics."""

from __future__ import annotations

import random
import threading
import time

import pytest

from charon.apps import ycsb
from charon.client import Client
from charon.config import SparkConfig
from charon.errors import TransactionAborted
from charon.runtime.spark.runtime import SparkRuntime
from charon.server.serve import BackgroundServer

pytestmark = pytest.mark.spark
TOKEN = "t0ken"
N = 200
BALANCE = 100
TOTAL = N * BALANCE


def _wait(pred, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_pause_inspect_sql_on_spark(spark, tmp_path) -> None:
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=1, max_batch=200,
                      idle_wait_ms=100, compact_every=1000)
    rt = SparkRuntime("charon.apps.ycsb:app", cfg, spark=spark)
    rt.load("account", ycsb.initial_state(N, BALANCE))
    srv = BackgroundServer(rt, token=TOKEN, wait_timeout=0.5).start()
    stop = threading.Event()
    driven: list[str] = []
    errors: list[BaseException] = []
    try:
        with Client(srv.url, token=TOKEN) as c:
            def drive() -> None:
                rng = random.Random(11)
                try:
                    while not stop.is_set():
                        a, b = rng.randrange(N), rng.randrange(N)
                        driven.append(c.submit("account", ycsb.key(a), "transfer", ycsb.key(b), rng.randint(1, 40)))
                        time.sleep(0.01)
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    errors.append(exc)

            loader = threading.Thread(target=drive)
            loader.start()
            _wait(lambda: c.status()["epoch"] >= 3, what="epochs under load")
            # consistent cuts while the load runs
            cuts = []
            for _ in range(4):
                cut = c.read_state("account")
                assert cut["count"] == N and sum(cut["entities"].values()) == TOTAL, cut["epoch"]
                cuts.append(cut["epoch"])
            assert cuts == sorted(cuts)
            # pause under load
            c.pause()
            _wait(lambda: c.status()["state"] == "paused", what="paused")
            frozen = c.status()["epoch"]
            mine = [c.submit("account", ycsb.key(i), "deposit", 1) for i in range(20)]
            time.sleep(2.0)
            st = c.status()
            assert st["epoch"] == frozen and st["paused"], st
            assert st["backlog"] >= 20
            text = c.metrics()
            assert "charon_paused 1.0" in text and "charon_epoch_spark_jobs_bucket" in text
            c.resume()
            results = [c.result_of(rid, 120) for rid in mine]
            assert all(r.epoch > frozen for r in results)
            # arrival order = input-log order (the gateway's appends are group-committed concurrently)
            log = rt.input_log.read_range(rt.input_log.start_offsets(), rt.input_log.end_offsets())
            offset = {req.request_id: off for _, off, req in log}
            by_arrival = sorted(zip(mine, results, strict=True), key=lambda m: offset[m[0]])
            order = [(r.epoch, r.tid) for _, r in by_arrival]
            assert order == sorted(order), "the requests that waited ran in arrival order"
            # a serializable admin update under load: in epochs of its own, once
            up = c.admin_update("bonus", "account", "deposit", 1)
            assert up["committed"] == N and not up["repeated"] and up["epochs"]
            assert c.admin_update("bonus", "account", "deposit", 1)["repeated"] is True
            time.sleep(0.5)
            stop.set()
            loader.join()
            assert not errors, errors
            client_epochs = set()
            for rid in driven:  # nothing was lost: every request committed or aborted (NotEnoughCredit)
                try:
                    client_epochs.add(c.result_of(rid, 120).epoch)
                except TransactionAborted as exc:
                    assert exc.error_type == "NotEnoughCredit"
                    client_epochs.add(exc.epoch)
            assert not client_epochs & set(up["epochs"]), "the admin update ran alone"
            assert max(client_epochs) > max(up["epochs"]), "the load went on after it"
            _wait(lambda: c.status()["backlog"] == 0, what="drained")
            last = c.status()
            total = TOTAL + 20 + N
            assert sum(c.read_state("account")["entities"].values()) == total
            # an earlier epoch, still retained by the durable copy: the cut still conserves money
            early = c.read_state("account", epoch=frozen)
            assert early["epoch"] == frozen and sum(early["entities"].values()) == TOTAL
            # SQL over state, at the latest and an earlier epoch
            rt.state_frame("account").createOrReplaceTempView("account")
            row = spark.sql("SELECT sum(value) AS s, count(*) AS n, min(epoch) AS e FROM account").collect()[0]
            assert (row.s, row.n) == (total, N) and row.e >= last["epoch"]
            rt.state_frame("account", epoch=frozen).createOrReplaceTempView("account_then")
            assert spark.sql("SELECT sum(value) FROM account_then").collect()[0][0] == TOTAL
            # stop while paused with a backlog: the waiting epoch does not run, and stopping does not hang
            c.pause()
            _wait(lambda: c.status()["state"] == "paused", what="paused again")
            c.submit("account", "a0", "deposit", 1)
    finally:
        stop.set()
        srv.stop(timeout=120)
    assert not srv._thread.is_alive(), "the gateway stopped while the runtime was paused"
