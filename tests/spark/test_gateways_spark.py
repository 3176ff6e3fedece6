"""`charon run --engine spark --gateways 2` (issue 32 item 3): the driver runs the epochs, two gateway processes
of its own serve HTTP over the SQLite logs. Requests spread over both are answered once each; a retry of the same
id through the other gateway gets the same reply; a gateway SIGKILLed under load is restarted by the driver while
clients retry through the other one, and nothing acknowledged is lost; each gateway's /health says when the driver
does not answer; the driver's death takes its gateways with it. One deployment for the module (Spark starts once)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from charon.server.serve import free_port

pytestmark = pytest.mark.spark
TOKEN = "gw-spark"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]


class Deployment:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
        self.log = log

    def health(self, i: int) -> httpx.Response:
        return httpx.get(self.urls[i] + "/health", timeout=10)

    def pid(self, i: int) -> int:
        return int(self.health(i).json()["gateway"]["pid"])


def _two_free_ports() -> int:
    while True:
        port = free_port()
        try:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    where = tmp_path_factory.mktemp("gateways")
    port = _two_free_ports()
    log = where / "run.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYSPARK_PYTHON": sys.executable,
           "PYSPARK_DRIVER_PYTHON": sys.executable, "CHARON_TOKEN": TOKEN}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "charon.cli", "run", "charon.apps.ycsb:app", "--engine", "spark", "--gateways", "2",
             "--partitions", "2", "--port", str(port)],
            env=env, cwd=where, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    d = Deployment(proc, port, log)
    try:
        deadline = time.monotonic() + 240
        while "charon: ready" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield d
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        with_group = proc.pid
        try:
            os.killpg(with_group, signal.SIGKILL)  # the JVM and anything left
        except ProcessLookupError:
            pass


def _invoke(d: Deployment, first: int, key: str, amount: int, rid: str, deadline_s: float = 90.0
            ) -> tuple[dict, list[int]]:
    """Deposit through gateway ``first``; on a failure, retry the same id through the other (alternating) until
    a reply; returns it and the gateways that were tried."""
    deadline = time.monotonic() + deadline_s
    tried: list[int] = []
    why: list[str] = []
    i = first
    while True:
        tried.append(i)
        try:
            r = httpx.post(f"{d.urls[i]}/invoke/account/{key}/deposit", json={"args": [amount]},
                           headers={**AUTH, "Idempotency-Key": rid}, timeout=60)
            while r.status_code == 202:  # still running: poll (any gateway knows it from the logs)
                r = httpx.get(f"{d.urls[i]}/requests/{rid}?wait=5", headers=AUTH, timeout=60)
            if r.status_code == 200:
                return r.json(), tried
            why.append(f"{r.status_code} {r.text[:200]}")
        except httpx.TransportError as exc:
            why.append(repr(exc))
        assert time.monotonic() < deadline, f"no reply for {rid} (tried {tried}: {why})"
        i = 1 - i
        time.sleep(0.05)


def test_requests_spread_over_both_gateways_run_once_and_retry_anywhere(dep: Deployment) -> None:
    pids = {dep.pid(0), dep.pid(1)}
    assert len(pids) == 2 and dep.proc.pid not in pids  # two processes, neither the driver
    _invoke(dep, 0, "warm", 1, "warm-up")  # the first epoch's Spark jobs are slow
    replies = {}
    for i in range(20):
        rep, tried = _invoke(dep, i % 2, f"s{i}", i + 1, f"spread-{i}")
        assert tried == [i % 2] and rep["status"] == "committed"
        replies[i] = rep
    for i in range(20):  # the same id through the other gateway: the same transaction, not a second one
        again = httpx.post(f"{dep.urls[1 - i % 2]}/invoke/account/s{i}/deposit", json={"args": [i + 1]},
                           headers={**AUTH, "Idempotency-Key": f"spread-{i}"}, timeout=30)
        assert again.status_code == 200 and again.json() == replies[i]
    for i in range(20):  # state reads go to the driver through either gateway: each deposit applied once
        got = httpx.get(f"{dep.urls[i % 2]}/state/account/s{i}", headers=AUTH, timeout=30)
        assert got.json()["value"] == i + 1, got.text
    assert len({(r["epoch"], r["position"]) for r in replies.values()}) == 20


def test_a_gateway_killed_under_load_is_restarted_and_nothing_acknowledged_is_lost(dep: Deployment) -> None:
    victim = dep.pid(1)
    acked: dict[str, tuple[int, dict]] = {}
    lock = threading.Lock()
    counter = iter(range(10_000))
    stop = threading.Event()

    def client(c: int) -> None:
        while not stop.is_set():
            with lock:
                n = next(counter)
            rep, _ = _invoke(dep, n % 2, f"k{n}", n + 1, f"load-{n}")
            with lock:
                acked[f"k{n}"] = (n + 1, rep)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
    for t in threads:
        t.start()
    while len(acked) < 20:
        time.sleep(0.05)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    deadline = killed_at + 120
    while True:  # the driver starts it again on the same port
        try:
            if dep.health(1).status_code == 200 and dep.pid(1) != victim:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, dep.log.read_text()[-3000:]
        time.sleep(0.1)
    back = time.monotonic() - killed_at
    n_before = len(acked)
    while len(acked) < n_before + 20:  # and it serves under the same load again
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(120)
    print(f"gateway SIGKILLed -> restarted and healthy in {back:.1f} s; {len(acked)} requests acknowledged")
    assert "gateway 1 (pid" in dep.log.read_text()  # the driver said so
    for key, (amount, rep) in acked.items():  # every acknowledged deposit applied, once
        got = httpx.get(f"{dep.urls[0]}/state/account/{key}", headers=AUTH, timeout=30)
        assert got.json()["value"] == amount, (key, rep, got.text)


def test_health_on_each_gateway_says_when_the_driver_does_not_answer(dep: Deployment) -> None:
    assert dep.health(0).status_code == 200 and dep.health(1).status_code == 200
    os.kill(dep.proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15
        seen = [None, None]
        while None in seen or any(s != 503 for s in seen):
            seen = [dep.health(i).status_code for i in (0, 1)]
            assert time.monotonic() < deadline, seen
            time.sleep(0.2)
        doc = dep.health(0).json()
        assert doc["status"] == "driver unreachable" and "does not answer" in doc["error"]
    finally:
        os.kill(dep.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while dep.health(0).status_code != 200 or dep.health(1).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_the_driver_s_death_takes_its_gateways_with_it(dep: Deployment) -> None:
    os.kill(dep.proc.pid, signal.SIGKILL)
    dep.proc.wait(10)
    deadline = time.monotonic() + 15
    while True:
        alive = []
        for i in (0, 1):
            try:
                dep.health(i)
                alive.append(i)
            except httpx.TransportError:
                pass
        if not alive:
            break
        assert time.monotonic() < deadline, f"gateways {alive} still answer after the driver died"
        time.sleep(0.2)
