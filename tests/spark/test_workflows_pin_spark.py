"""Workflow version pinning on the real PySpark engine (issue 34; one test: it is slow): ``charon run --engine
spark`` runs ``wf_pin_v1``; a workflow starts on it; a code update deploys ``wf_pin_v2``; the old workflow's later
steps run v1's code in the executors (their code book, from the recorded code history) while a new one runs v2's;
after a SIGKILL of the driver, its JVM and workers, the restarted driver answers the same and the workflows finish on
their own versions; the next update then unloads the drained versions (recorded, and the executors still run)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from nodeproc import kill_tree, start_charon, support_env
from wf_wait import at, until

from charon.client import Client
from charon.server.serve import free_port

pytestmark = pytest.mark.spark
TOKEN = "wf-pin-spark-token"


def _start(data: Path, port: int) -> subprocess.Popen[bytes]:
    env = support_env(CHARON_MASTER="local[2]", PYSPARK_PYTHON=sys.executable, CHARON_TOKEN=TOKEN,
                      CHARON_GATEWAY_CODE_REFS="wf_pin_v2:app")
    return start_charon(["run", "wf_pin_v1:app", "--engine", "spark", "--data-dir", str(data), "--partitions", "2"],
                        port=port, env=env, log=data.parent / f"spark-{time.time():.0f}.log", timeout=240,
                        group=True, stdout=True, interval=0.5)


def _done(r: dict[str, Any]) -> bool:
    return r["status"] == "done"


def test_a_workflow_keeps_its_version_on_spark_across_an_update_and_a_sigkill(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    data.mkdir()
    proc = _start(data, port)
    try:
        with Client(url, token=TOKEN, timeout=120, retries=5) as c:
            c.start_workflow("pin", None, id="old")
            old = until(c, "old", at("middle"), "started on v1", timeout=90.0, interval=0.2)
            assert old["version"] == "1" and old["state"]["ran"] == ["v1:begin"]
            assert c.update_code("wf_pin_v2:app", "v2")["version"] == "v2"
            assert c.invoke("probe", "x", "ping") == "v2"
            c.start_workflow("pin", None, id="new")
            new = until(c, "new", at("middle"), "started on v2", timeout=90.0, interval=0.2)
            assert new["version"] == "v2" and new["state"]["ran"] == ["v2:begin"]
            first = old["awaiting"][0]["id"]
            c.resolve(first, 1, request_id="r-old-1")
            old = until(c, "old", at("end"), "old's middle step", timeout=90.0, interval=0.2)
            assert old["version"] == "1" and old["state"]["ran"] == ["v1:begin", "v1:middle"], old  # pinned
            c.resolve(new["awaiting"][0]["id"], 1, request_id="r-new-1")
            new = until(c, "new", at("end"), "new's middle step", timeout=90.0, interval=0.2)
            assert new["state"]["ran"] == ["v2:begin", "v2:middle"], new
        kill_tree(proc)  # between steps: both workflows await a promise
        proc = _start(data, port)  # started with the old ref: the recorded code (v2) runs, v1 stays for "old"
        with Client(url, token=TOKEN, timeout=120, retries=5) as c:
            assert c.invoke("probe", "x", "ping") == "v2"
            assert c.workflow("pin", "old") == old and c.workflow("pin", "new") == new  # replay changed nothing
            again = c.resolve(first, 1, request_id="r-old-1")  # a retry: the same answer
            assert again["status"] == "resolved", again
            assert c.workflow("pin", "old")["state"]["ran"] == ["v1:begin", "v1:middle"]
            c.resolve(old["awaiting"][0]["id"], 2, request_id="r-old-2")
            c.resolve(new["awaiting"][0]["id"], 2, request_id="r-new-2")
            r_old = until(c, "old", _done, "old done", timeout=90.0, interval=0.2)
            r_new = until(c, "new", _done, "new done", timeout=90.0, interval=0.2)
            out = c.update_code("wf_pin_v2:app", "v3")  # nothing in flight: '1' and 'v2' drained, unloaded
            hist = httpx.get(f"{url}/admin/code/history", headers={"Authorization": f"Bearer {TOKEN}"},
                             timeout=60).json()["versions"]
            assert [(v["version"], v["unloaded_at"]) for v in hist] == [
                ("1", out["from_epoch"]), ("v2", out["from_epoch"]), ("v3", None)], hist
            c.start_workflow("pin", None, id="third")  # the executors' books without them still run workflows
            third = until(c, "third", at("middle"), "started on v3", timeout=90.0, interval=0.2)
            assert third["version"] == "v3" and third["state"]["ran"] == ["v2:begin"], third
    finally:
        kill_tree(proc)
    assert r_old["result"] == {"ran": ["v1:begin", "v1:middle", "v1:end"], "pinned": "1"}, r_old
    assert r_new["result"] == {"ran": ["v2:begin", "v2:middle", "v2:end"], "pinned": "v2"}, r_new
