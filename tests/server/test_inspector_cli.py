"""``charon requests list|show`` against a real ``charon run`` process (the in-process durable node, the inspector
sized by its options): list by error type, show the call graph and the traceback; the server logs the abort."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from nodeproc import wait_healthy

from charon.cli.exitcodes import ExitCode
from charon.server.serve import free_port

SUPPORT = Path(__file__).resolve().parents[1] / "support"
TOKEN = "cli-token"


def _charon(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from charon.cli import app; app()", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_requests_list_and_show_from_the_command_line(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(SUPPORT), "CHARON_URL": url, "CHARON_TOKEN": TOKEN}
    err = open(tmp_path / "server.err", "w")
    proc = subprocess.Popen([sys.executable, "-c", "from charon.cli import app; app()", "run", "inspector_app:app",
                             "--port", str(port), "--data-dir", str(tmp_path / "data"), "--no-fsync",
                             "--inspector-records", "3"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        h = {"Authorization": f"Bearer {TOKEN}"}
        wait_healthy(proc, url, log=tmp_path / "server.err", interval=0.2)
        r = httpx.post(url + "/invoke/bank/t9/transfer", json={"args": ["nobody", "b", 5]},
                       headers={**h, "Idempotency-Key": "the-failing-one"}, timeout=30)
        assert r.status_code == 409 and r.json()["error"]["type"] == "Overdrawn"
        for i in range(3):  # the inspector keeps 3: the abort is the oldest once a third deposit is in
            httpx.post(url + f"/invoke/account/k{i}/deposit", json={"args": [i]}, headers=h, timeout=30)
            if i == 1:
                listed = _charon("requests", "list", "--error-type", "Overdrawn", "--json", env=env)
                assert listed.returncode == 0, listed.stderr
                page = json.loads(listed.stdout)
                assert [i["request_id"] for i in page["items"]] == ["the-failing-one"]
                assert page["retention"]["max_records"] == 3
                shown = _charon("requests", "show", "the-failing-one", env=env)
                assert shown.returncode == 0, shown.stderr
                out = shown.stdout
                assert "Overdrawn" in out and "inspector_app.py" in out and "WITHDRAW-RAISES" in out
                assert "root bank.transfer key='t9'" in out and "call account.withdraw key='nobody' [RAISED]" in out
                table = _charon("requests", "list", "--status", "aborted", env=env)
                assert table.returncode == 0 and "the-failing-one" in table.stdout
                assert "bank.transfer" in table.stdout and "Overdrawn" in table.stdout  # whole columns in a pipe
        gone = _charon("requests", "show", "the-failing-one", env=env)  # dropped: 3 newer requests
        assert gone.returncode == ExitCode.REJECTED and "NotFound" in gone.stderr
        bad = _charon("requests", "list", "--status", "exploded", env=env)
        assert bad.returncode == ExitCode.REJECTED and "BadRequest" in bad.stderr
        wrong = _charon("requests", "list", env={**env, "CHARON_TOKEN": "wrong"})
        assert wrong.returncode == ExitCode.REJECTED and "Unauthorized" in wrong.stderr
        down = _charon("requests", "list", env={**env, "CHARON_URL": "http://127.0.0.1:9"})
        assert down.returncode == ExitCode.UNAVAILABLE and "cannot reach the gateway" in down.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        err.close()
    log = (tmp_path / "server.err").read_text()
    assert "request the-failing-one aborted: bank.transfer on key 't9' raised Overdrawn" in log
    assert "WITHDRAW-RAISES" in log  # the traceback is in the log line
