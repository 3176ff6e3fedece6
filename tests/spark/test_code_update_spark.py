"""A strict code update with a migration on real PySpark (local[2]) behind the gateway, under load: every
transaction before the boundary ran v1, every one after ran v2 on migrated state; a restart keeps v2."""

from __future__ import annotations

import threading
import time

import pytest

from charon.client import Client
from charon.config import GatewayConfig, SparkConfig
from charon.runtime.spark.runtime import SparkRuntime
from charon.server.serve import BackgroundServer

pytestmark = pytest.mark.spark
TOKEN = "c0de"
N = 30


def test_strict_update_on_spark(spark, tmp_path) -> None:
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=1, idle_wait_ms=100)
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


def test_compatible_update_on_spark_under_load(spark, tmp_path) -> None:
    """Compatible updates on real PySpark while clients submit contended transactions: updates alternate
    c1 -> c2 -> c1 ... until a boundary held deferred transactions. Every reply names the code it ran (its
    value says what the executors ran: never a mix), the deferred ones finished on the old code after the
    boundary, at most two versions ran after it; a restart keeps the update (and the old code while needed)."""
    import random

    import httpx

    keys = [f"a{i}" for i in range(6)]
    cfg = SparkConfig(master="local[2]", data_dir=str(tmp_path), partitions=2, log_partitions=2, idle_wait_ms=50)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    rt = SparkRuntime("code_versions:c1", cfg, spark=spark)
    rt.load("acct", {k: 100 for k in keys})
    rids: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    gcfg = GatewayConfig(code_refs="code_versions:c1,code_versions:c2")
    srv = BackgroundServer(rt, token=TOKEN, config=gcfg).start(timeout=120)
    updates: list[dict] = []
    try:
        with Client(srv.url, token=TOKEN, timeout=120) as c:
            def drive(seed: int) -> None:
                rng = random.Random(seed)
                try:
                    while not stop.is_set():
                        rids.append(c.submit("acct", rng.choice(keys), "route", "a"))
                        time.sleep(0.01)
                except BaseException as exc:  # noqa: BLE001 - reported by the test
                    errors.append(exc)

            threads = [threading.Thread(target=drive, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            try:
                time.sleep(2)
                for n in range(30):
                    label = ("c2", "c1")[n % 2]
                    updates.append(c.update_code(f"code_versions:{label}", label, mode="compatible"))
                    if updates[-1]["kept_deferred"] and n >= 1:
                        break
                    while c.status()["epoch"] <= updates[-1]["from_epoch"]:  # an epoch runs in between
                        time.sleep(0.02)
                time.sleep(1.5)
            finally:
                stop.set()
                for t in threads:
                    t.join()
            assert not errors, errors
            u = updates[-1]
            assert u["kept_deferred"] > 0, f"no boundary held a deferred transaction: {updates}"
            replies = []
            with httpx.Client(base_url=srv.url, headers=auth, timeout=120) as h:
                for rid in rids:
                    r = h.get(f"/requests/{rid}", params={"wait": 60})
                    assert r.status_code == 200, r.text
                    replies.append(r.json())
            assert all(d["value"] == [d["code_version"]] * 2 for d in replies), "each reply names its code"
            e, new, old = u["from_epoch"], u["version"], "c1" if u["version"] == "c2" else "c2"
            after = [d for d in replies if d["epoch"] >= e]
            late = [d for d in after if d["tid"] < u["first_tid"]]
            assert late and all(d["code_version"] == old for d in late), "deferred ones finished on the old code"
            assert {d["code_version"] for d in after} <= {old, new}, "at most two versions after the boundary"
            assert any(d["code_version"] == new for d in after)
            assert c.status()["code_version"] == new
            assert all(upd["mode"] == "compatible" for upd in updates)
    finally:
        stop.set()
        srv.stop(timeout=120)
    # a restart (with the old ref) keeps the newest code, and the previous one while the last record holds
    # transactions deferred before the boundary
    again = SparkRuntime("code_versions:c1", cfg, spark=spark)
    rec = again.read_record(again.last_recorded_epoch())
    waiting = [tid for tid, _ in rec.deferred if tid < u["first_tid"]]
    assert again.app_ref == f"code_versions:{new}"
    assert again.controller.previous == ((u["first_tid"], f"code_versions:{old}") if waiting else None)
    assert again.version_at(e, u["first_tid"] - 1) == old and again.version_at(e, u["first_tid"]) == new


def test_compatible_update_on_spark_survives_a_crash(spark, tmp_path) -> None:
    """SIGKILL right after a compatible update was recorded (as the boundary epoch starts): the restarted
    runtime runs the new code and still finishes the transactions deferred before the boundary on the old
    code; every reply's value matches the version it names; the old code is dropped afterwards."""
    import json
    import os
    import random
    import subprocess
    import sys

    import code_versions
    from code_update_driver import KEYS, config

    from charon import InProcessRuntime, Request, serde

    # one contended batch that defers transactions (found in-process: Spark runs the same epoch identically)
    for seed in range(100):
        rng = random.Random(seed)
        calls = []
        for i in range(40):
            k = rng.choice(KEYS)
            if rng.random() < 0.6:
                calls.append((f"old-{i}", k, "route", ["a"]))
            else:
                calls.append((f"old-{i}", k, "transfer", [rng.choice(KEYS), rng.randint(1, 5)]))
        probe = InProcessRuntime(code_versions.c1, partitions=2, warmup_txns=0)
        probe.load("acct", {k: 100 for k in KEYS})
        probe.run_epoch([Request(r, "acct", k, f, serde.encode(a), float(i)) for i, (r, k, f, a) in enumerate(calls)])
        if probe.coordinator.deferred:
            break
    else:
        pytest.fail("no contended batch defers a transaction any more: change the workload")
    reqs_path = tmp_path / "requests.json"
    reqs_path.write_text(json.dumps(calls))
    data = str(tmp_path / "data")
    env = {**os.environ, "CHARON_CRASH_AT": "before_epoch:1", "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable}
    driver = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support", "code_update_driver.py")
    child = subprocess.run([sys.executable, driver, data, str(reqs_path)], capture_output=True, text=True,
                           timeout=600, env=env)
    assert child.returncode == -9, child.stdout[-3000:] + child.stderr[-3000:]
    out = json.loads(child.stdout.strip().splitlines()[-1])
    assert out["mode"] == "compatible" and out["from_epoch"] == 1 and out["kept_deferred"] > 0, out
    rt = SparkRuntime("code_versions:c1", config(data), spark=spark)  # restarted with the old ref
    assert rt.last_recorded_epoch() == 0, "the crash came before the boundary epoch was recorded"
    assert rt.app_ref == "code_versions:c2"
    assert rt.controller.previous == (out["first_tid"], "code_versions:c1")
    rt.start()
    try:
        new = [Request(f"new-{i}", "acct", KEYS[i % 6], "route", serde.encode(["a"]), 100.0 + i)
               for i in range(10)]
        rt.input_log.append_many(new)
        rt.wait_idle(300)
    finally:
        rt.stop()
    assert rt.controller.previous is None, "the old code is dropped once its transactions finished"
    late = 0
    for rid, *_ in calls:
        rep = rt.get_reply(rid)
        assert rep is not None and rt.version_at(rep.epoch, rep.tid) == "c1", rid
        if rep.ok:
            assert serde.decode(rep.value) == ["c1", "c1"], rid
        late += rep.epoch >= 1
    assert late == out["kept_deferred"], "the deferred ones finished after the boundary, on c1"
    for r in new:
        rep = rt.get_reply(r.request_id)
        assert rep is not None and rep.epoch >= 1 and rt.version_at(rep.epoch, rep.tid) == "c2"
        if rep.ok:
            assert serde.decode(rep.value) == ["c2", "c2"]
