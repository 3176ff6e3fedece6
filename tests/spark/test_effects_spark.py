"""Durable effects on the real PySpark engine (issue 23 "must show", one test: it is slow): ``charon run --engine
spark --effects`` (the executor in the driver process) against the real external HTTP test service under random
failures, SIGKILLed (driver, JVM and workers) mid-run and restarted: every effect applied once at the service,
every continuation exactly once."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from nodeproc import kill_tree, start_charon, support_env

from charon.client import Client
from charon.server.serve import free_port

TESTS = Path(__file__).resolve().parents[1] / "support"  # the test apps and the external service
sys.path.insert(0, str(TESTS))
from effects_service import Service  # noqa: E402

pytestmark = pytest.mark.spark
N = 12


def _start(data: Path, port: int, service: Service) -> subprocess.Popen[bytes]:
    env = support_env(CHARON_MASTER="local[2]", PYSPARK_PYTHON=sys.executable,
                      CHARON_TEST_SERVICE_URL=service.url)
    return start_charon(["run", "effects_app:app", "--engine", "spark", "--data-dir", str(data), "--partitions", "2",
                         "--effects"], port=port, env=env, log=data.parent / f"spark-{time.time():.0f}.log",
                        timeout=240, group=True, stdout=True, interval=0.5)


def _kill(proc: subprocess.Popen) -> None:
    kill_tree(proc)  # until the killed driver's JVM and Python workers are gone (they may linger briefly)


def test_effects_on_spark_across_a_sigkill(tmp_path: Path) -> None:
    service = Service(str(tmp_path / "service.sqlite")).start()
    service.control(fail_rate=0.3, fail_next=3)  # three certain failures: the retry path always runs
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    data.mkdir()
    proc = _start(data, port, service)

    def submit_all() -> None:
        with Client(url, timeout=120, retries=5) as c:
            for i in range(N):
                c.submit("acct", f"s{i}", "pay", 100 + i, 5.0, 100, request_id=f"pay-{i}")

    try:
        submit_all()
        deadline = time.monotonic() + 120
        while len(service.stats()["applied"]) < 3:
            assert time.monotonic() < deadline, service.stats()
            time.sleep(0.1)
        _kill(proc)
        proc = _start(data, port, service)
        submit_all()
        deadline = time.monotonic() + 240
        with Client(url, timeout=120, retries=5) as c:
            while True:
                states = [c.state("acct", f"s{i}") for i in range(N)]
                if all(s and s.get("state") == "paid" for s in states):
                    break
                assert time.monotonic() < deadline, states
                time.sleep(0.5)
    finally:
        _kill(proc)
    stats = service.stats()
    service.kill()
    assert len(stats["applied"]) == N
    assert sorted(b["amount"] for b in stats["applied"].values()) == list(range(100, 100 + N))
    assert all(s["runs"] == 1 and s["result"]["ok"] for s in states), states
    assert sum(stats["attempts"].values()) > N
