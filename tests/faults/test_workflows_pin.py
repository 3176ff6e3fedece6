"""Workflow version pinning over real processes (issue 34 item 4): ``charon run`` on the durable node runs
``wf_pin_v1``; workflows start on it; ``charon deploy wf_pin_v2:app v2`` updates the code; the node is SIGKILLed
between steps and restarted (with the old ref: the recorded code is kept); a workflow started before the update
runs its later steps on v1's code, one started after on v2's; ``charon workflows versions`` shows the drain;
``charon workflows migrate --from 1`` moves the rest (audited, each move its own transaction: a finished one is
skipped; v2's ``@pin.migrates("1", ...)`` maps their step and state), after which their steps run v2, also across
another SIGKILL."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from nodeproc import kill, start_charon, support_env

from charon.client import Client, GatewayError
from charon.server.serve import free_port

TOKEN = "workflow-pin-test-token"


def _env() -> dict[str, str]:
    return support_env(CHARON_TOKEN=TOKEN, CHARON_GATEWAY_CODE_REFS="wf_pin_v2:app")


def _start(data: Path, port: int) -> subprocess.Popen[bytes]:
    return start_charon(["run", "wf_pin_v1:app", "--data-dir", str(data), "--partitions", "2"],
                        port=port, env=_env(), log=data.parent / "node.log")


def _cli(url: str, *args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "charon.cli", *args, "--url", url], env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _wait(c: Client, wid: str, pred: Any, what: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            rec = c.workflow("pin", wid)
            if pred(rec):
                return rec
        except (GatewayError, httpx.HTTPError, OSError):
            rec = None
        assert time.monotonic() < deadline, f"{what}: {rec}"
        time.sleep(0.1)


def _waiting_at(step: str) -> Any:
    return lambda r: r["status"] == "waiting" and r["step"] == step and r["awaiting"]


def test_pinned_versions_drain_and_migrate_across_sigkills(tmp_path: Path) -> None:
    data, port = tmp_path / "data", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(data, port)
    try:
        with Client(url, token=TOKEN, timeout=20, retries=5) as c:
            for wid in ("old1", "old2", "old3"):
                c.start_workflow("pin", None, id=wid)
            old = {w: _wait(c, w, _waiting_at("middle"), "started on v1") for w in ("old1", "old2", "old3")}
            assert {r["version"] for r in old.values()} == {"1"}
            deployed = _cli(url, "deploy", "wf_pin_v2:app", "v2")
            assert deployed["version"] == "v2"
            assert c.invoke("probe", "x", "ping") == "v2"
            c.start_workflow("pin", None, id="new1")
            new = _wait(c, "new1", _waiting_at("middle"), "started on v2")
            assert new["version"] == "v2" and new["state"]["ran"] == ["v2:begin"]
        kill(proc)  # between steps: every workflow awaits a promise
        proc = _start(data, port)  # started with the old ref: the recorded code (v2) runs
        with Client(url, token=TOKEN, timeout=20, retries=5) as c:
            assert c.invoke("probe", "x", "ping") == "v2"
            c.resolve(old["old1"]["awaiting"][0]["id"], 1)
            r = _wait(c, "old1", _waiting_at("end"), "old1's middle step")
            assert r["version"] == "1" and r["state"]["ran"] == ["v1:begin", "v1:middle"], r
            c.resolve(new["awaiting"][0]["id"], 1)
            r = _wait(c, "new1", _waiting_at("end"), "new1's middle step")
            assert r["state"]["ran"] == ["v2:begin", "v2:middle"], r
            c.resolve(r["awaiting"][0]["id"], 1)
            r = _wait(c, "new1", lambda r: r["status"] == "done", "new1 done")
            assert r["result"] == {"ran": ["v2:begin", "v2:middle", "v2:end"], "pinned": "v2"}
            drain = _cli(url, "workflows", "versions")
            assert drain["current"] == "v2"
            assert drain["versions"] == {"1": {"running": 0, "waiting": 3}}, drain
        kill(proc)
        proc = _start(data, port)
        with Client(url, token=TOKEN, timeout=20, retries=5) as c:
            r = _wait(c, "old1", _waiting_at("end"), "old1 after the second restart")
            c.resolve(r["awaiting"][0]["id"], 1)
            r = _wait(c, "old1", lambda r: r["status"] == "done", "old1 done")
            assert r["result"] == {"ran": ["v1:begin", "v1:middle", "v1:end"], "pinned": "1"}  # v1 to the end
            dry = _cli(url, "workflows", "migrate", "--from", "1", "--dry-run")
            assert dry["pin"]["matched"] == 2 and dry["pin"]["done"] == 0 and dry["pin"]["would_skip"] == {}
            assert c.workflow("pin", "old2")["version"] == "1"  # a dry run changes nothing
            moved = _cli(url, "workflows", "migrate", "--from", "1")
            assert moved["pin"]["done"] == 2 and sorted(moved["pin"]["items"]) == ["old2", "old3"], moved
            again = c.migrate_workflows("pin", "1")  # nothing left on version 1
            assert again["matched"] == 0 and again["done"] == 0
            assert _cli(url, "workflows", "versions")["versions"] == {"v2": {"running": 0, "waiting": 2}}
            r2 = c.workflow("pin", "old2")
            assert r2["version"] == "v2" and r2["history"][-1]["migrated"] == ["1", "v2"]
            assert r2["history"][-1]["to_step"] == "middle" and r2["state"]["from"] == "1"  # v2's declared mapping
        kill(proc)  # migrated, then killed: the move is durable
        proc = _start(data, port)
        with Client(url, token=TOKEN, timeout=20, retries=5) as c:
            for wid in ("old2", "old3"):
                r = _wait(c, wid, _waiting_at("middle"), f"{wid} after the kill")
                assert r["version"] == "v2"
                c.resolve(r["awaiting"][0]["id"], 1)
                r = _wait(c, wid, _waiting_at("end"), f"{wid}'s middle step")
                assert r["state"]["ran"] == ["v1:begin", "v2:middle"], r  # the old start, then the new code
                assert r["state"]["from"] == "1"  # the migration's state, kept across the kill
                c.resolve(r["awaiting"][0]["id"], 1)
                r = _wait(c, wid, lambda r: r["status"] == "done", f"{wid} done")
                assert r["result"] == {"ran": ["v1:begin", "v2:middle", "v2:end"], "pinned": "v2"}
            assert _cli(url, "workflows", "versions")["versions"] == {}
        log = (tmp_path / "node.log").read_text(errors="replace")
        assert "workflows migrate" in log  # the operator action is audited
    finally:
        kill(proc)
