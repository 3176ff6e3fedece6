"""Workflows across SIGKILLs (issue 34 item 4), over real processes: ``charon run --effects`` on the durable node
is SIGKILLed while workflows run their steps (an effect, then a promise) and while clients resolve the promises
that drive the next step; every step's transaction commits exactly once, every workflow ends once, stock is
conserved, and the routes answer typed 4xx (unknown workflow, bad id, duplicate id; the internal functions are
not invokable)."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from nodeproc import kill, start_charon, support_env

from charon import UnknownWorkflow, WorkflowExists
from charon.client import Client, GatewayError
from charon.server.serve import free_port

N = 12
TOKEN = "workflow-kill-test-token"
ORDER = {"sku": "apple", "qty": 1, "card": "visa", "amount": 5, "approval": True}
H = {"Authorization": f"Bearer {TOKEN}"}


def _env() -> dict[str, str]:
    return support_env(CHARON_TOKEN=TOKEN)


def _start(data: Path, port: int) -> subprocess.Popen[bytes]:
    return start_charon(["run", "workflows_app:app", "--data-dir", str(data), "--partitions", "2", "--effects"],
                        port=port, env=_env(), log=data.parent / f"node-{time.time():.3f}.log")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    kill(proc)


def _records(url: str) -> list[dict]:
    with Client(url, token=TOKEN, timeout=10, retries=5) as c:
        return [c.workflow("checkout", f"w{i}") for i in range(N)]


def _wait(url: str, pred, what: str, timeout: float = 90) -> list[dict]:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while True:
        try:
            recs = _records(url)
            if all(pred(r) for r in recs):
                return recs
        except (GatewayError, httpx.HTTPError, OSError, UnknownWorkflow):
            pass
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _resolve_all(url: str, pids: list[str], answers: dict[int, dict]) -> None:
    with Client(url, token=TOKEN, timeout=10, retries=1) as c:
        for i, pid in enumerate(pids):
            while i not in answers:
                try:
                    answers[i] = c.resolve(pid, {"n": i}, request_id=f"resolve-{i}")
                except (GatewayError, httpx.HTTPError, OSError):
                    time.sleep(0.2)


def test_each_step_commits_once_and_each_workflow_ends_once_across_kills(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    node = _start(data, port)
    try:
        with Client(url, token=TOKEN, timeout=30, retries=5) as c:
            c.invoke("stock", "apple", "put", 100, request_id="stock")
            starts = [c.start_workflow("checkout", ORDER, id=f"w{i}", request_id=f"start-{i}")
                      for i in range(N // 2)]
        _kill(node)  # killed while the first steps (and their effects) run
        node = _start(data, port)
        with Client(url, token=TOKEN, timeout=30, retries=5) as c:
            starts += [c.start_workflow("checkout", ORDER, id=f"w{i}", request_id=f"start-{i}")
                       for i in range(N // 2, N)]
            assert starts[0] == c.start_workflow("checkout", ORDER, id="w0", request_id="start-0"), \
                "a retried start: its first answer"
        time.sleep(0.3)
        _kill(node)
        node = _start(data, port)
        recs = _wait(url, lambda r: r["status"] == "waiting" and r["step"] == "approved", "all await approval")
        pids = [r["awaiting"][0]["id"] for r in recs]
        answers: dict[int, dict] = {}
        resolver = threading.Thread(target=_resolve_all, args=(url, pids, answers), daemon=True)
        resolver.start()
        for _ in range(3):  # killed around the resolves that drive the next step
            while len(answers) < 2 + len(answers) // 2 and resolver.is_alive():
                time.sleep(0.01)
            time.sleep(0.05)
            _kill(node)
            time.sleep(0.3)
            node = _start(data, port)
        resolver.join(timeout=120)
        assert len(answers) == N and all(a["status"] == "resolved" for a in answers.values())
        recs = _wait(url, lambda r: r["status"] == "done", "every workflow done")
        time.sleep(1.0)  # a second run of any step would have committed by now
        recs = _records(url)
        with Client(url, token=TOKEN, timeout=30, retries=5) as c:
            counts = [c.state("steps", f"w{i}") for i in range(N)]
            assert counts == [{"reserve": 1, "charged": 1, "approved": 1, "ship": 1}] * N, counts
            assert c.state("stock", "apple") == 100 - N, "each reserve took its stock once"
            assert c.resolve(pids[0], {"n": 0}, request_id="resolve-0") == answers[0], "the same answer"
            assert [r["status"] for r in recs] == ["done"] * N
            assert all([h["step"] for h in r["history"]] == ["reserve", "charged", "approved", "ship"] for r in recs)
            assert all(r["result"]["shipped"] == "apple" for r in recs)
            listed = c.workflows("checkout", limit=1000)["workflows"]
            assert sorted(r["id"] for r in listed) == sorted(f"w{i}" for i in range(N))
            # typed refusals, before the log
            with pytest.raises(WorkflowExists):
                c.start_workflow("checkout", {}, id="w1")
            with pytest.raises(UnknownWorkflow):
                c.start_workflow("nope", {})
            with pytest.raises(UnknownWorkflow):
                c.workflow("checkout", "never")
        r = httpx.post(f"{url}/workflows/checkout", json={"id": "w1", "input": 1}, headers=H, timeout=10)
        assert r.status_code == 409 and r.json()["error"]["type"] == "WorkflowExists"
        r = httpx.post(f"{url}/workflows/checkout", json={"id": 7}, headers=H, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidKey"
        r = httpx.post(f"{url}/workflows/checkout", json={"bogus": 1}, headers=H, timeout=10)
        assert r.status_code == 400
        # the workflow's internal functions are not a client's to call
        for fn, args in (("deliver", [{"ok": True, "value": 1}, 1]), ("run", [1, 1]), ("start", [{}])):
            r = httpx.post(f"{url}/invoke/charon.workflow.checkout/w1/{fn}", json={"args": args}, headers=H,
                           timeout=10)
            assert r.status_code == 404, (fn, r.status_code, r.text)
        r = httpx.post(f"{url}/batch", json={"calls": [["charon.workflow.checkout", "w1", "deliver", [{}, 1]]]},
                       headers=H, timeout=10)
        assert r.status_code == 404, r.text
    finally:
        _kill(node)
