"""A code update that would drop the code of a version with workflows in flight is refused (issue 34): 409
``VersionInUse`` over HTTP on the node, naming the version and how many still run on it, before anything is
recorded; the clients raise :class:`~charon.VersionInUse`. "Dropped" is the rule of docs/internals/workflows.md:
the version's recorded ref is no longer installed. The engine's ``update_code`` decides it (every caller gets the
rule: tests/runtime/test_version_drain.py); the route maps it to its 409. Once its workflows finished, the same
deploy applies and unloads the drained version (``unloaded_at`` in the code history)."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
from wf_pin_v1 import app
from wf_wait import at, until

from charon import VersionInUse
from charon.client import Client
from charon.config import GatewayConfig
from charon.runtime.node.inprocess import InProcessRuntime
from charon.server.serve import BackgroundServer

TOKEN = "version-in-use-token"


def test_a_deploy_that_drops_a_version_in_use_is_refused_until_it_drained(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"wf_gone_{uuid.uuid4().hex[:8]}"  # an installed module (v1's steps) that is removed later
    module = tmp_path / f"{name}.py"
    module.write_text("from wf_pin_v1 import app  # noqa: F401\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = GatewayConfig(code_refs=f"{name}:app,wf_pin_v2:app")
    rt = InProcessRuntime(app, partitions=2)
    with BackgroundServer(rt, token=TOKEN, config=cfg) as srv, Client(srv.url, token=TOKEN, timeout=30) as c:
        assert c.update_code(f"{name}:app", "gone")["version"] == "gone"
        c.start_workflow("pin", None, id="w1")
        first = until(c, "w1", at("middle"), "started on 'gone'")["awaiting"][0]["id"]
        assert c.workflow("pin", "w1")["version"] == "gone"
        module.unlink()  # the version's code is no longer installed (its module stays imported in this process)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        history = httpx.get(f"{srv.url}/admin/code/history", headers=auth, timeout=30).json()
        r = httpx.post(f"{srv.url}/admin/code", json={"ref": "wf_pin_v2:app", "version": "v2"}, headers=auth,
                       timeout=30)
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert err["type"] == "VersionInUse" and "'gone'" in err["message"] and "1 workflow" in err["message"], err
        with pytest.raises(VersionInUse, match="'gone' has 1 workflow"):
            c.update_code("wf_pin_v2:app", "v2")
        assert httpx.get(f"{srv.url}/admin/code/history", headers=auth, timeout=30).json() == history  # unrecorded
        assert [v["version"] for v in history["versions"]] == ["1", "gone"]
        assert c.status()["code_version"] == "gone"
        c.resolve(first, 1)  # its steps still run its own (loaded) code
        second = until(c, "w1", at("end"), "its middle step")
        assert second["state"]["ran"] == ["v1:begin", "v1:middle"]
        c.resolve(second["awaiting"][0]["id"], 1)
        done = until(c, "w1", lambda r: r["status"] == "done", "w1 done")
        assert done["result"] == {"ran": ["v1:begin", "v1:middle", "v1:end"], "pinned": "gone"}
        out = c.update_code("wf_pin_v2:app", "v2")  # nothing in flight on 'gone' any more: applied
        assert out["version"] == "v2" and c.invoke("probe", "x", "ping") == "v2"
        after = httpx.get(f"{srv.url}/admin/code/history", headers=auth, timeout=30).json()["versions"]
        assert [(v["version"], v["unloaded_at"]) for v in after] == [("1", None), ("gone", out["from_epoch"]),
                                                                     ("v2", None)]  # drained: unloaded
