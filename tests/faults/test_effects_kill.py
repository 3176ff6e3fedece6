"""Durable effects across SIGKILLs (issue 23 "must show"), all real processes: ``charon run --effects`` on the
durable in-process node, ``charon effects work`` worker processes and the external HTTP test service are each
SIGKILLed mid-run and restarted; every effect is applied once at the service (attempts counted vs applications)
and every continuation runs exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from nodeproc import kill, start_charon

from charon.client import Client
from charon.server.serve import free_port

TESTS = Path(__file__).resolve().parents[1] / "support"  # the test apps and the external service
sys.path.insert(0, str(TESTS))
from effects_service import Service  # noqa: E402

N = 40


def _env(service: Service) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "CHARON_TEST_SERVICE_URL": service.url}


def _start_engine(data: Path, port: int, service: Service, *extra: str) -> subprocess.Popen[bytes]:
    return start_charon(["run", "effects_app:app", "--data-dir", str(data), "--partitions", "2", *extra], port=port,
                        env=_env(service), log=data.parent / f"engine-{time.time():.3f}.log")


def _start_worker(data: Path, url: str, service: Service, index: int, workers: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "charon.cli", "effects", "work", "effects_app:app", "--url", url,
                             "--data-dir", str(data), "--index", str(index), "--workers", str(workers),
                             "--backoff", "0.05", *extra], env=_env(service), stdout=subprocess.DEVNULL,
                            stderr=open(data.parent / f"worker{index}-{time.time():.3f}.log", "wb"))  # noqa: SIM115


def _submit_all(url: str) -> None:
    with Client(url, timeout=30, retries=5) as c:
        for i in range(N):
            c.submit("acct", f"k{i}", "pay", 100 + i, 5.0, 100, request_id=f"pay-{i}")


def _wait_applied(service: Service, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(service.stats()["applied"]) < n:
        assert time.monotonic() < deadline, service.stats()
        time.sleep(0.05)


def _wait_all_continued(url: str, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    with Client(url, timeout=30, retries=5) as c:
        while True:
            states = [c.state("acct", f"k{i}") for i in range(N)]
            if all(s and s.get("state") == "paid" for s in states):
                return states
            assert time.monotonic() < deadline, states
            time.sleep(0.2)


def _check(service: Service, states: list[dict]) -> dict:
    stats = service.stats()
    assert len(stats["applied"]) == N  # every effect applied at the service, each idempotency key once
    assert sorted(b["amount"] for b in stats["applied"].values()) == list(range(100, 100 + N))
    assert all(s["runs"] == 1 and s["result"]["ok"] for s in states), states  # each continuation exactly once
    attempts = sum(stats["attempts"].values())
    assert attempts > N  # retried (injected failures and the kills): at least once, applied once
    return stats


def test_sigkill_engine_and_service_each_effect_applied_once(tmp_path: Path) -> None:
    service = Service(str(tmp_path / "service.sqlite")).start()
    service.control(fail_rate=0.3)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    engine = _start_engine(tmp_path / "data", port, service, "--effects")
    try:
        _submit_all(url)
        _wait_applied(service, 8)
        kill(engine)  # the engine and its in-process executor, mid-run
        service.kill()  # and the external service
        service.start()
        service.control(fail_rate=0.3)
        engine = _start_engine(tmp_path / "data", port, service, "--effects")
        _submit_all(url)  # a client retrying its requests: answered once each
        states = _wait_all_continued(url)
        _check(service, states)
        with Client(url) as c:
            text = c.metrics()
        assert "charon_effect_attempts_total" in text and 'charon_effects{status="done"}' in text
        doc = httpx.get(url + "/admin/effects", params={"status": "done", "limit": 1000}, timeout=10).json()
        assert doc["counts"]["done"] == N and len(doc["effects"]) == N
        assert httpx.get(url + "/admin/effects", params={"status": "bogus"}, timeout=10).status_code == 400
    finally:
        kill(engine)
        service.kill()


def test_sigkill_a_worker_and_the_service_each_effect_applied_once(tmp_path: Path) -> None:
    service = Service(str(tmp_path / "service.sqlite")).start()
    service.control(fail_rate=0.3)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    engine = _start_engine(data, port, service)
    metrics_port = free_port()
    workers = [_start_worker(data, url, service, 0, 2), _start_worker(data, url, service, 1, 2, "--metrics-port",
                                                                     str(metrics_port))]
    try:
        _submit_all(url)
        _wait_applied(service, 8)
        assert httpx.get(url + "/admin/effects", timeout=10).status_code == 404  # no executor in this process
        assert "/admin/effects" not in httpx.get(url + "/openapi.json", timeout=10).json()["paths"]
        kill(workers[0])
        service.kill()
        time.sleep(0.3)
        service.start()
        service.control(fail_rate=0.3)
        kill(engine)  # the engine too, while worker 1 keeps trying
        engine = _start_engine(data, port, service)
        workers[0] = _start_worker(data, url, service, 0, 2)
        states = _wait_all_continued(url)
        _check(service, states)
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text  # worker 1's own
        attempts = float(next(ln.split()[1] for ln in text.splitlines()
                              if ln.startswith("charon_effect_attempts_total")))
        assert attempts > 0 and 'charon_effects{status="done"} 40.0' in text
        r = subprocess.run([sys.executable, "-m", "charon.cli", "effects", "list", "--data-dir", str(data), "--json",
                            "--limit", "1000"], env=_env(service), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["counts"]["done"] == N and {e["outcome"] for e in doc["effects"]} == {"ok"}
        # an attempt is counted before it runs: the executor's count covers every call the service saw (and the
        # calls that never reached it while it was down)
        assert sum(e["attempts"] for e in doc["effects"]) >= sum(service.stats()["attempts"].values())
    finally:
        for w in workers:
            kill(w)
        kill(engine)
        service.kill()
