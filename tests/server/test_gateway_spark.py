"""The gateway over the Spark runtime, as a user runs it (`charon run ... --engine spark`), over real HTTP.

Includes the gateway (which hosts the Spark driver) being SIGKILLed while a request is in flight: after a
restart on the same data directory, the retried request (same Idempotency-Key) has executed exactly once.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from nodeproc import kill_tree, wait_healthy

from charon.log.sqlite import OutputLog

pytestmark = pytest.mark.spark
TOKEN = "t0ken"
CHARON = str(Path(sys.executable).parent / "charon")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, CHARON_MASTER="local[2]", PYSPARK_PYTHON=sys.executable)
        log = open(self.data_dir / f"gateway-{time.time():.0f}.log", "wb")
        self.proc = subprocess.Popen(
            [CHARON, "run", "charon.apps.ycsb:app", "--engine", "spark", "--data-dir", str(self.data_dir),
             "--port", str(self.port), "--token", TOKEN, "--partitions", "2"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_healthy(self.proc, self.url, timeout=180, log=Path(log.name), interval=0.5)

    def kill(self) -> None:
        kill_tree(self.proc)  # until the JVM and Python workers of the killed driver are gone (DESIGN §6)

    def invoke(self, key: str, fn: str, args: list, idem: str | None = None, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        if idem:
            headers["Idempotency-Key"] = idem
        r = httpx.post(f"{self.url}/invoke/account/{key}/{fn}", json={"args": args}, headers=headers,
                       timeout=kw.pop("timeout", 120), **kw)
        deadline = time.monotonic() + 180  # a restarted JVM on a loaded machine: past the gateway's wait
        while r.status_code == 202 and time.monotonic() < deadline:
            r = httpx.get(self.url + r.json()["status_url"] + "?wait=20", headers=headers, timeout=60)
        return r

    def state(self, key: str):
        r = httpx.get(f"{self.url}/state/account/{key}", headers={"Authorization": f"Bearer {TOKEN}"},
                      timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["value"]


@pytest.fixture
def gateway(tmp_path):
    g = Gateway(tmp_path)
    g.start()
    yield g
    g.kill()


def test_invoke_abort_and_async_mode_on_spark(gateway):
    r = gateway.invoke("alice", "deposit", [50])
    assert r.status_code == 200, r.text
    r = gateway.invoke("alice", "transfer", ["bob", 20])
    assert r.status_code == 200 and r.json()["value"] == 30
    r = gateway.invoke("bob", "transfer", ["alice", 1000])
    assert r.status_code == 409
    assert r.json()["error"]["type"] == "NotEnoughCredit"
    r = httpx.post(f"{gateway.url}/invoke/account/bob/deposit?mode=async", json={"args": [5]},
                   headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert r.status_code == 202
    rid = r.json()["request_id"]
    deadline = time.monotonic() + 120
    while True:
        p = httpx.get(f"{gateway.url}/requests/{rid}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        if p.status_code == 200:
            break
        assert p.status_code == 202 and time.monotonic() < deadline
        time.sleep(0.2)
    assert gateway.state("alice") == 30 and gateway.state("bob") == 25
    # rejected before the log: the input log does not grow
    r = gateway.invoke("bob", "nope", [])
    assert r.status_code == 404


def test_retry_after_gateway_kill_executes_once(gateway):
    assert gateway.invoke("carol", "deposit", [7]).status_code == 200
    outcome: dict = {}

    def in_flight():
        try:
            outcome["first"] = gateway.invoke("carol", "deposit", [100], idem="once-1", timeout=60)
        except httpx.HTTPError as exc:  # the gateway dies under it
            outcome["first"] = exc

    t = threading.Thread(target=in_flight)
    t.start()
    time.sleep(0.4)
    gateway.kill()
    t.join()
    gateway.start()
    r = gateway.invoke("carol", "deposit", [100], idem="once-1")
    assert r.status_code == 200, r.text
    again = gateway.invoke("carol", "deposit", [100], idem="once-1")
    assert again.json()["tid"] == r.json()["tid"], "a retry returns the first result"
    assert gateway.state("carol") == 107, "the deposit executed exactly once"
    out = OutputLog(gateway.data_dir / "output.sqlite")
    assert out.get("once-1") is not None
    assert sum(1 for _, rep in out.read_since(0, 100000) if rep.request_id == "once-1") == 1
