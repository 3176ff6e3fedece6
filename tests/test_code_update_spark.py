"""A strict code update with a migration on real PySpark (local[2]) behind the gateway, under load: every
transaction before the boundary ran v1, every one after ran v2 on migrated state; a restart keeps v2."""

from __future__ import annotations

import threading
import time

import pytest

from charon.client import Client
from charon.config import GatewayConfig, SparkConfig
from charon.runtime.spark.runtime import SparkRuntime, make_session
from charon.server.gateway import BackgroundServer

pytestmark = pytest.mark.spark
TOKEN = "c0de"
N = 30


def test_strict_update_on_spark(tmp_path) -> None:
    spark = make_session(SparkConfig(master="local[2]", partitions=2))
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=1, idle_wait_ms=100)
    try:
        rt = SparkRuntime("code_versions:v1", cfg, spark=spark)
        rt.load("account", {f"a{i}": 100 for i in range(N)})
        seen: list[tuple[int, str, str]] = []
        errors: list[BaseException] = []
        stop = threading.Event()
        srv = BackgroundServer(rt, token=TOKEN, config=GatewayConfig(code_refs="code_versions:v2")).start()
        try:
            with Client(srv.url, token=TOKEN, timeout=120) as c:
                def drive(k: int) -> None:
                    i = k
                    try:
                        while not stop.is_set():
                            res = c.invoke_result("account", f"a{i % N}", "deposit", 1)
                            seen.append((res.epoch, res.value[0], c.status()["code_version"]))
                            i += 2
                    except BaseException as exc:  # noqa: BLE001 - reported by the test
                        errors.append(exc)

                threads = [threading.Thread(target=drive, args=(k,)) for k in range(2)]
                for t in threads:
                    t.start()
                time.sleep(3)
                out = c.update_code("code_versions:v2", "v2", ("account", "migrate", ["EUR"]))
                time.sleep(3)
                stop.set()
                for t in threads:
                    t.join()
                assert not errors, errors
                e = out["from_epoch"]
                assert out["migration"]["committed"] == N and out["migration"]["epochs"][0] == e
                before = {v for ep, v, _ in seen if ep < e}
                after = {v for ep, v, _ in seen if ep >= e}
                assert before == {"v1"} and after == {"v2"}, (e, seen)
                assert not any(ep in out["migration"]["epochs"] for ep, _, _ in seen), "the migration ran alone"
                state = c.read_state("account")["entities"]
                assert all(v["currency"] == "EUR" for v in state.values())
                assert sum(v["balance"] for v in state.values()) == N * 100 + len(seen)
                assert c.status()["code_version"] == "v2"
        finally:
            stop.set()
            srv.stop(timeout=120)
        again = SparkRuntime("code_versions:v1", cfg, spark=spark)  # restarted with the old ref
        assert again.app_ref == "code_versions:v2" and again.version_at(e - 1) == "1" and again.version_at(e) == "v2"
    finally:
        spark.stop()
