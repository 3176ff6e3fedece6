"""Operating durable effects (issue 23 item 4), over real HTTP and real processes: parked failures listed with
attempts and last error (``GET /admin/effects``, ``charon effects list``), retried through the admin API, abandoned
through the CLI (the continuation then runs with ``EffectAbandoned``), and the effect metrics on ``/metrics``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from charon.cli.exitcodes import ExitCode
from charon.client import Client
from charon.server.serve import free_port

TESTS = Path(__file__).resolve().parents[1] / "support"  # the test apps and the external service
sys.path.insert(0, str(TESTS))
from effects_service import Service  # noqa: E402
from nodeproc import kill as _kill  # noqa: E402
from test_effects_kill import _env, _start_engine  # noqa: E402

TOKEN = "fx-ops-token"


def _cli(*args: str, service: Service) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "charon.cli", *args], env=_env(service), capture_output=True,
                          text=True, timeout=60)


def test_parked_effects_listed_retried_and_abandoned(tmp_path: Path) -> None:
    service = Service(str(tmp_path / "service.sqlite")).start()
    service.control(fail_rate=1.0)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    engine = _start_engine(data, port, service, "--effects", "--park-failed", "--token", TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with Client(url, token=TOKEN) as c:
            ids = {k: c.invoke("acct", k, "pay", 3, 1.0, 2) for k in ("r", "a")}
        deadline = time.monotonic() + 30
        while True:
            doc = httpx.get(url + "/admin/effects", params={"status": "failed"}, headers=auth, timeout=10).json()
            if len(doc["effects"]) == 2:
                break
            assert time.monotonic() < deadline, doc
            time.sleep(0.1)
        assert {e["id"] for e in doc["effects"]} == set(ids.values())
        assert all(e["attempts"] == 2 and "503" in e["last_error"] and e["status"] == "failed" for e in doc["effects"])
        assert httpx.get(url + "/admin/effects", timeout=10).status_code == 401  # the token is needed
        paths = httpx.get(url + "/openapi.json", timeout=10).json()["paths"]
        assert "/admin/effects" in paths and "/admin/effects/{effect_id}/{action}" in paths
        listed = _cli("effects", "list", "--data-dir", str(data), "--status", "failed", "--json", service=service)
        assert listed.returncode == 0 and len(json.loads(listed.stdout)["effects"]) == 2
        with Client(url, token=TOKEN) as c:
            assert c.state("acct", "r")["state"] == "charging"  # parked: nobody resumed yet
        service.control(fail_rate=0.0)
        r = httpx.post(f"{url}/admin/effects/{ids['r']}/retry", headers=auth, timeout=10)
        assert r.status_code == 200, r.text
        ab = _cli("effects", "abandon", ids["a"], "--data-dir", str(data), service=service)
        assert ab.returncode == 0, ab.stderr
        deadline = time.monotonic() + 30
        with Client(url, token=TOKEN) as c:
            while True:
                r_state, a_state = c.state("acct", "r"), c.state("acct", "a")
                if r_state["state"] != "charging" and a_state["state"] != "charging":
                    break
                assert time.monotonic() < deadline
                time.sleep(0.1)
            metrics = c.metrics()
        assert r_state["state"] == "paid" and r_state["runs"] == 1
        assert a_state["state"] == "failed" and a_state["result"]["error_type"] == "EffectAbandoned"
        assert a_state["runs"] == 1
        again = httpx.post(f"{url}/admin/effects/{ids['r']}/retry", headers=auth, timeout=10)
        assert again.status_code == 409 and again.json()["error"]["type"] == "NotParked"
        again_cli = _cli("effects", "retry", ids["a"], "--data-dir", str(data), service=service)
        assert again_cli.returncode == ExitCode.FAILED and "is not parked" in again_cli.stderr  # exit-codes.md
        assert list(service.stats()["applied"]) == [ids["r"]]  # the abandoned one never applied
        assert "charon_effect_attempts_total 5.0\n" in metrics  # 2 + 2 failed, 1 after the retry
        assert "charon_effect_attempt_failures_total 4.0\n" in metrics
        assert "charon_effect_exhausted_total 2.0\n" in metrics
    finally:
        _kill(engine)
        service.kill()
