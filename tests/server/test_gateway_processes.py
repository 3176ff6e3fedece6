"""Gateway processes over the logs (issue 32 item 3), without Spark: a real ``charon run --engine remote`` process
over SQLite logs, supervised by :class:`charon.cli.gatewayprocs.GatewayProcesses`, forwarding what it cannot serve to
a "driver" (an in-process node's gateway here; Spark's in tests/spark/test_gateways_spark.py). A thread plays the
engine: it reads the input log another process appends to and writes replies to the output log."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from charon import serde
from charon.apps import ycsb
from charon.cli.gatewayprocs import GatewayProcesses
from charon.log.sqlite import InputLog, OutputLog
from charon.messages import Reply
from charon.runtime.node.inprocess import InProcessRuntime
from charon.server.serve import BackgroundServer, bind_socket, free_port

TOKEN = "gw-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]


class FakeEngine:
    """Answers every logged request ``deposit(n)`` with ``n * 10`` (tid = its place in the log), in a thread."""

    def __init__(self, data: Path) -> None:
        self.input = InputLog(data / "input.sqlite", 2)
        self.output = OutputLog(data / "output.sqlite")
        self.done = [0, 0]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        n = 0
        while not self.stop.wait(0.002):
            ends = self.input.end_offsets()
            rows = self.input.read_range(self.done, ends)
            self.done = list(ends)
            replies = []
            for _, _, req in rows:
                n += 1
                replies.append(Reply(req.request_id, n, 0, True, serde.encode(serde.decode(req.args)[0] * 10), "",
                                     "", n))
            self.output.put_many(replies)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[tuple[GatewayProcesses, BackgroundServer, FakeEngine]]:
    rt = InProcessRuntime(ycsb.app, partitions=2)
    rt.load("account", {"a": 7})
    driver = BackgroundServer(rt, token=TOKEN, max_body=4096).start()
    engine = FakeEngine(tmp_path)
    engine.thread.start()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CHARON_TOKEN": TOKEN}
    argv = [sys.executable, "-m", "charon.cli", "run", "charon.apps.ycsb:app", "--engine", "remote", "--data-dir",
            str(tmp_path), "--driver", driver.url, "--child-of", str(os.getpid()), "--max-body", "4096"]
    procs = GatewayProcesses([bind_socket("127.0.0.1", free_port())], argv, env).start()
    try:
        assert procs.wait_ready(60), "the gateway process did not become healthy"
        yield procs, driver, engine
    finally:
        procs.stop()
        engine.stop.set()
        driver.stop()


def _health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=5)


def test_invokes_go_through_the_logs_and_the_rest_to_the_driver(deployment) -> None:
    procs, driver, _ = deployment
    url = f"http://127.0.0.1:{procs.ports[0]}"
    with httpx.Client(base_url=url, headers=AUTH, timeout=10) as c:
        first = c.post("/invoke/account/k1/deposit", json={"args": [4]}, headers={"Idempotency-Key": "r-1"})
        assert first.status_code == 200 and first.json()["value"] == 40, first.text
        again = c.post("/invoke/account/k1/deposit", json={"args": [4]}, headers={"Idempotency-Key": "r-1"})
        assert again.json() == first.json()  # the same reply, from the output log
        clash = c.post("/invoke/account/k1/deposit", json={"args": [5]}, headers={"Idempotency-Key": "r-1"})
        assert clash.status_code == 422  # checked against the input log another process wrote
        assert c.get("/requests/r-1").json()["tid"] == first.json()["tid"]
        # state and admin routes are the driver's (its in-process engine here), with the client's token
        assert c.get("/state/account/a").json()["value"] == 7
        assert c.get("/admin/status").json()["engine"] == "inprocess"
        assert httpx.get(url + "/state/account/a", timeout=10).status_code == 401
        assert c.post("/admin/pause", content=b"x" * 5000, headers={"content-type": "application/json"}
                      ).status_code == 413
    doc = _health(url).json()
    assert doc["ok"] is True and doc["gateway"]["pid"] == procs.pids()[0] != os.getpid()


def test_a_killed_gateway_process_is_restarted_on_the_same_socket(deployment) -> None:
    procs, _, _ = deployment
    url = f"http://127.0.0.1:{procs.ports[0]}"
    before = procs.pids()[0]
    assert before is not None
    os.kill(before, signal.SIGKILL)
    t0 = time.monotonic()
    # a client connecting meanwhile waits in the socket's backlog (the driver holds it), then is served
    r = httpx.post(url + "/invoke/account/k2/deposit", json={"args": [3]}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["value"] == 30
    after = _health(url).json()["gateway"]["pid"]
    assert after != before and procs.restarts() == 1
    print(f"killed gateway to its next answer: {time.monotonic() - t0:.2f} s")


def test_health_says_when_the_driver_is_unreachable(deployment) -> None:
    procs, driver, _ = deployment
    url = f"http://127.0.0.1:{procs.ports[0]}"
    driver.stop()
    deadline = time.monotonic() + 10
    while (r := _health(url)).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.status_code == 503 and r.json()["status"] == "driver unreachable", r.text
    forwarded = httpx.get(url + "/admin/status", headers=AUTH, timeout=10)
    assert forwarded.status_code == 503 and forwarded.json()["error"]["type"] == "Unavailable"
    assert forwarded.headers["retry-after"] == "1"
