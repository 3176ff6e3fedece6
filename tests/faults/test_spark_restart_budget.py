"""A replayed epoch runs with the function budgets too (issue 31, `charon run --engine spark`): a node killed while
an endless function runs inside its budget replays that epoch at the restart; the replay stops the function past its
budget, and since that epoch never replied (nothing of it reached the output log) the verdict is taken anew: the
epoch commits, an unrelated request is answered, and /health is 200 only when nothing is stuck. (Before: the replay
ran without any budget, never committed again, and /health answered 200 "ok".)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from nodeproc import kill_tree, wait_healthy

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]
TOKEN = "t0k"
H = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
CHARON = str(Path(sys.executable).parent / "charon")
SUPPORT = Path(__file__).resolve().parents[1] / "support"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(data: Path, port: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")]),
               PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable, CHARON_MASTER="local[2]")
    log = open(data / "gateway.log", "ab")  # noqa: SIM115 - the child owns it
    p = subprocess.Popen([CHARON, "run", "spin_restart_app:app", "--engine", "spark", "--data-dir", str(data / "d"),
                          "--token", TOKEN, "--port", str(port), "--partitions", "2"],
                         cwd=SUPPORT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_healthy(p, f"http://127.0.0.1:{port}", timeout=240, log=data / "gateway.log", interval=0.5)
    return p


def _kill(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_a_replayed_epoch_stops_an_endless_function_past_its_budget(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    p = _start(tmp_path, port)
    try:
        r = httpx.post(f"{url}/invoke/acct/steady/add?mode=async", headers={**H, "Idempotency-Key": "first"},
                       content=json.dumps({"args": [5]}), timeout=60)
        t0 = time.monotonic()
        while r.status_code != 200 and time.monotonic() - t0 < 120:  # the first epochs of a busy host are slow
            r = httpx.get(f"{url}/requests/first?wait=2", headers=H, timeout=10)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/invoke/acct/bad/churn?mode=async", headers={**H, "Idempotency-Key": "churn"},
                       content=json.dumps({"args": [1]}), timeout=30)
        assert r.status_code in (200, 202), r.text
        time.sleep(2)  # churn runs, inside its 5 s budget
    finally:
        kill_tree(p)  # until the killed driver's JVM and Python workers are gone (was a fixed 2 s after the kill)
    p = _start(tmp_path, port)
    try:
        r = httpx.post(f"{url}/invoke/acct/steady/add?mode=async", headers={**H, "Idempotency-Key": "check"},
                       content=json.dumps({"args": [1]}), timeout=30)
        assert r.status_code in (200, 202), r.text
        t0 = time.monotonic()
        health = []
        while time.monotonic() - t0 < 120:
            assert p.poll() is None, (tmp_path / "gateway.log").read_text()[-3000:]
            h = httpx.get(url + "/health", timeout=10)
            health.append((round(time.monotonic() - t0, 1), h.status_code))
            r = httpx.get(f"{url}/requests/check?wait=2", headers=H, timeout=10)
            if r.status_code in (200, 409):
                break
        assert r.status_code == 200 and r.json()["value"] == 6, (r.status_code, r.text, health)
        churn = httpx.get(f"{url}/requests/churn", headers=H, timeout=10)
        assert churn.status_code == 409 and churn.json()["error"]["type"] == "InvocationTimeout", churn.text
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        _kill(p)
