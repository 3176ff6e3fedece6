"""Durable promises and schedules on the real PySpark engine (issue 34; one test: it is slow): ``charon run --engine
spark``, through the engine contract like every engine: continuations run once whatever settles first, a second
resolve is a typed 409, the declared schedule fires each slot at most once, across a SIGKILL of the driver, its
JVM and workers, and across a rescale (2 -> 3 partitions) after it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from nodeproc import kill_tree, start_charon, support_env

from charon import PromiseConflict
from charon.client import Client
from charon.server.serve import free_port

pytestmark = pytest.mark.spark


def _start(data: Path, port: int) -> subprocess.Popen[bytes]:
    env = support_env(CHARON_MASTER="local[2]", PYSPARK_PYTHON=sys.executable)
    return start_charon(["run", "spark_durable_app:app", "--engine", "spark", "--data-dir", str(data), "--partitions",
                         "2"], port=port, env=env, log=data.parent / f"spark-{time.time():.0f}.log", timeout=240,
                        group=True, stdout=True, interval=0.5)


def _kill(proc: subprocess.Popen) -> None:
    kill_tree(proc)  # until the killed driver's JVM and Python workers are gone (they may linger briefly)


def _until(check, timeout: float = 180.0):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def test_promises_and_a_schedule_on_spark_across_a_sigkill(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    data.mkdir()
    proc = _start(data, port)
    try:
        with Client(url, timeout=120, retries=5) as c:
            pids = [c.invoke("orders", f"o{i}", "place", 3600.0 if i < 3 else 2.0, request_id=f"place-{i}")
                    for i in range(4)]
            c.resolve(pids[0], "yes", request_id="r0")
            c.reject(pids[1], "no")
            _until(lambda: all(c.state("orders", f"o{i}")["runs"] for i in (0, 1, 3)))
            _until(lambda: len(c.state("ticks", "every-second") or {}) and
                   len(c.state("ticks", "every-second")["slots"]) >= 2)
        _kill(proc)
        proc = _start(data, port)
        with Client(url, timeout=120, retries=5) as c:
            assert c.resolve(pids[0], "yes", request_id="r0")["status"] == "resolved", "a retry: the same answer"
            with pytest.raises(PromiseConflict):
                c.resolve(pids[1], "late")
            c.resolve(pids[2], {"n": 2})
            _until(lambda: c.state("orders", "o2")["runs"])
            before = len(c.state("ticks", "every-second")["slots"])
            _until(lambda: len(c.state("ticks", "every-second")["slots"]) >= before + 2)
            moved = c.rescale(3)  # the schedule's entity moves to a new partition layout between two firings
            assert (moved["from"], moved["to"]) == (2, 3), moved
            before = len(c.state("ticks", "every-second")["slots"])
            _until(lambda: len(c.state("ticks", "every-second")["slots"]) >= before + 2)
            states = [c.state("orders", f"o{i}") for i in range(4)]
            slots = c.state("ticks", "every-second")["slots"]
            rec = c.schedule("heartbeat")
    finally:
        _kill(proc)
    assert [s["runs"] for s in states] == [1, 1, 1, 1], "each continuation exactly once"
    assert [s["outcome"].get("value") for s in (states[0], states[2])] == ["yes", {"n": 2}]
    assert [states[1]["outcome"]["error_type"], states[3]["outcome"]["error_type"]] == [
        "PromiseRejected", "PromiseTimedOut"]
    assert slots == sorted(slots) and len(set(slots)) == len(slots), "no slot fired twice"
    assert all(int(s) % 2 == 0 for s in slots) and rec["fired"] >= len(slots) - 1
